// StoreServer: the rendezvous key-value store, served from one background thread.
//
// Steps:
//   1. Resolve host with getaddrinfo and bind the FIRST address that binds (exactly one address,
//      never INADDR_ANY). SO_REUSEADDR lets a quick rerun reuse a TIME_WAIT port; a port that is
//      actively listened on still fails with EADDRINUSE -> one-line std::runtime_error.
//   2. The thread poll()s the listening socket, a self-pipe (the destructor writes a byte to stop
//      it promptly) and every client socket (non-blocking, TCP_NODELAY).
//   3. Complete request frames (protocol.h) are handled in order, one at a time per connection.
//      GET/WAIT on missing keys park the connection as a waiter with its own deadline; every
//      mutation (SET, ADD, COMPARE_SET) answers the waiters whose keys now all exist, and the poll
//      timeout is the nearest deadline, whose waiter is answered TIMEOUT. No busy polling.
//   4. Responses are queued per connection and flushed with MSG_NOSIGNAL as the socket allows; a
//      peer that disconnects (even mid-request) is simply dropped, never crashing the server.
#include "store/protocol.h"
#include "store/store.h"

#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <map>
#include <thread>
#include <unordered_map>

namespace dtrain::store {

using namespace detail;
using Clock = std::chrono::steady_clock;

namespace {

struct Connection {
  int fd = -1;
  std::vector<uint8_t> in;   // bytes received, not yet parsed
  std::vector<uint8_t> out;  // bytes to send
  bool waiting = false;      // a GET/WAIT is parked: don't parse further requests yet
};

struct Waiter {
  int fd;
  Op op;  // kGet (answer with the value) or kWait
  std::vector<std::string> keys;
  bool has_deadline;
  Clock::time_point deadline;
};

void set_nonblocking(int fd) { fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK); }

}  // namespace

struct StoreServer::Impl {
  std::string host;
  uint16_t port = 0;
  int listen_fd = -1;
  int wake_pipe[2] = {-1, -1};
  std::thread thread;

  // Owned by the server thread only.
  std::map<std::string, Bytes> data;
  std::unordered_map<int, Connection> conns;
  std::vector<Waiter> waiters;

  void bind_and_listen(uint16_t requested_port);
  void run();
  void accept_all();
  void on_readable(Connection& c);
  bool handle_frames(Connection& c);  // false: drop the connection
  void handle(Connection& c, Reader& r);
  void reply(Connection& c, const Writer& w);
  void flush(Connection& c);
  void answer_ready_waiters();
  void expire_waiters(Clock::time_point now);
  void drop(int fd);
  bool all_present(const std::vector<std::string>& keys) const {
    return std::all_of(keys.begin(), keys.end(), [&](const std::string& k) { return data.count(k); });
  }
};

void StoreServer::Impl::bind_and_listen(uint16_t requested_port) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV;
  addrinfo* res = nullptr;
  const std::string port_str = std::to_string(requested_port);
  int rc = getaddrinfo(host.c_str(), port_str.c_str(), &hints, &res);
  if (rc != 0) throw std::runtime_error("cannot resolve the rendezvous address '" + host + "': " + gai_strerror(rc));
  int last_errno = 0;
  for (addrinfo* ai = res; ai; ai = ai->ai_next) {
    int fd = socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol);
    if (fd < 0) {
      last_errno = errno;
      continue;
    }
    int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (ai->ai_family == AF_INET6) setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &one, sizeof(one));
    if (bind(fd, ai->ai_addr, ai->ai_addrlen) == 0 && listen(fd, 128) == 0) {
      listen_fd = fd;
      break;
    }
    last_errno = errno;
    close(fd);
  }
  freeaddrinfo(res);
  if (listen_fd < 0) {
    const std::string where = "port " + std::to_string(requested_port) + " on " + host;
    if (last_errno == EADDRINUSE)
      throw std::runtime_error(where +
                               " is already in use: choose another port (MASTER_PORT, or dtrain-run --master_port), or "
                               "use dtrain-run --standalone for a free one");
    if (last_errno == EADDRNOTAVAIL)
      throw std::runtime_error("cannot listen on " + where + ": " + host +
                               " is not an address of this machine (set --master_addr to one of its addresses)");
    throw std::runtime_error("cannot listen on " + where + ": " + std::strerror(last_errno));
  }
  sockaddr_storage ss{};
  socklen_t len = sizeof(ss);
  getsockname(listen_fd, reinterpret_cast<sockaddr*>(&ss), &len);
  port = ntohs(ss.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port
                                        : reinterpret_cast<sockaddr_in*>(&ss)->sin_port);
  set_nonblocking(listen_fd);
}

