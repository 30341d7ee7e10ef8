// A raw TCP connection to a StoreServer and the helpers the store's tests share: what a process
// that does not speak the protocol, or speaks it without the secret, can do.
#pragma once

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include "store/protocol.h"
#include "sanitizer.h"
#include "store/store.h"

namespace store_test {

using namespace std::chrono_literals;
using dtrain::store::Millis;
using dtrain::store::detail::Op;
using dtrain::store::detail::Writer;

inline std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

// A raw TCP connection to the store: what a process that does not speak the protocol, or speaks it
// without the secret, can do.
struct Raw {
  int fd = -1;
  // `from`: the loopback address it connects from (any of 127.0.0.0/8), as a peer on another host.
  explicit Raw(uint16_t port, const char* from = nullptr) {
    fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (from) {
      sockaddr_in src{};
      src.sin_family = AF_INET;
      inet_pton(AF_INET, from, &src.sin_addr);
      if (bind(fd, reinterpret_cast<sockaddr*>(&src), sizeof src) != 0) ADD_FAILURE() << "cannot bind " << from;
    }
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(port);
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) ADD_FAILURE() << "connect failed";
  }
  ~Raw() {
    if (fd >= 0) close(fd);
  }
  void send_bytes(const std::vector<uint8_t>& b) const { (void)!send(fd, b.data(), b.size(), MSG_NOSIGNAL); }
  // The next whole frame's payload (empty when the server closed or sent nothing within 5 s).
  std::vector<uint8_t> read_frame() const {
    std::vector<uint8_t> got;
    auto read_n = [&](size_t n) {
      const auto end = std::chrono::steady_clock::now() + 5s;
      std::vector<uint8_t> out(n);
      size_t have = 0;
      while (have < n && std::chrono::steady_clock::now() < end) {
        pollfd p{fd, POLLIN, 0};
        if (poll(&p, 1, 20) <= 0) continue;
        const ssize_t r = recv(fd, out.data() + have, n - have, 0);
        if (r <= 0) break;
        have += static_cast<size_t>(r);
      }
      out.resize(have);
      return out;
    };
    const auto len = read_n(4);
    if (len.size() < 4) return got;
    got = read_n(dtrain::store::detail::decode_u32(len.data()));
    return got;
  }
  // The server nonce of the HELLO every connection opens with.
  std::vector<uint8_t> hello_nonce() const {
    const auto hello = read_frame();
    dtrain::store::detail::Reader r(hello.data(), hello.size());
    r.head();
    r.str();   // magic
    r.view();  // whether a secret is required
    return r.blob();
  }
  // Whether the server closed the connection within `within` (reading and dropping what it sent).
  bool closed_within(Millis within) const {
    const auto end = std::chrono::steady_clock::now() + within;
    uint8_t buf[4096];
    while (std::chrono::steady_clock::now() < end) {
      pollfd p{fd, POLLIN, 0};
      if (poll(&p, 1, 20) <= 0) continue;
      const ssize_t n = recv(fd, buf, sizeof buf, 0);
      if (n == 0 || (n < 0 && errno != EAGAIN && errno != EINTR)) return true;
    }
    return false;
  }
};

inline std::vector<uint8_t> auth_frame(const std::vector<uint8_t>& nonce, const std::vector<uint8_t>& mac) {
  return Writer(uint8_t(Op::kAuth)).blob(nonce).blob(mac).frame();
}

// AddressSanitizer keeps freed blocks in quarantine (256 MiB by default): memory bounds there are
// looser, yet still far below what an unbounded server holds (800 MiB in the test of replies).
#if defined(DTRAIN_TEST_ASAN)
constexpr double kQuarantineMiB = 300;
#else
constexpr double kQuarantineMiB = 0;
#endif

// Resident memory of this process, in MiB.
inline double rss_mib() {
  std::ifstream f("/proc/self/status");
  std::string k;
  while (f >> k)
    if (k == "VmRSS:") {
      double kb;
      f >> kb;
      return kb / 1024;
    }
  return 0;
}

}  // namespace store_test
