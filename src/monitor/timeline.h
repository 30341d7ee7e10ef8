// The timeline: Chrome-trace ("Trace Event Format") records of one rank, fed from a queue.
//
//   1. The training thread calls add() with a fixed-size record (no formatting, no I/O): a mutex-guarded
//      push into the pending vector.
//   2. A writer thread wakes every 100 ms (or when 512 records are pending), swaps the vector out and
//      appends the records, formatted as JSON objects each followed by ",\n", to this rank's part file.
//   3. finish() stops the writer after it wrote everything.
//   4. merge_trace() (rank 0, after the parts were gathered) wraps every rank's part in one JSON document
//      with process/thread names: pid = rank, tid 0 = compute, tid 1 = communication.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace dtrain::monitor {

struct TraceRecord {
  const char* name;  // a string literal
  int tid;           // 0 compute, 1 communication
  int64_t begin_ns;  // steady clock
  int64_t end_ns;
  int64_t step;
  int index;  // bucket index, or -1
};

class Timeline {
 public:
  // Records are written relative to t0_ns, in microseconds.
  Timeline(std::string part_path, int rank, int64_t t0_ns);
  ~Timeline();
  void add(const TraceRecord& r);
  // Writes everything still queued and stops the writer. Idempotent.
  void finish();
  const std::string& part_path() const { return path_; }

 private:
  void run();
  void write(const std::vector<TraceRecord>& batch);

  std::string path_;
  int rank_;
  int64_t t0_ns_;
  std::FILE* file_ = nullptr;
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<TraceRecord> pending_;
  bool stop_ = false;
  std::thread writer_;
};

// One JSON document from the ranks' parts (parts[r] is rank r's part file content).
std::string merge_trace(const std::vector<std::string>& parts);

}  // namespace dtrain::monitor