StoreServer::StoreServer(const std::string& host, uint16_t port) : impl_(std::make_unique<Impl>()) {
  impl_->host = host;
  impl_->bind_and_listen(port);
  if (pipe2(impl_->wake_pipe, O_CLOEXEC | O_NONBLOCK) != 0) {
    close(impl_->listen_fd);
    throw std::runtime_error(std::string("store server: pipe2 failed: ") + std::strerror(errno));
  }
  impl_->thread = std::thread([impl = impl_.get()] { impl->run(); });
}

StoreServer::~StoreServer() {
  char b = 1;
  (void)!write(impl_->wake_pipe[1], &b, 1);
  if (impl_->thread.joinable()) impl_->thread.join();
  for (auto& kv : impl_->conns) close(kv.first);
  close(impl_->listen_fd);
  close(impl_->wake_pipe[0]);
  close(impl_->wake_pipe[1]);
}

uint16_t StoreServer::port() const { return impl_->port; }
const std::string& StoreServer::host() const { return impl_->host; }

void StoreServer::Impl::run() {
  std::vector<pollfd> fds;
  for (;;) {
    fds.clear();
    fds.push_back({wake_pipe[0], POLLIN, 0});
    fds.push_back({listen_fd, POLLIN, 0});
    for (auto& kv : conns) {
      short ev = kv.second.waiting ? POLLRDHUP : POLLIN;  // parked: still notice a peer that leaves
      if (!kv.second.out.empty()) ev |= POLLOUT;
      fds.push_back({kv.first, ev, 0});
    }
    int timeout_ms = -1;
    bool any_deadline = false;
    Clock::time_point nearest;
    for (auto& w : waiters)
      if (w.has_deadline && (!any_deadline || w.deadline < nearest)) nearest = w.deadline, any_deadline = true;
    if (any_deadline) {
      auto ms = std::chrono::ceil<std::chrono::milliseconds>(nearest - Clock::now()).count();
      timeout_ms = static_cast<int>(std::clamp<int64_t>(ms, 0, 1 << 30));
    }
    int n = poll(fds.data(), fds.size(), timeout_ms);
    if (n < 0 && errno != EINTR) return;
    if (fds[0].revents) return;  // destructor asked us to stop
    if (fds[1].revents & POLLIN) accept_all();
    for (size_t i = 2; i < fds.size(); ++i) {
      auto it = conns.find(fds[i].fd);
      if (it == conns.end() || !fds[i].revents) continue;
      if (fds[i].revents & (POLLERR | POLLNVAL)) {
        drop(fds[i].fd);
        continue;
      }
      if (fds[i].revents & POLLOUT) flush(it->second);
      it = conns.find(fds[i].fd);
      if (it == conns.end()) continue;
      if (fds[i].revents & (POLLIN | POLLHUP | POLLRDHUP)) on_readable(it->second);  // reads EOF on hang-up
    }
    expire_waiters(Clock::now());
  }
}

void StoreServer::Impl::accept_all() {
  for (;;) {
    int fd = accept4(listen_fd, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd < 0) return;  // EAGAIN, or a transient error: try again on the next POLLIN
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    conns[fd].fd = fd;
  }
}

void StoreServer::Impl::on_readable(Connection& c) {
  uint8_t buf[65536];
  for (;;) {
    ssize_t n = recv(c.fd, buf, sizeof(buf), 0);
    if (n > 0) {
      c.in.insert(c.in.end(), buf, buf + n);
      continue;
    }
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
    if (n < 0 && errno == EINTR) continue;
    drop(c.fd);  // EOF or error: the peer is gone (maybe mid-request)
    return;
  }
  if (!handle_frames(c)) drop(c.fd);
}

bool StoreServer::Impl::handle_frames(Connection& c) {
  size_t pos = 0;
  while (!c.waiting && c.in.size() - pos >= 4) {
    uint32_t len = decode_u32(c.in.data() + pos);
    if (len > kMaxFrameBytes || len == 0) return false;
    if (c.in.size() - pos - 4 < len) break;
    Reader r(c.in.data() + pos + 4, len);
    pos += 4 + len;
    try {
      handle(c, r);
    } catch (const std::exception& e) {
      reply(c, Writer(uint8_t(Status::kError)).str(e.what()));
    }
  }
  c.in.erase(c.in.begin(), c.in.begin() + pos);
  return true;
}

