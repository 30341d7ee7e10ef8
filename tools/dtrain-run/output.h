// Worker output multiplexing: every worker's stdout and stderr arrive on pipes that the launcher
// reads in its poll loop; each becomes an OutputStream.
//
// Steps for each chunk read from a worker's pipe:
//   1. Append to the stream's buffer.
//   2. For every complete line, write "[rank N] " + line + "\n" to the console stream (the
//      launcher's stdout or stderr) in ONE write(), so lines of different workers never interleave
//      mid-line; write the bare line to the log file (<log_dir>/<run_id>/attempt_<restart>/<rank>/...).
//   3. A line longer than kMaxLineBytes is cut into pieces, each written as its own prefixed line.
//   4. At EOF a trailing partial line is flushed as a line.
// stderr lines are also kept in a ring of the last kTailLines for the failure summary.
#pragma once

#include <cstddef>
#include <deque>
#include <string>

namespace dtrain::run {

constexpr size_t kMaxLineBytes = 64 * 1024;
constexpr size_t kTailLines = 100;

class OutputStream {
 public:
  // console_fd: 1 or 2, or -1 when redirected to the log file only.
  // log_fd: an open file, or -1. keep_tail: remember the last lines (for stderr).
  OutputStream(int rank, int console_fd, int log_fd, bool keep_tail);
  ~OutputStream();
  OutputStream(const OutputStream&) = delete;
  OutputStream& operator=(const OutputStream&) = delete;

  void consume(const char* data, size_t n);  // steps 1-3
  void finish();                             // step 4, closes the log file
  const std::deque<std::string>& tail() const { return tail_; }

 private:
  void emit(const char* line, size_t n);
  std::string prefix_;
  int console_fd_;
  int log_fd_;
  bool keep_tail_;
  std::string buffer_;
  std::string out_;  // reused scratch for prefix + line
  std::deque<std::string> tail_;
};

// Writes all of [data, data+n) to fd, retrying on EINTR and short writes; errors are ignored
// (a closed console must not stop the job).
void write_fully(int fd, const char* data, size_t n);

}  // namespace dtrain::run
