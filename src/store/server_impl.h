// StoreServer's state, shared by server.cpp (the event loop, sockets, the handshake, limits in
// time) and server_requests.cpp (the operations, limits in size). Internal header.
#pragma once

#include <poll.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <map>
#include <string>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <vector>

#include "store/protocol.h"
#include "store/store.h"

namespace dtrain::store {

namespace detail {

using Clock = std::chrono::steady_clock;

constexpr size_t kOutputHighWater = 8 << 20;  // replies not yet sent: no request is read beyond
constexpr size_t kInputBuffered = 1 << 20;    // requests read ahead of the one being handled
constexpr size_t kMaxConnections = 16384;

// The keys of one CHECK or WAIT, packed: a list of many short keys costs about its bytes on the
// wire, not a std::string (32 bytes and more) each.
class KeyList {
 public:
  void add(std::string_view k) {
    chars_.append(k);
    ends_.push_back(static_cast<uint32_t>(chars_.size()));
  }
  size_t size() const { return ends_.size(); }
  std::string_view operator[](size_t i) const {
    const size_t begin = i == 0 ? 0 : ends_[i - 1];
    return std::string_view(chars_).substr(begin, ends_[i] - begin);
  }

 private:
  std::string chars_;
  std::vector<uint32_t> ends_;
};

struct Connection {
  int fd = -1;
  bool authed = false;           // the handshake is done: requests are served
  bool waiting = false;          // a GET/WAIT is parked: no further request is read yet
  bool closing = false;          // refused: closed once `out` is sent
  std::vector<uint8_t> nonce;    // the server's challenge in the handshake
  Clock::time_point opened;      // for the handshake's timeout
  Clock::time_point frame_from;  // when the frame now arriving began
  std::vector<uint8_t> in;       // bytes received, not yet parsed
  std::vector<uint8_t> out;      // bytes to send
};

struct Waiter {
  int fd;
  Op op;  // kGet (answer with the value) or kWait
  KeyList keys;
  bool has_deadline;
  Clock::time_point deadline;
};

// The first frame `in` holds complete, or 0; a length over `cap` is -1 (a corrupt or hostile peer).
inline int64_t complete_frame(const std::vector<uint8_t>& in, uint32_t cap) {
  if (in.size() < 4) return 0;
  const uint32_t len = decode_u32(in.data());
  if (len == 0 || len > cap) return -1;
  return in.size() - 4 >= len ? 4 + int64_t{len} : 0;
}

}  // namespace detail

struct StoreServer::Impl {
  using Clock = detail::Clock;
  std::string host;
  uint16_t port = 0;
  std::string secret;  // empty: an open store
  int listen_fd = -1;
  int wake_pipe[2] = {-1, -1};
  int spare_fd = -1;    // closed to accept (and refuse) one connection when out of descriptors
  ServerLimits limits;  // max_connections resolved
  std::thread thread;
  std::atomic<uint64_t> rejected{0};
  std::atomic<size_t> open_connections{0};
  std::atomic<size_t> throttled{0};  // backed-up connections at the last poll round

  // Owned by the server thread only.
  std::map<std::string, Bytes, std::less<>> data;
  size_t stored_bytes = 0;  // keys and values
  std::unordered_map<int, detail::Connection> conns;
  std::vector<detail::Waiter> waiters;
  bool changed = false;    // a key was set since the waiters were last looked at
  std::vector<int> ready;  // connections with requests to read again (resumed, drained)
  Clock::time_point listen_paused_until{};
  std::vector<pollfd> pollfds;  // poll_once's, kept: no allocation per wake-up
  int reports = 0;

  // server.cpp
  void bind_and_listen(uint16_t requested_port);
  void run() noexcept;
  bool poll_once();  // false: stop
  int poll_timeout(Clock::time_point now) const;
  void accept_all();
  void refuse(int fd, const std::string& why);
  bool on_readable(detail::Connection& c);  // false: drop it
  bool read_frames(detail::Connection& c);  // false: drop it
  void handshake(detail::Connection& c, detail::Reader& r);
  void reply(detail::Connection& c, const detail::Writer& w);
  void flush(detail::Connection& c);
  void settle();
  void expire(Clock::time_point now);
  void drop(int fd);
  void report(const std::string& what);
  std::string where() const { return detail::host_port(host, port); }

  // server_requests.cpp
  void handle(detail::Connection& c, detail::Reader& r);
  void put(const std::string& key, Bytes value);
  void answer_ready_waiters();
  bool all_present(const detail::KeyList& keys) const;
};

}  // namespace dtrain::store
