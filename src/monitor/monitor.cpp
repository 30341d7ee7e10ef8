// dtrain::Monitor: per-step measurement, window aggregation over ranks, and the files at close().
//
// Per step (end_step to end_step, on every rank):
//   1. Phase scopes add their durations; DDP's hook gives each bucket's [launch, done] interval and
//      the times autograd finished (kBackwardEnd) and the gradients were synced (kGradsSynced).
//   2. end_step: comm_ms = length of the union of the bucket intervals; comm_wait_ms = kGradsSynced -
//      kBackwardEnd; other = step - forward - backward - optimizer. Trace records for traced steps.
//   3. The step's values are added to the window sums; every log_every steps the window means go
//      into one all_gather (K doubles per rank) and rank 0 computes min/mean/max, the slowest rank
//      and the global throughput, and appends a line to metrics.jsonl.
// Cost when measuring: a few clock reads per phase, one local gradient-norm computation per window (on its
// last step; skipped when the loop passes grad_norm), an RSS read and a small collective per window.
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <sstream>

#include <ATen/ATen.h>

#include "common/util.h"
#include "dtrain/ddp.h"
#include "dtrain/monitor.h"
#include "dtrain/system.h"
#include "monitor/tensorboard/monitor_log.h"
#include "monitor/run_plot.h"
#include "monitor/timeline.h"

namespace dtrain {
namespace {

// Monitor::watch passes DDPEvent::Kind as an int (monitor.h does not include the DDP module headers).
constexpr int kBucketLaunched = static_cast<int>(DDPEvent::Kind::kBucketLaunched),
              kBucketDone = static_cast<int>(DDPEvent::Kind::kBucketDone),
              kBackwardEnd = static_cast<int>(DDPEvent::Kind::kBackwardEnd),
              kGradsSynced = static_cast<int>(DDPEvent::Kind::kGradsSynced);

// The fields every rank contributes per window, in all_gather order.
enum Field {
  kStepMs,
  kOtherMs,
  kForwardMs,
  kBackwardMs,
  kOptimizerMs,
  kCommMs,
  kCommWaitMs,
  kLoss,
  kAccuracy,
  kLr,
  kGradNorm,
  kSamples,
  kWindowS,
  kRssMb,
  kComputeMs,
  kNumFields
};

// Length of the union of [begin, end] intervals.
int64_t union_length(std::vector<std::pair<int64_t, int64_t>> v) {
  std::sort(v.begin(), v.end());
  int64_t total = 0, cur_b = 0, cur_e = -1;
  for (auto& [b, e] : v) {
    if (e < b) continue;
    if (cur_e < cur_b || b > cur_e) {
      if (cur_e >= cur_b) total += cur_e - cur_b;
      cur_b = b, cur_e = e;
    } else {
      cur_e = std::max(cur_e, e);
    }
  }
  if (cur_e >= cur_b) total += cur_e - cur_b;
  return total;
}

// Mean of the finite values (NaN when none).
double finite_mean(const std::vector<double>& v) {
  double s = 0;
  int n = 0;
  for (double x : v)
    if (std::isfinite(x)) s += x, ++n;
  return n ? s / n : std::nan("");
}

RankStat rank_stat(const std::vector<double>& v) {
  RankStat s;
  s.min = s.max = v[0];
  double sum = 0;
  for (size_t r = 0; r < v.size(); ++r) {
    sum += v[r];
    s.min = std::min(s.min, v[r]);
    if (v[r] > s.max) s.max = v[r], s.max_rank = static_cast<int>(r);
  }
  s.mean = sum / v.size();
  return s;
}

void write_text(const std::string& path, const std::string& text) {
  std::FILE* f = util::create_file(path);  // never through a link planted at the name
  const bool written = f && std::fwrite(text.data(), 1, text.size(), f) == text.size();
  const int err = errno;
  const bool closed = f && std::fclose(f) == 0;
  DTRAIN_CHECK(written && closed, "Monitor: cannot write ", path, ": ", std::strerror(err), ": check output_dir");
}

}  // namespace

struct Monitor::Impl {
  MonitorOptions o;
  bool distributed = false;
  int rank = 0, size = 1;
  int64_t t0 = 0;
  std::vector<at::Tensor> params;
  std::vector<std::string> param_names;
  int epoch = 0;
  int64_t step = 0;  // steps ended so far
  int64_t step_start = 0;
  double phase_ms[3] = {0, 0, 0};
  bool closed = false;

