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
//
// Note [Launcher bar]: a worker's stdout is a pipe, so a progress bar drawn with '\r' would be cut
// into lines (or held back until a newline). When the launcher's stdout is a terminal that shows
// rank 0's stdout, rank 0 gets DTRAIN_PROGRESS_TTY=1 and dtrain::Progress writes whole lines with a
// marker in front, which only that stream (progress = true) interprets:
//   "\r<text>\n"   the bar's new state: drawn in place on the terminal, never written to the log
//   "\r\n"         the bar is done: its last state stays on the terminal as an ordinary line
//   "\v<text>\n"   a plain progress line for the log file only (the terminal has the bar instead)
// The terminal has one writer, the launcher's single poll loop, through one Console: every other
// line (any rank, stdout or stderr) clears the bar, is written whole, and the bar is redrawn below
// it, so the bar stays the last line and no line is ever torn. Pipes and files never see a '\r'.
#pragma once

#include <cstddef>
#include <deque>
#include <string>

namespace dtrain::run {

constexpr size_t kMaxLineBytes = 64 * 1024;
constexpr size_t kTailLines = 100;

// The launcher's terminal, shared by every OutputStream: the bar (at most one, rank 0's) and the
// lines written above it.
class Console {
 public:
  // bar_fd: the terminal the bar is drawn on (stdout), or -1 when there is no bar.
  explicit Console(int bar_fd = -1);
  // Writes `text` (whole lines) to fd, keeping the bar below it.
  void write(int fd, const std::string& text);
  // The bar's new state (one line, without '\r' or '\n'), cut to the terminal's width.
  void show_bar(const std::string& text);
  // The bar's last state stays as an ordinary line; the next show_bar starts a new bar.
  void end_bar();

 private:
  std::string bar_line() const;  // "\r" + erase line + the bar
  int bar_fd_;
  bool tty_[3] = {false, false, false};  // whether fd 0..2 is a terminal (the bar needs clearing there)
  std::string bar_;                      // empty: no bar shown
};

class OutputStream {
 public:
  // console_fd: 1 or 2, or -1 when redirected to the log file only.
  // log_fd: an open file, or -1. keep_tail: remember the last lines (for stderr).
  // console: the terminal's writer (null: write console_fd directly). progress: this stream carries
  // the bar's markers (Note [Launcher bar]).
  OutputStream(int rank, int console_fd, int log_fd, bool keep_tail, Console* console = nullptr, bool progress = false);
  ~OutputStream();
  OutputStream(const OutputStream&) = delete;
  OutputStream& operator=(const OutputStream&) = delete;

  void consume(const char* data, size_t n);  // steps 1-3
  void finish();                             // step 4, closes the log file
  const std::deque<std::string>& tail() const { return tail_; }

 private:
  void emit(const char* line, size_t n);
  void write_log(const char* line, size_t n);
  std::string prefix_;
  int console_fd_;
  Console* console_;
  bool progress_;
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
