#include "compat/torchrun_store_compat.h"

#include <torch/csrc/api/include/torch/version.h>

#if TORCH_VERSION_MAJOR < 2
#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstring>

#include "dtrain/errors.h"
#endif

namespace dtrain::compat {

#if TORCH_VERSION_MAJOR >= 2

void check_torchrun_store(const std::string&, uint16_t, int) {}

#else

namespace {

// One TCP connection, closed on every path.
struct Socket {
  int fd = -1;
  ~Socket() {
    if (fd >= 0) close(fd);
  }
};

// Reads `n` bytes before `deadline`; false on timeout, EOF or error.
bool read_exactly(int fd, char* out, size_t n, std::chrono::steady_clock::time_point deadline) {
  using namespace std::chrono;
  while (n > 0) {
    auto left = duration_cast<milliseconds>(deadline - steady_clock::now()).count();
    pollfd p{fd, POLLIN, 0};
    if (left <= 0 || poll(&p, 1, static_cast<int>(left)) <= 0) return false;
    ssize_t got = ::recv(fd, out, n, 0);  // the socket call, not dtrain::recv
    if (got <= 0) return false;
    out += got;
    n -= static_cast<size_t>(got);
  }
  return true;
}

}  // namespace

void check_torchrun_store(const std::string& host, uint16_t port, int rank) {
  // 1. Connect; if that fails, the real client's connect (with its retries and timeout) reports it.
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  if (getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &res) != 0) return;
  Socket s;
  for (addrinfo* a = res; a && s.fd < 0; a = a->ai_next) {
    s.fd = socket(a->ai_family, a->ai_socktype, a->ai_protocol);
    if (s.fd >= 0 && connect(s.fd, a->ai_addr, a->ai_addrlen) != 0) {
      close(s.fd);
      s.fd = -1;
    }
  }
  freeaddrinfo(res);
  if (s.fd < 0) return;
  // 2. Ask for the number of keys: query type 6 in 1.13's protocol, read-only, and answered at once
  //    with an int64. A 2.x server waits for its handshake instead (libuv backend) or hangs up.
  const char get_num_keys = 6;
  if (::send(s.fd, &get_num_keys, 1, MSG_NOSIGNAL) != 1) return;
  char answer[8];
  if (read_exactly(s.fd, answer, sizeof(answer), std::chrono::steady_clock::now() + std::chrono::seconds(3))) return;
  // 3. No answer: a torchrun from PyTorch >= 2.1.
  throw Error(
      detail::cat("rank ", rank, ": the store torchrun hosts at ", host, ":", port,
                  " does not answer LibTorch 1.13's TCPStore protocol (torchrun from PyTorch >= 2.1 added a handshake "
                  "that 1.13 cannot speak): build dtrain against LibTorch 2.x (README: 'Using dtrain with your "
                  "LibTorch'), or start the job with dtrain-run"));
}

#endif

}  // namespace dtrain::compat
