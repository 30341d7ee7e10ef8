#include "monitor/timeline.h"

#include <cerrno>
#include <chrono>
#include <cstring>

#include "common/util.h"
#include "dtrain/errors.h"

namespace dtrain::monitor {

Timeline::Timeline(std::string part_path, int rank, int64_t t0_ns)
    : path_(std::move(part_path)), rank_(rank), t0_ns_(t0_ns) {
  file_ = util::create_file(path_);  // never through a link planted at the name
  DTRAIN_CHECK(file_, "Monitor: cannot create the trace file ", path_, ": ", std::strerror(errno),
               ": check output_dir");
  pending_.reserve(512);
  writer_ = std::thread([this] { run(); });
}

Timeline::~Timeline() { finish(); }

void Timeline::add(const TraceRecord& r) {
  std::lock_guard<std::mutex> g(mu_);
  pending_.push_back(r);
  if (pending_.size() >= 512) cv_.notify_one();
}

void Timeline::run() {
  std::vector<TraceRecord> batch;
  batch.reserve(512);
  std::unique_lock<std::mutex> lk(mu_);
  for (;;) {
    cv_.wait_for(lk, std::chrono::milliseconds(100), [this] { return stop_ || pending_.size() >= 512; });
    batch.swap(pending_);
    const bool stopping = stop_;
    lk.unlock();
    write(batch);
    batch.clear();
    lk.lock();
    if (stopping && pending_.empty()) return;
  }
}

void Timeline::write(const std::vector<TraceRecord>& batch) {
  for (const auto& r : batch) {
    const double ts = (r.begin_ns - t0_ns_) / 1e3, dur = (r.end_ns - r.begin_ns) / 1e3;
    if (r.index >= 0)
      std::fprintf(file_,
                   "{\"name\":\"%s %d\",\"ph\":\"X\",\"pid\":%d,\"tid\":%d,\"ts\":%.3f,\"dur\":%.3f,"
                   "\"args\":{\"step\":%lld,\"bucket\":%d}},\n",
                   r.name, r.index, rank_, r.tid, ts, dur, static_cast<long long>(r.step), r.index);
    else
      std::fprintf(file_,
                   "{\"name\":\"%s\",\"ph\":\"X\",\"pid\":%d,\"tid\":%d,\"ts\":%.3f,\"dur\":%.3f,"
                   "\"args\":{\"step\":%lld}},\n",
                   r.name, rank_, r.tid, ts, dur, static_cast<long long>(r.step));
  }
  std::fflush(file_);
}

void Timeline::finish() {
  {
    std::lock_guard<std::mutex> g(mu_);
    if (!writer_.joinable()) return;
    stop_ = true;
  }
  cv_.notify_one();
  writer_.join();
  std::fclose(file_);
  file_ = nullptr;
}

std::string merge_trace(const std::vector<std::string>& parts) {
  std::string out = "{\"displayTimeUnit\":\"ms\",\"traceEvents\":[\n";
  for (size_t r = 0; r < parts.size(); ++r) {
    out += detail::cat("{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":", r, ",\"args\":{\"name\":\"rank ", r,
                       "\"}},\n{\"name\":\"process_sort_index\",\"ph\":\"M\",\"pid\":", r,
                       ",\"args\":{\"sort_index\":", r, "}},\n");
    out +=
        detail::cat("{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":", r,
                    ",\"tid\":0,\"args\":{\"name\":\"compute\"}},\n{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":", r,
                    ",\"tid\":1,\"args\":{\"name\":\"communication\"}}");
    out += parts[r].empty() && r + 1 == parts.size() ? "\n" : ",\n";
    out += parts[r];
  }
  // Every part ends with ",\n": drop the last separator.
  while (!out.empty() && (out.back() == '\n' || out.back() == ',')) out.pop_back();
  out += "\n]}\n";
  return out;
}

}  // namespace dtrain::monitor