void StoreServer::Impl::handle(Connection& c, Reader& r) {
  const Op op = static_cast<Op>(r.head());
  Writer ok(uint8_t(Status::kOk));
  switch (op) {
    case Op::kSet: {
      std::string key = r.str();
      data[key] = r.blob();
      reply(c, ok);
      answer_ready_waiters();
      return;
    }
    case Op::kGet:
    case Op::kWait: {
      Waiter w{c.fd, op, {}, false, {}};
      if (op == Op::kGet) {
        w.keys.push_back(r.str());
      }
      int64_t timeout_ms = r.i64();
      if (op == Op::kWait) {
        int64_t n = r.i64();
        for (int64_t i = 0; i < n; ++i) w.keys.push_back(r.str());
      }
      if (all_present(w.keys)) {
        if (op == Op::kGet) ok.blob(data[w.keys[0]]);
        reply(c, ok);
        return;
      }
      w.has_deadline = timeout_ms > 0;
      w.deadline = Clock::now() + std::chrono::milliseconds(timeout_ms);
      c.waiting = true;
      waiters.push_back(std::move(w));
      return;
    }
    case Op::kCompareSet: {
      std::string key = r.str();
      Bytes expected = r.blob(), desired = r.blob();
      auto it = data.find(key);
      if (it == data.end()) {
        if (expected.empty()) {
          data[key] = desired;
          reply(c, ok.blob(desired));
          answer_ready_waiters();
        } else {
          reply(c, ok.blob(expected));  // c10d semantics: absent key, non-empty expected
        }
      } else {
        if (it->second == expected) it->second = desired;
        reply(c, ok.blob(it->second));
      }
      return;
    }
    case Op::kAdd: {
      std::string key = r.str();
      int64_t delta = r.i64();
      int64_t value = 0;
      auto it = data.find(key);
      if (it != data.end()) {
        std::string s(it->second.begin(), it->second.end());
        size_t used = 0;
        try {
          value = std::stoll(s, &used);
        } catch (const std::exception&) {
          used = 0;
        }
        if (used == 0 || used != s.size())
          throw std::runtime_error("add(): key '" + key + "' holds '" + s + "', not an integer");
      }
      value += delta;
      data[key] = to_bytes(std::to_string(value));
      reply(c, ok.i64(value));
      answer_ready_waiters();
      return;
    }
    case Op::kCheck: {
      int64_t n = r.i64();
      bool all = true;
      for (int64_t i = 0; i < n; ++i) all = data.count(r.str()) && all;
      reply(c, ok.i64(all ? 1 : 0));
      return;
    }
    case Op::kDelete: {
      reply(c, ok.i64(data.erase(r.str()) ? 1 : 0));
      return;
    }
    case Op::kNumKeys:
      reply(c, ok.i64(static_cast<int64_t>(data.size())));
      return;
  }
  throw std::runtime_error("unknown store request " + std::to_string(int(op)));
}

void StoreServer::Impl::reply(Connection& c, const Writer& w) {
  auto f = w.frame();
  c.out.insert(c.out.end(), f.begin(), f.end());
  flush(c);
}

void StoreServer::Impl::flush(Connection& c) {
  size_t sent = 0;
  while (sent < c.out.size()) {
    ssize_t n = send(c.fd, c.out.data() + sent, c.out.size() - sent, MSG_NOSIGNAL);
    if (n > 0) {
      sent += static_cast<size_t>(n);
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    break;  // EAGAIN: wait for POLLOUT; EPIPE/ECONNRESET: POLLHUP/EOF drops it
  }
  c.out.erase(c.out.begin(), c.out.begin() + sent);
}

void StoreServer::Impl::answer_ready_waiters() {
  std::vector<int> resumed;
  for (auto it = waiters.begin(); it != waiters.end();) {
    if (!all_present(it->keys)) {
      ++it;
      continue;
    }
    auto c = conns.find(it->fd);
    if (c != conns.end()) {
      Writer ok(uint8_t(Status::kOk));
      if (it->op == Op::kGet) ok.blob(data[it->keys[0]]);
      c->second.waiting = false;
      reply(c->second, ok);
      resumed.push_back(it->fd);
    }
    it = waiters.erase(it);
  }
  for (int fd : resumed) {  // they may have pipelined more requests
    auto c = conns.find(fd);
    if (c != conns.end() && !handle_frames(c->second)) drop(fd);
  }
}

void StoreServer::Impl::expire_waiters(Clock::time_point now) {
  std::vector<int> resumed;
  for (auto it = waiters.begin(); it != waiters.end();) {
    if (!it->has_deadline || it->deadline > now) {
      ++it;
      continue;
    }
    auto c = conns.find(it->fd);
    if (c != conns.end()) {
      c->second.waiting = false;
      reply(c->second, Writer(uint8_t(Status::kTimeout)));
      resumed.push_back(it->fd);
    }
    it = waiters.erase(it);
  }
  for (int fd : resumed) {
    auto c = conns.find(fd);
    if (c != conns.end() && !handle_frames(c->second)) drop(fd);
  }
}

void StoreServer::Impl::drop(int fd) {
  waiters.erase(std::remove_if(waiters.begin(), waiters.end(), [fd](const Waiter& w) { return w.fd == fd; }),
                waiters.end());
  conns.erase(fd);
  close(fd);
}

}  // namespace dtrain::store
