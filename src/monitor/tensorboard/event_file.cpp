#include "monitor/tensorboard/event_file.h"

#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cinttypes>
#include <cstring>
#include <filesystem>

#include "common/util.h"
#include "dtrain/errors.h"
#include "monitor/tensorboard/events.h"
#include "monitor/tensorboard/record.h"

namespace dtrain::tensorboard {

double wall_time_now() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

std::string event_file_name(double wall_time, const std::string& suffix) {
  static std::atomic<int> files_opened{0};
  char head[64];
  std::snprintf(head, sizeof(head), "events.out.tfevents.%010" PRId64 ".", static_cast<int64_t>(wall_time));
  return detail::cat(head, util::host_name(), ".", static_cast<long>(::getpid()), ".", files_opened++, suffix);
}

EventFile::EventFile(std::string dir, EventFileOptions options) : dir_(std::move(dir)), o_(std::move(options)) {
  const double now = wall_time_now();
  path_ = (std::filesystem::path(dir_) / event_file_name(now, o_.filename_suffix)).string();
  std::error_code ec;
  std::filesystem::create_directories(dir_, ec);
  if (ec) {
    warn_once("tensorboard:" + (o_.warn_key.empty() ? path_ : o_.warn_key),
              detail::cat("SummaryWriter: cannot create the folder ", dir_, ": ", ec.message(),
                          "; its TensorBoard events are dropped"));
    return;
  }
  file_ = util::create_file(path_);  // never through a link planted at the name
  if (!file_) {
    fail("create", errno);
    return;
  }
  add(file_version_event(now));
  flush();  // TensorBoard sees the run at once
}

EventFile::~EventFile() { close(); }

void EventFile::add(const std::string& event) {
  if (!file_) return;
  const std::string record = tfrecord(event);
  if (std::fwrite(record.data(), 1, record.size(), file_) != record.size()) return fail("write", errno);
  ++pending_;
  if (pending_ >= o_.max_queue || (util::now_ns() - last_flush_ns_) / 1e9 >= o_.flush_secs) flush();
}

void EventFile::flush() {
  if (!file_) return;
  if (std::fflush(file_) != 0) return fail("write", errno);
  pending_ = 0;
  last_flush_ns_ = util::now_ns();
}

void EventFile::close() {
  if (!file_) return;
  flush();
  if (file_ && std::fclose(file_) != 0) {
    file_ = nullptr;
    return fail("close", errno);
  }
  file_ = nullptr;
}

void EventFile::fail(const std::string& what, int err) {
  // Whatever the stdio buffer still held is lost; the records already on disk stay readable
  // (a reader stops at a record cut short).
  warn_once("tensorboard:" + (o_.warn_key.empty() ? path_ : o_.warn_key),
            detail::cat("SummaryWriter: cannot ", what, " ", path_, ": ", std::strerror(err),
                        "; this file's later TensorBoard events are dropped"));
  if (file_) std::fclose(file_);
  file_ = nullptr;
}

}  // namespace dtrain::tensorboard