  // DDP events of the current step (the hook may run on an autograd device thread).
  std::mutex ev_mu;
  std::vector<int64_t> launch_ns;
  std::vector<std::pair<int64_t, int64_t>> comm;
  int64_t backward_end = 0, synced = 0;

  // Window sums, and how many steps had a finite value (loss, accuracy, lr and grad_norm may be absent).
  double sums[kNumFields] = {};
  int64_t counts[kNumFields] = {};
  int64_t window_steps = 0;
  double last_rss_mb = 0;

  // Progress (group rank 0).
  std::unique_ptr<Progress> progress;
  int64_t epoch_step = 0;
  double epoch_loss_sum = 0, epoch_samples = 0;

  StepMetrics last;
  std::vector<WindowMetrics> windows;
  std::vector<EpochMetrics> epochs;
  std::FILE* metrics_file = nullptr;
  std::FILE* rank_file = nullptr;
  std::unique_ptr<monitor::Timeline> timeline;
  std::unique_ptr<monitor::TensorBoardLog> tensorboard;  // rank 0, tensorboard(true)

  bool tracing() const { return timeline && (o.trace_steps() < 0 || step < o.trace_steps()); }
  void trace(const char* name, int tid, int64_t b, int64_t e, int index = -1) {
    timeline->add(monitor::TraceRecord{name, tid, b, e, step + 1, index});
  }
  std::string path(const std::string& name) const { return (std::filesystem::path(o.output_dir()) / name).string(); }
  void aggregate();
  // sqrt(sum of squares) over the watched parameters' gradients, as clip_grad_norm_'s total norm
  // (NaN when nothing is watched).
  double grad_norm() const {
    if (params.empty()) return std::nan("");
    at::NoGradGuard ng;
    double sq = 0;
    for (const auto& p : params) {
      const at::Tensor& g = p.grad();
      if (g.defined()) sq += g.pow(2).sum().item<double>();
    }
    return std::sqrt(sq);
  }
};

Monitor::Monitor(MonitorOptions options)
    : impl_(std::make_unique<Impl>()), self_(std::make_shared<std::atomic<Monitor*>>(this)) {
  auto& s = *impl_;
  s.o = std::move(options);
  DTRAIN_CHECK(s.o.log_every() > 0, "MonitorOptions: log_every must be > 0 steps, got ", s.o.log_every());
  DTRAIN_CHECK(s.o.total_steps() >= 0, "MonitorOptions: total_steps must be >= 0, got ", s.o.total_steps());
  DTRAIN_CHECK(!s.o.tensorboard() || !s.o.output_dir().empty(),
               "MonitorOptions: tensorboard(true) needs an output_dir for the event files: set output_dir");
  DTRAIN_CHECK(s.o.histogram_every() >= 0, "MonitorOptions: histogram_every must be >= 0 windows, got ",
               s.o.histogram_every());
  if (is_initialized()) {
    const Group& g = s.o.process_group();
    DTRAIN_CHECK(g.is_member(), "Monitor: rank ", dtrain::rank(),
                 " is not a member of the given process_group: create the monitor only on its ranks");
    s.distributed = g.size() > 1;
    s.rank = g.rank();
    s.size = g.size();
    if (s.distributed) barrier(g);  // the ranks' timelines start together
  }
  s.t0 = util::now_ns();
  s.step_start = s.t0;
  if (!s.o.output_dir().empty()) {
    std::error_code ec;
    std::filesystem::create_directories(s.o.output_dir(), ec);
    DTRAIN_CHECK(!ec && std::filesystem::is_directory(s.o.output_dir()), "MonitorOptions: output_dir ",
                 s.o.output_dir(), " cannot be created: ", ec ? ec.message() : "not a folder");
    if (s.rank == 0) {
      s.metrics_file = util::create_file(s.path("metrics.jsonl"));
      DTRAIN_CHECK(s.metrics_file, "Monitor: cannot create ", s.path("metrics.jsonl"), ": ", std::strerror(errno));
    }
    if (s.o.per_rank_metrics()) {
      const std::string p = s.path("metrics_rank" + std::to_string(s.rank) + ".jsonl");
      s.rank_file = util::create_file(p);
      DTRAIN_CHECK(s.rank_file, "Monitor: cannot create ", p, ": ", std::strerror(errno));
    }
    if (s.o.tensorboard() && s.rank == 0)
      s.tensorboard = std::make_unique<monitor::TensorBoardLog>(s.o.output_dir(), s.o.histogram_every());
    if (s.o.trace_steps() != 0)
      s.timeline =
          std::make_unique<monitor::Timeline>(s.path("trace_rank" + std::to_string(s.rank) + ".part"), s.rank, s.t0);
  }
  if (s.o.progress() && s.rank == 0 && s.o.total_steps() > 0)
    s.progress = std::make_unique<Progress>(
        ProgressOptions().total(s.o.total_steps()).out(s.o.progress_out()).terminal(s.o.progress_terminal()));
}

Monitor::~Monitor() {
  self_->store(nullptr);
  auto& s = *impl_;
  if (s.timeline) s.timeline->finish();  // the part file stays when close() was not called
  if (s.metrics_file) std::fclose(s.metrics_file);
  if (s.rank_file) std::fclose(s.rank_file);
}

void Monitor::watch_parameters(std::vector<at::Tensor> params, std::vector<std::string> names) {
  DTRAIN_CHECK(names.empty() || names.size() == params.size(), "Monitor::watch_parameters: ", names.size(),
               " names for ", params.size(), " parameters: pass one name per parameter, or none");
  impl_->params = std::move(params);
  impl_->param_names = std::move(names);
}

void Monitor::begin_epoch(int64_t epoch, int64_t epochs, int64_t steps, int64_t done) {
  auto& s = *impl_;
  DTRAIN_CHECK(steps > 0, "Monitor::begin_epoch: steps must be > 0, got ", steps);
  s.epoch = static_cast<int>(epoch);
  DTRAIN_CHECK(done >= 0 && done <= steps, "Monitor::begin_epoch: done must be in [0, ", steps, "], got ", done);
  s.epoch_step = done;
  s.epoch_loss_sum = s.epoch_samples = 0;
  if (s.progress) s.progress->finish();
  s.progress.reset();
  if (s.o.progress() && s.rank == 0)
    s.progress = std::make_unique<Progress>(ProgressOptions()
                                                .label(detail::cat("epoch ", epoch, "/", epochs))
                                                .total(steps)
                                                .out(s.o.progress_out())
                                                .terminal(s.o.progress_terminal()));
  begin_step();
}

void Monitor::end_epoch() {
  auto& s = *impl_;
  if (s.progress) s.progress->finish();
  s.progress.reset();
}

void Monitor::log_epoch(int64_t epoch, const EpochInfo& info) {
  auto& s = *impl_;
  DTRAIN_CHECK(!s.closed, "Monitor::log_epoch after close(): log the epoch before close()");
  if (s.tensorboard) s.tensorboard->epoch(epoch, info);
  if (s.rank != 0) return;
  s.epochs.push_back(
      EpochMetrics{epoch, s.step, info.train_loss(), info.train_accuracy(), info.test_loss(), info.test_accuracy()});
}

void Monitor::begin_step() {
  auto& s = *impl_;
  s.step_start = util::now_ns();
  s.phase_ms[0] = s.phase_ms[1] = s.phase_ms[2] = 0;
}

Monitor::PhaseScope::PhaseScope(Monitor* m, Phase p) : m_(m), p_(p), t0_(util::now_ns()) {}
Monitor::PhaseScope::~PhaseScope() {
  if (m_) m_->phase_done(p_, t0_, util::now_ns());
}

void Monitor::phase_done(Phase p, int64_t t0, int64_t t1) {
  auto& s = *impl_;
  s.phase_ms[static_cast<int>(p)] += (t1 - t0) / 1e6;
  static const char* kNames[] = {"forward", "backward", "optimizer"};
  if (s.tracing()) s.trace(kNames[static_cast<int>(p)], 0, t0, t1);
}

void Monitor::on_ddp_event(int kind, int index, int64_t t) {
  auto& s = *impl_;
  std::lock_guard<std::mutex> g(s.ev_mu);
  switch (kind) {
    case kBucketLaunched:
      if (index >= static_cast<int>(s.launch_ns.size())) s.launch_ns.resize(index + 1, 0);
      s.launch_ns[index] = t;
      break;
    case kBucketDone:
      if (index < static_cast<int>(s.launch_ns.size()) && s.launch_ns[index] > 0) {
        s.comm.emplace_back(s.launch_ns[index], t);
        if (s.tracing()) s.trace("allreduce bucket", 1, s.launch_ns[index], t, index);
      }
      break;
    case kBackwardEnd:
      s.backward_end = t;
      break;
    case kGradsSynced:
      s.synced = t;
      if (s.tracing() && s.backward_end > 0) s.trace("ddp wait for gradients", 0, s.backward_end, t);
      break;
    default:
      break;
  }
}

void Monitor::end_step(const StepInfo& info) {
  auto& s = *impl_;
  DTRAIN_CHECK(!s.closed, "Monitor::end_step after close(): create a new Monitor for a new run");
  const int64_t t = util::now_ns();
  StepMetrics& m = s.last;
  m.step = s.step + 1;
  m.step_ms = (t - s.step_start) / 1e6;
  m.forward_ms = s.phase_ms[0];
  m.backward_ms = s.phase_ms[1];
  m.optimizer_ms = s.phase_ms[2];
  m.other_ms = std::max(0.0, m.step_ms - m.forward_ms - m.backward_ms - m.optimizer_ms);
  {
    std::lock_guard<std::mutex> g(s.ev_mu);
    m.comm_ms = union_length(s.comm) / 1e6;
    m.comm_wait_ms = s.synced > s.backward_end && s.backward_end > 0 ? (s.synced - s.backward_end) / 1e6 : 0.0;
    s.comm.clear();
    std::fill(s.launch_ns.begin(), s.launch_ns.end(), 0);
    s.backward_end = s.synced = 0;
  }
  m.loss = info.loss();
  m.accuracy = info.accuracy();
  m.lr = info.lr();
  m.grad_norm = info.grad_norm();
  if (!std::isfinite(m.grad_norm) && s.window_steps + 1 == s.o.log_every()) m.grad_norm = s.grad_norm();
  m.samples = info.samples();
  m.samples_per_s = m.step_ms > 0 ? m.samples / (m.step_ms / 1e3) : 0.0;
  if (s.window_steps == 0 || s.step == 0) s.last_rss_mb = rss_bytes() / 1048576.0;  // once per window
  m.rss_mb = s.last_rss_mb;

  if (s.tracing()) s.trace("step", 0, s.step_start, t);
  if (s.rank_file) {
    std::fprintf(s.rank_file, "%s\n", metrics_json(m, s.rank).c_str());
    if (m.step % s.o.log_every() == 0) std::fflush(s.rank_file);
  }

  const double values[kNumFields] = {m.step_ms,
                                     m.other_ms,
                                     m.forward_ms,
                                     m.backward_ms,
                                     m.optimizer_ms,
                                     m.comm_ms,
                                     m.comm_wait_ms,
                                     m.loss,
                                     m.accuracy,
                                     m.lr,
                                     m.grad_norm,
                                     static_cast<double>(m.samples),
                                     m.step_ms / 1e3,
                                     m.rss_mb,
                                     m.step_ms - m.comm_wait_ms};
  for (int f = 0; f < kNumFields; ++f)
    if (std::isfinite(values[f])) s.sums[f] += values[f], ++s.counts[f];
  ++s.window_steps;
  ++s.step;

  if (s.progress) {
    ++s.epoch_step;
    if (std::isfinite(m.loss) && m.samples > 0) s.epoch_loss_sum += m.loss * m.samples;
    s.epoch_samples += m.samples;
    // Throughput shown: this rank's samples x the number of ranks (the exact global count is in
    // metrics.jsonl).
    s.progress->update(s.epoch_step, s.epoch_samples > 0 ? s.epoch_loss_sum / s.epoch_samples : m.loss,
                       s.epoch_samples * s.size);
  }
  if (s.window_steps == s.o.log_every()) s.aggregate();
  s.step_start = util::now_ns();  // monitoring's own time counts to no step
  s.phase_ms[0] = s.phase_ms[1] = s.phase_ms[2] = 0;
}

void Monitor::Impl::aggregate() {
  // Step 3: window means (sums of samples and seconds), gathered from every rank.
  double mine[kNumFields];
  for (int f = 0; f < kNumFields; ++f)
    mine[f] = (f == kSamples || f == kWindowS) ? sums[f] : counts[f] ? sums[f] / counts[f] : std::nan("");
  mine[kRssMb] = rss_bytes() / 1048576.0;
  std::vector<std::vector<double>> all(kNumFields, std::vector<double>(size));
  if (distributed) {
    const auto every = all_gather_values(std::vector<double>(mine, mine + kNumFields), o.process_group());
    for (int r = 0; r < size; ++r)
      for (int f = 0; f < kNumFields; ++f) all[f][r] = every[r][f];
  } else {
    for (int f = 0; f < kNumFields; ++f) all[f][0] = mine[f];
  }
  const int64_t n = window_steps;
  window_steps = 0;
  std::fill(std::begin(sums), std::end(sums), 0.0);
  std::fill(std::begin(counts), std::end(counts), int64_t{0});
  if (rank != 0) return;

  WindowMetrics wm;
  wm.step = step;
  wm.steps = n;
  wm.time_s = (util::now_ns() - t0) / 1e9;
  wm.epoch = epoch;
  wm.loss = finite_mean(all[kLoss]);
  wm.accuracy = finite_mean(all[kAccuracy]);
  wm.lr = finite_mean(all[kLr]);
  wm.grad_norm = finite_mean(all[kGradNorm]);
  double samples = 0, slowest_s = 0;
  for (int r = 0; r < size; ++r) samples += all[kSamples][r], slowest_s = std::max(slowest_s, all[kWindowS][r]);
  wm.samples_per_s = slowest_s > 0 ? samples / slowest_s : 0.0;
  wm.step_ms = rank_stat(all[kStepMs]);
  wm.other_ms = rank_stat(all[kOtherMs]);
  wm.forward_ms = rank_stat(all[kForwardMs]);
  wm.backward_ms = rank_stat(all[kBackwardMs]);
  wm.optimizer_ms = rank_stat(all[kOptimizerMs]);
  wm.comm_ms = rank_stat(all[kCommMs]);
  wm.comm_wait_ms = rank_stat(all[kCommWaitMs]);
  wm.rss_mb = rank_stat(all[kRssMb]);
  wm.slowest_rank = rank_stat(all[kComputeMs]).max_rank;
  windows.push_back(wm);
  if (tensorboard) tensorboard->window(wm, params, param_names);
  if (metrics_file) {
    std::fprintf(metrics_file, "%s\n", metrics_json(wm).c_str());
    std::fflush(metrics_file);
  }
}

void Monitor::close() {
  auto& s = *impl_;
  if (s.closed) return;
  s.closed = true;
  if (s.progress) s.progress->finish();
  s.progress.reset();
  if (s.window_steps > 0) {
    if (s.counts[kGradNorm] == 0) {  // a partial window: sample the last step's gradients now
      const double g = s.grad_norm();
      if (std::isfinite(g)) s.sums[kGradNorm] += g, ++s.counts[kGradNorm];
    }
    s.aggregate();
  }
  if (s.rank_file) std::fflush(s.rank_file);

  if (s.timeline) {
    // The merge: each rank's part file, gathered to the group's first rank.
    s.timeline->finish();
    const std::string part_path = s.timeline->part_path();
    const std::string part = util::read_file(part_path, "timeline part");
    std::vector<std::string> parts{part};
    if (s.distributed) {
      const Group& g = s.o.process_group();
      parts = gather_bytes(part, g.ranks()[0], g);
    }
    if (s.rank == 0) write_text(s.path("trace.json"), monitor::merge_trace(parts));
    std::remove(part_path.c_str());
    s.timeline.reset();
  }

  if (s.rank == 0 && s.o.plot() && !s.o.output_dir().empty()) {
    write_text(s.path("plot.svg"), monitor::run_plot_svg(s.windows, s.epochs, s.step, s.size));
  }
  if (s.metrics_file) std::fclose(s.metrics_file), s.metrics_file = nullptr;
  if (s.rank_file) std::fclose(s.rank_file), s.rank_file = nullptr;
  if (s.tensorboard) s.tensorboard->close();
}

int64_t Monitor::step() const { return impl_->step; }
const StepMetrics& Monitor::last_step() const { return impl_->last; }
const std::vector<WindowMetrics>& Monitor::windows() const { return impl_->windows; }
const std::vector<EpochMetrics>& Monitor::epochs() const { return impl_->epochs; }

}  // namespace dtrain
