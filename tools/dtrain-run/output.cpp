// Worker output multiplexing (see output.h for the steps).
#include "output.h"

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

OutputStream::OutputStream(int rank, int console_fd, int log_fd, bool keep_tail)
    : prefix_("[rank " + std::to_string(rank) + "] "),
      console_fd_(console_fd),
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

void OutputStream::emit(const char* line, size_t n) {
  if (console_fd_ >= 0) {
    out_.assign(prefix_);
    out_.append(line, n);
    out_.push_back('\n');
    write_fully(console_fd_, out_.data(), out_.size());
  }
  if (log_fd_ >= 0) {
    out_.assign(line, n);
    out_.push_back('\n');
    write_fully(log_fd_, out_.data(), out_.size());
  }
  if (keep_tail_) {
    tail_.emplace_back(line, n);
    if (tail_.size() > kTailLines) tail_.pop_front();
  }
}

}  // namespace dtrain::run
