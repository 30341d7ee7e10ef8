// dtrain::SummaryWriter: PyTorch's SummaryWriter over EventFile (one per run folder) and the Event
// encoders of events.h, with PyTorch's flush timer.
#include "dtrain/summary_writer.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <ctime>
#include <filesystem>
#include <mutex>
#include <thread>

#include <ATen/ATen.h>

#include "common/util.h"
#include "dtrain/errors.h"
#include "monitor/tensorboard/event_file.h"
#include "monitor/tensorboard/events.h"
#include "monitor/tensorboard/histogram.h"

namespace dtrain {
namespace tb = tensorboard;

namespace {

// PyTorch's default log_dir: runs/<%b%d_%H-%M-%S>_<host><comment>.
std::string default_log_dir(const std::string& comment) {
  const std::time_t t = std::time(nullptr);
  std::tm tm{};
  localtime_r(&t, &tm);
  char stamp[32];
  std::strftime(stamp, sizeof(stamp), "%b%d_%H-%M-%S", &tm);
  return (std::filesystem::path("runs") / detail::cat(stamp, "_", util::host_name(), comment)).string();
}

}  // namespace

struct SummaryWriter::Impl {
  std::string log_dir;
  SummaryWriterOptions o;
  std::unique_ptr<tb::EventFile> main;
  // add_scalars' runs, by folder, in the order they appeared.
  std::vector<std::pair<std::string, std::unique_ptr<tb::EventFile>>> others;
  // The files are shared by the caller's thread and the flush timer: every access holds `mu`.
  std::mutex mu;
  std::condition_variable wake;  // the timer's sleep; the destructor ends it early
  bool stopping = false;
  std::thread timer;

  tb::EventFileOptions file_options() const {
    return tb::EventFileOptions{o.max_queue(), o.flush_secs(), o.filename_suffix(), log_dir};
  }
  // As PyTorch's _get_file_writer: the main file is (re)created on first use.
  tb::EventFile& main_file() {
    if (!main) main = std::make_unique<tb::EventFile>(log_dir, file_options());
    return *main;
  }
  tb::EventFile& run_file(const std::string& dir) {
    for (auto& [d, f] : others)
      if (d == dir) return *f;
    others.emplace_back(dir, std::make_unique<tb::EventFile>(dir, file_options()));
    return *others.back().second;
  }
  void flush_all() {
    if (main) main->flush();
    for (auto& [d, f] : others) f->flush();
  }
  // PyTorch's writer flushes every flush_secs on a thread of its own, so the last values of a quiet
  // phase (one value per long epoch) reach TensorBoard without waiting for the next add. Nothing may
  // leave this thread: EventFile turns a failed write into one warning, and anything else thrown
  // (an allocation in that warning) is dropped with the flush, as a failed flush would be.
  void timer_loop() noexcept {
    // Clamped so that now + period cannot overflow the clock: 1e9 s is "never" for a run.
    const auto period = std::chrono::duration<double>(std::min(o.flush_secs(), 1e9));
    std::unique_lock<std::mutex> lock(mu);
    while (!wake.wait_for(lock, period, [this] { return stopping; })) {
      try {
        flush_all();
      } catch (...) {
      }
    }
  }
};

SummaryWriter::SummaryWriter(std::string log_dir, SummaryWriterOptions options) : impl_(std::make_unique<Impl>()) {
  auto& s = *impl_;
  DTRAIN_CHECK(options.max_queue() > 0, "SummaryWriterOptions: max_queue must be > 0 events, got ",
               options.max_queue());
  DTRAIN_CHECK(options.flush_secs() >= 0, "SummaryWriterOptions: flush_secs must be >= 0 seconds, got ",
               options.flush_secs());
  DTRAIN_CHECK(options.filename_suffix().find('/') == std::string::npos,
               "SummaryWriterOptions: filename_suffix must not contain '/', got \"", options.filename_suffix(),
               "\": put folders into log_dir");
  s.o = std::move(options);
  s.log_dir = log_dir.empty() ? default_log_dir(s.o.comment()) : std::move(log_dir);
  s.main_file();  // the run shows up in TensorBoard before its first value, as PyTorch's
  // flush_secs 0 flushes at every add: no timer needed (and none could sleep 0 s in a loop).
  if (s.o.flush_secs() > 0) s.timer = std::thread([&s] { s.timer_loop(); });
}

SummaryWriter::~SummaryWriter() {
  auto& s = *impl_;
  if (s.timer.joinable()) {
    {
      std::lock_guard<std::mutex> lock(s.mu);
      s.stopping = true;
    }
    s.wake.notify_one();
    s.timer.join();
  }
  close();
}

void SummaryWriter::add_scalar(const std::string& tag, double scalar_value, std::optional<int64_t> global_step,
                               std::optional<double> walltime) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->main_file().add(tb::scalar_event(tag, static_cast<float>(scalar_value), global_step.value_or(0),
                                          walltime.value_or(tb::wall_time_now())));
}

void SummaryWriter::add_scalars(const std::string& main_tag, const std::map<std::string, double>& tag_scalar_dict,
                                std::optional<int64_t> global_step, std::optional<double> walltime) {
  auto& s = *impl_;
  std::lock_guard<std::mutex> lock(s.mu);
  const double t = walltime.value_or(tb::wall_time_now());  // one time for all, as PyTorch
  std::string folder = main_tag;
  for (char& c : folder)
    if (c == '/') c = '_';
  for (const auto& [tag, value] : tag_scalar_dict) {
    const std::string dir = s.log_dir + "/" + folder + "_" + tag;
    s.run_file(dir).add(tb::scalar_event(main_tag, static_cast<float>(value), global_step.value_or(0), t));
  }
}

void SummaryWriter::add_histogram(const std::string& tag, const at::Tensor& values, std::optional<int64_t> global_step,
                                  std::optional<double> walltime) {
  DTRAIN_CHECK(values.defined() && values.numel() > 0, "SummaryWriter::add_histogram: tag ", tag,
               ": the tensor has no element (", values.defined() ? "numel 0" : "undefined",
               "): pass the values to histogram");
  tb::Histogram h;
  if (!tb::make_histogram(values, tb::default_bucket_edges(), h)) {
    warn_once("tensorboard-histogram:" + tag,
              detail::cat("SummaryWriter::add_histogram: tag ", tag, ": no finite value within +-1e20 among ",
                          values.numel(), " values; the histogram is skipped (warned once per tag)"));
    return;
  }
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->main_file().add(tb::histogram_event(tag, h, global_step.value_or(0), walltime.value_or(tb::wall_time_now())));
}

void SummaryWriter::add_text(const std::string& tag, const std::string& text_string, std::optional<int64_t> global_step,
                             std::optional<double> walltime) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->main_file().add(
      tb::text_event(tag, text_string, global_step.value_or(0), walltime.value_or(tb::wall_time_now())));
}

void SummaryWriter::flush() {
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->flush_all();
}

void SummaryWriter::close() {
  auto& s = *impl_;
  std::lock_guard<std::mutex> lock(s.mu);
  if (s.main) s.main->close();
  s.main.reset();
  for (auto& [dir, f] : s.others) f->close();
  s.others.clear();
}

const std::string& SummaryWriter::get_logdir() const { return impl_->log_dir; }

}  // namespace dtrain
