// Worker output multiplexing (see output.h for the steps).
#include "output.h"

#include <sys/ioctl.h>
#include <unistd.h>

#include <cerrno>

namespace dtrain::run {

void write_fully(int fd, const char* data, size_t n) {
  while (n > 0) {
    ssize_t w = write(fd, data, n);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return;
    data += w;
    n -= static_cast<size_t>(w);
  }
}

Console::Console(int bar_fd) : bar_fd_(bar_fd) {
  for (int fd = 0; fd < 3; ++fd) tty_[fd] = bar_fd >= 0 && isatty(fd);
}

std::string Console::bar_line() const { return "\r\033[2K" + bar_; }

void Console::write(int fd, const std::string& text) {
  if (bar_.empty() || fd < 0 || fd > 2 || !tty_[fd]) {
    write_fully(fd, text.data(), text.size());
    return;
  }
  // The bar's line is cleared, the text takes it, and the bar is redrawn on the line below: on the
  // bar's own fd in one write(), so the terminal never shows half of it.
  if (fd == bar_fd_) {
    const std::string s = "\r\033[2K" + text + bar_line();
    write_fully(fd, s.data(), s.size());
    return;
  }
  const std::string clear = "\r\033[2K", bar = bar_line();
  write_fully(bar_fd_, clear.data(), clear.size());
  write_fully(fd, text.data(), text.size());
  write_fully(bar_fd_, bar.data(), bar.size());
}

void Console::show_bar(const std::string& text) {
  if (bar_fd_ < 0) return;
  // A line wider than the terminal wraps, and erase-line would then clear only its last row.
  winsize ws{};
  size_t cols = ioctl(bar_fd_, TIOCGWINSZ, &ws) == 0 && ws.ws_col > 1 ? ws.ws_col - 1 : 79;
  bar_ = text.empty() ? " " : text.substr(0, cols);
  const std::string s = bar_line();
  write_fully(bar_fd_, s.data(), s.size());
}

void Console::end_bar() {
  if (bar_.empty()) return;
  bar_.clear();
  write_fully(bar_fd_, "\n", 1);
}

OutputStream::OutputStream(int rank, int console_fd, int log_fd, bool keep_tail, Console* console, bool progress)
    : prefix_("[rank " + std::to_string(rank) + "] "),
      console_fd_(console_fd),
      console_(console),
      progress_(progress && console != nullptr),
      log_fd_(log_fd),
      keep_tail_(keep_tail) {}

OutputStream::~OutputStream() {
  if (log_fd_ >= 0) close(log_fd_);
}

void OutputStream::consume(const char* data, size_t n) {
  buffer_.append(data, n);
  size_t start = 0;
  for (;;) {
    size_t nl = buffer_.find('\n', start);
    if (nl == std::string::npos) break;
    // A complete line longer than the limit is cut into pieces too.
    while (nl - start > kMaxLineBytes) {
      emit(buffer_.data() + start, kMaxLineBytes);
      start += kMaxLineBytes;
    }
    emit(buffer_.data() + start, nl - start);
    start = nl + 1;
  }
  while (buffer_.size() - start > kMaxLineBytes) {  // a long partial line: emit a piece now
    emit(buffer_.data() + start, kMaxLineBytes);
    start += kMaxLineBytes;
  }
  buffer_.erase(0, start);
}

void OutputStream::finish() {
  if (!buffer_.empty()) emit(buffer_.data(), buffer_.size());
  buffer_.clear();
  if (log_fd_ >= 0) close(log_fd_);
  log_fd_ = -1;
}

void OutputStream::write_log(const char* line, size_t n) {
  if (log_fd_ < 0) return;
  out_.assign(line, n);
  out_.push_back('\n');
  write_fully(log_fd_, out_.data(), out_.size());
}

void OutputStream::emit(const char* line, size_t n) {
  if (progress_ && n > 0 && line[0] == '\r') {  // the bar (Note [Launcher bar]): terminal only
    if (n == 1)
      console_->end_bar();
    else
      console_->show_bar(prefix_ + std::string(line + 1, n - 1));
    return;
  }
  if (progress_ && n > 0 && line[0] == '\v') {  // the plain line the bar stands for: log only
    write_log(line + 1, n - 1);
    return;
  }
  if (console_fd_ >= 0) {
    out_.assign(prefix_);
    out_.append(line, n);
    out_.push_back('\n');
    if (console_)
      console_->write(console_fd_, out_);
    else
      write_fully(console_fd_, out_.data(), out_.size());
  }
  write_log(line, n);
  if (keep_tail_) {
    tail_.emplace_back(line, n);
    if (tail_.size() > kTailLines) tail_.pop_front();
  }
}

}  // namespace dtrain::run
