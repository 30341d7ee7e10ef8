// StoreServer's state, shared by server.cpp (the event loop, sockets, limits in time),
// server_guard.cpp (the handshake, the budgets against peers without the secret) and
// server_requests.cpp (the operations, limits in size). Internal header.
#pragma once

#include <poll.h>

#include <array>
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
constexpr int kFramesPerRound = 64;                // requests one connection has handled per poll round
constexpr size_t kKeptBuffer = 64 << 10;           // a drained buffer larger than this gives its memory back
constexpr size_t kMemoryBudget = size_t{3} << 30;  // ServerLimits::memory_budget's default
constexpr Millis kEvictAfter{50};                  // a connection in the handshake is evicted only from this age on
constexpr size_t kHandshakeSurplus = 1024;         // young connections past their address's budget, in all, at most
constexpr Millis kNoticeEvery{10000};              // one line per kind of refusal at most this often

// What node 0 says while it refuses connections (one line per kind, rate-limited: notice()).
enum class Refusal { kHandshake, kEvicted, kFull, kMemory, kUnread, kCount };

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
  bool doomed = false;           // over the memory budget: closed at once, `out` unsent
  bool backlog = false;          // used its frames of this round: read again in the next one
  uint64_t seq = 0;              // accept order: the oldest unauthenticated one is evicted first
  std::string peer;              // "address:port", for the lines that name it
  std::string peer_address;      // the address alone: the unit of the per-peer budget
  size_t charged = 0;            // what `in` and `out` hold, as counted in Impl::buffered
  Clock::time_point out_since;   // when `out` last became non-empty or was last sent from
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

// "address:port" of a peer (with_port), or its address alone: the unit of the per-peer budget.
std::string peer_name(const sockaddr_storage& from, bool with_port);

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
  std::atomic<size_t> held{0};       // stored_bytes + buffered at the end of the last poll round

  // Owned by the server thread only.
  std::map<std::string, Bytes, std::less<>> data;
  size_t stored_bytes = 0;  // keys and values
  std::unordered_map<int, detail::Connection> conns;
  std::map<uint64_t, int> unauthed;  // connections still in the handshake, by accept order
  std::unordered_map<std::string, std::map<uint64_t, int>> unauthed_from;  // the same, by address
  size_t surplus = 0;      // of them, those past their address's budget (young ones, in their grace)
  size_t surplus_cap = 0;  // what `surplus` may reach before an address's young ones are evicted
  size_t authed_count = 0;
  uint64_t accepted = 0;
  size_t buffered = 0;       // bytes every connection's `in` and `out` hold (their capacity)
  std::vector<int> doomed;   // connections over the memory budget, dropped once nothing uses them
  std::vector<int> backlog;  // connections with requests left over from this round
  std::array<Clock::time_point, size_t(detail::Refusal::kCount)> noticed{};
  std::array<uint64_t, size_t(detail::Refusal::kCount)> unsaid{};  // refusals since the last line
  std::vector<detail::Waiter> waiters;
  bool changed = false;    // a key was set since the waiters were last looked at
  std::vector<int> ready;  // connections with requests to read again (resumed, drained)
  Clock::time_point listen_paused_until{};
  Clock::time_point accept_after{};  // the handshake budget is full of young connections until then
  std::vector<pollfd> pollfds;       // poll_once's, kept: no allocation per wake-up
  int reports = 0;

  // server.cpp
  void bind_and_listen(uint16_t requested_port);
  void run() noexcept;
  bool poll_once();  // false: stop
  int poll_timeout(Clock::time_point now) const;
  void accept_all();
  bool on_readable(detail::Connection& c);  // false: drop it
  bool read_frames(detail::Connection& c);  // false: drop it
  void reap();                              // drops the doomed connections
  void settle();
  void reply(detail::Connection& c, const detail::Writer& w);
  void flush(detail::Connection& c);
  void expire(Clock::time_point now);
  void drop(int fd);
  void report(const std::string& what);

  // server_guard.cpp: what a peer without the secret can make the server do. See Note [Store budgets].
  bool room_for_one();                        // false: accept no more now (accept_after)
  void room_for(const std::string& address);  // within the per-peer budget, once accepted
  void trim_surplus(Clock::time_point now);   // each address's connections past their grace, within its budget
  Clock::time_point surplus_until() const;    // when trim_surplus has one to close next
  void enter_handshake(detail::Connection& c);
  void leave_handshake(detail::Connection& c);
  bool settles(detail::Connection& c);  // reads its handshake; false: it left (dropped)
  void evict(detail::Connection& c, const char* scope);
  bool read_auth(detail::Connection& c);                                    // false: drop it
  bool handshake(detail::Connection& c, const uint8_t* frame, size_t len);  // false: drop it, silently
  void recharge(detail::Connection& c);
  bool over_budget() const { return stored_bytes + buffered > limits.memory_budget; }
  void doom(detail::Connection& c);
  void shed();  // past the memory budget: drops the connections that hold the most
  void notice(detail::Refusal kind, const std::string& line);
  std::string where() const { return detail::host_port(host, port); }

  // server_requests.cpp
  void handle(detail::Connection& c, detail::Reader& r);
  void put(const std::string& key, Bytes value);
  void answer_ready_waiters();
  bool all_present(const detail::KeyList& keys) const;
};

}  // namespace dtrain::store
