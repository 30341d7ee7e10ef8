// StoreServer: the rendezvous key-value store, served from one background thread.
//
// Steps:
//   1. Resolve host with getaddrinfo and bind the FIRST address that binds (exactly one address,
//      never INADDR_ANY); an address whose port another process holds ends the search. SO_REUSEADDR lets a quick rerun
//      reuse a TIME_WAIT port; a port that is actively listened on still fails with EADDRINUSE -> one-line
//      std::runtime_error.
//   2. The thread poll()s the listening socket, a self-pipe (the destructor writes a byte to stop
//      it promptly) and every client socket (non-blocking, TCP_NODELAY, keepalive).
//   3. Each connection opens with the handshake (Note [Store handshake]), read as one frame alone
//      and within budgets of its own (Note [Store budgets], server_guard.cpp); then complete request
//      frames (protocol.h) are handled in order, one at a time per connection, at most
//      kFramesPerRound per connection in one poll round. GET/WAIT on missing
//      keys park the connection as a waiter with its own deadline; a mutation marks the store
//      changed, and settle() then answers the waiters whose keys all exist and reads the requests
//      they had pipelined, in a loop (no recursion, however many connections wait on each other).
//   4. Responses are queued per connection and flushed with MSG_NOSIGNAL as the socket allows; a
//      connection whose queue passes kOutputHighWater is read no further until it drains, and
//      every buffer counts toward the store's memory budget.
//   5. Time limits (ServerLimits): a handshake within handshake_timeout, a frame within
//      frame_timeout of its first byte, a reply read within unread_reply_timeout; the poll timeout
//      is the nearest of these and of the waiters' deadlines.
//   6. Nothing escapes the thread: an exception while serving one connection drops that connection
//      and is reported on stderr (the first few); the store goes on serving the others.
//
// Note [Store handshake]: on accept the server sends HELLO with a fresh 32-byte nonce and whether
// it requires the job secret. The client answers AUTH with its own nonce and
// HMAC-SHA256(secret, "dtrain-store client" | server nonce | client nonce); the server checks it in
// constant time and answers HMAC-SHA256(secret, "dtrain-store server" | both nonces), which the
// client checks in turn: each side proves it knows the secret, for this connection only, and the
// secret never crosses the wire. A connection that sends anything else first, a wrong digest, or
// nothing within the handshake timeout is refused and counted (rejected_connections()), with one
// line per kind of refusal every 10 s at most on the server's side: the job goes on. An open store (no secret) still
// sends HELLO and reads AUTH, so that a client with a secret knows it reached a store that cannot prove one.
#include <fcntl.h>
#include <netdb.h>
#include <poll.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <new>
#include <utility>

#include "store/auth.h"
#include "store/server_impl.h"

namespace dtrain::store {

using namespace detail;

namespace {

// Connections the kernel completes ahead of accept(): a burst of ranks, or a flood the store thread
// has not caught up with (descheduled on a busy node), waits here instead of having its SYN dropped
// (retried by the kernel after 1 s). Linux caps it at net.core.somaxconn.
constexpr int kListenBacklog = 1024;

void set_nonblocking(int fd) { fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK); }

// Young connections past their address's budget (Note [Store budgets]): kHandshakeSurplus, or an
// eighth of the descriptors where they are fewer.
size_t handshake_surplus_cap() {
  rlimit r{};
  if (getrlimit(RLIMIT_NOFILE, &r) != 0 || r.rlim_cur == RLIM_INFINITY) return kHandshakeSurplus;
  return std::min<size_t>(kHandshakeSurplus, static_cast<size_t>(r.rlim_cur) / 8);
}

// Authenticated connections the process can hold: a few descriptors stay for everything else it
// opens, and `unauthenticated` (and the surplus) for the connections still in the handshake.
size_t connection_cap(size_t unauthenticated, size_t surplus) {
  rlimit r{};
  if (getrlimit(RLIMIT_NOFILE, &r) != 0 || r.rlim_cur == RLIM_INFINITY) return kMaxConnections;
  const auto room = static_cast<size_t>(r.rlim_cur);
  const size_t reserved = 64 + unauthenticated + surplus;
  return std::clamp<size_t>(room > reserved + 16 ? room - reserved : 16, 16, kMaxConnections);
}

}  // namespace

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
    if (bind(fd, ai->ai_addr, ai->ai_addrlen) == 0 && listen(fd, kListenBacklog) == 0) {
      listen_fd = fd;
      break;
    }
    last_errno = errno;
    close(fd);
    // The port is held on this address: an error, never a reason to bind the next one (`localhost`
    // as ::1, then 127.0.0.1). Clients try the addresses in this same order and would reach the
    // holder first.
    if (last_errno == EADDRINUSE) break;
  }
  freeaddrinfo(res);
  if (listen_fd < 0) {
    const std::string at = "port " + std::to_string(requested_port) + " on " + host;
    if (last_errno == EADDRINUSE)
      throw std::runtime_error(at +
                               " is already in use: choose another port (MASTER_PORT, or dtrain-run --master_port), or "
                               "use dtrain-run --standalone for a free one");
    if (last_errno == EADDRNOTAVAIL)
      throw std::runtime_error("cannot listen on " + at + ": " + host +
                               " is not an address of this machine (set --master_addr to one of its addresses)");
    throw std::runtime_error("cannot listen on " + at + ": " + std::strerror(last_errno));
  }
  sockaddr_storage ss{};
  socklen_t len = sizeof(ss);
  getsockname(listen_fd, reinterpret_cast<sockaddr*>(&ss), &len);
  port = ntohs(ss.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port
                                        : reinterpret_cast<sockaddr_in*>(&ss)->sin_port);
  set_nonblocking(listen_fd);
}

StoreServer::StoreServer(const std::string& host, uint16_t port, std::string secret, ServerLimits limits)
    : impl_(std::make_unique<Impl>()) {
  impl_->host = host;
  impl_->secret = secret.empty() ? secret : check_job_secret(secret, "the store's job secret");
  impl_->limits = limits;
  impl_->surplus_cap = handshake_surplus_cap();
  if (limits.max_connections == 0)
    impl_->limits.max_connections = connection_cap(limits.max_unauthenticated, impl_->surplus_cap);
  if (limits.memory_budget == 0) impl_->limits.memory_budget = kMemoryBudget;
  impl_->limits.max_unauthenticated = std::max<size_t>(limits.max_unauthenticated, 1);
  impl_->limits.max_unauthenticated_per_peer = std::max<size_t>(limits.max_unauthenticated_per_peer, 1);
  impl_->bind_and_listen(port);
  if (pipe2(impl_->wake_pipe, O_CLOEXEC | O_NONBLOCK) != 0) {
    close(impl_->listen_fd);
    throw std::runtime_error(std::string("store server: pipe2 failed: ") + std::strerror(errno));
  }
  impl_->spare_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
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
  if (impl_->spare_fd >= 0) close(impl_->spare_fd);
}

uint16_t StoreServer::port() const { return impl_->port; }
const std::string& StoreServer::host() const { return impl_->host; }
uint64_t StoreServer::rejected_connections() const { return impl_->rejected.load(); }
size_t StoreServer::throttled_connections() const { return impl_->throttled.load(); }
size_t StoreServer::connections() const { return impl_->open_connections.load(); }
size_t StoreServer::held_bytes() const { return impl_->held.load(); }

void StoreServer::Impl::report(const std::string& what) {
  if (++reports <= 5) std::fprintf(stderr, "dtrain: the store at %s %s\n", where().c_str(), what.c_str());
}

void StoreServer::Impl::run() noexcept {
  for (;;) {
    try {
      if (!poll_once()) return;
    } catch (const std::exception& e) {
      report(std::string("went on after an error: ") + e.what());
    } catch (...) {
      report("went on after an unknown error");
    }
  }
}

int StoreServer::Impl::poll_timeout(Clock::time_point now) const {
  Clock::time_point nearest = Clock::time_point::max();
  for (const auto& w : waiters)
    if (w.has_deadline) nearest = std::min(nearest, w.deadline);
  if (!backlog.empty()) return 0;
  for (const auto& kv : conns) {
    const Connection& c = kv.second;
    if (!c.authed) nearest = std::min(nearest, c.opened + limits.handshake_timeout);
    if (!c.waiting && complete_frame(c.in, kMaxFrameBytes) == 0 && !c.in.empty())
      nearest = std::min(nearest, c.frame_from + limits.frame_timeout);
    if (!c.out.empty()) nearest = std::min(nearest, c.out_since + limits.unread_reply_timeout);
  }
  if (listen_paused_until > now) nearest = std::min(nearest, listen_paused_until);
  if (accept_after > now) nearest = std::min(nearest, accept_after);
  if (surplus > 0) nearest = std::min(nearest, surplus_until());
  if (nearest == Clock::time_point::max()) return -1;
  const auto ms = std::chrono::ceil<std::chrono::milliseconds>(nearest - now).count();
  return static_cast<int>(std::clamp<int64_t>(ms, 0, 1 << 30));
}

bool StoreServer::Impl::poll_once() {
  std::vector<pollfd>& fds = pollfds;
  fds.clear();
  fds.push_back({wake_pipe[0], POLLIN, 0});
  const auto now = Clock::now();
  fds.push_back({now >= listen_paused_until && now >= accept_after ? listen_fd : -1, POLLIN, 0});
  size_t backed_up = 0;
  for (auto& kv : conns) {
    const Connection& c = kv.second;
    backed_up += c.out.size() >= kOutputHighWater ? 1 : 0;
    // Parked, refused, backed up or done for this round: read no further, but still notice a peer
    // that leaves.
    const bool reading = !c.waiting && !c.closing && !c.backlog && c.out.size() < kOutputHighWater;
    short ev = reading ? POLLIN : POLLRDHUP;
    if (!c.out.empty()) ev |= POLLOUT;
    fds.push_back({kv.first, ev, 0});
  }
  throttled.store(backed_up);
  const int n = poll(fds.data(), fds.size(), poll_timeout(now));
  if (n < 0 && errno != EINTR) {
    report(std::string("stopped: poll failed: ") + std::strerror(errno));
    return false;
  }
  if (fds[0].revents) return false;  // destructor asked us to stop
  // accept_all may close connections for newcomers, which then reuse their descriptors: what poll
  // said of the closed one (an error, a hang-up) is not the newcomer's.
  const uint64_t polled_up_to = accepted;
  if (fds[1].revents & POLLIN) accept_all();
  for (size_t i = 2; i < fds.size(); ++i) {
    const int fd = fds[i].fd;
    if (!fds[i].revents || !conns.count(fd) || conns.at(fd).doomed || conns.at(fd).seq > polled_up_to) continue;
    try {
      if (fds[i].revents & (POLLERR | POLLNVAL)) {
        drop(fd);
        continue;
      }
      if (fds[i].revents & POLLOUT) {
        Connection& c = conns.at(fd);
        flush(c);
        if (c.closing && c.out.empty()) {
          drop(fd);
          continue;
        }
        if (!c.in.empty()) ready.push_back(fd);  // drained: its buffered requests are read again
      }
      if ((fds[i].revents & (POLLIN | POLLHUP | POLLRDHUP)) && !on_readable(conns.at(fd))) drop(fd);
    } catch (const std::bad_alloc&) {
      report("dropped a connection it had no memory for");
      if (conns.count(fd)) drop(fd);
    }
  }
  expire(Clock::now());
  // The connections whose requests were left over last round are read now, after every other
  // connection had its turn. See Note [Store budgets].
  for (int fd : std::exchange(backlog, {})) {
    auto it = conns.find(fd);
    if (it == conns.end()) continue;
    it->second.backlog = false;
    ready.push_back(fd);
  }
  settle();
  reap();
  held.store(stored_bytes + buffered);
  return true;
}

void StoreServer::Impl::accept_all() {
  for (;;) {
    if (!room_for_one()) return;
    sockaddr_storage from{};
    socklen_t from_len = sizeof(from);
    const int fd = accept4(listen_fd, reinterpret_cast<sockaddr*>(&from), &from_len, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd < 0) {
      if (errno == EMFILE || errno == ENFILE) {
        // Out of descriptors: the pending connection would make poll() report the listening
        // socket readable forever (100% CPU). Refuse one with the spare descriptor, and look
        // again in 100 ms, when connections may have closed.
        if (spare_fd >= 0) {
          close(spare_fd);
          const int extra = accept4(listen_fd, nullptr, nullptr, SOCK_CLOEXEC);
          if (extra >= 0) close(extra);
          spare_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
        }
        listen_paused_until = Clock::now() + std::chrono::milliseconds(100);
        report("is out of file descriptors (" + std::string(std::strerror(errno)) +
               "): refusing connections until some close (raise ulimit -n)");
      }
      return;  // EAGAIN, or a transient error: try again on the next POLLIN
    }
    // Room among the connections in the handshake first, by closing the oldest: a peer that holds
    // idle connections without the secret never keeps the job's out. See Note [Store budgets].
    const std::string address = peer_name(from, false);
    room_for(address);
    set_keepalive(fd);
    Connection& c = conns[fd];
    open_connections = conns.size();
    c.fd = fd;
    c.opened = Clock::now();
    c.seq = ++accepted;
    c.peer = peer_name(from, true);
    c.peer_address = address;
    enter_handshake(c);
    if (!secret.empty()) c.nonce = random_bytes(kNonceBytes);
    reply(c, Writer(uint8_t(Status::kOk)).str(kMagic).i64(secret.empty() ? 0 : 1).blob(c.nonce));
  }
}

bool StoreServer::Impl::on_readable(Connection& c) {
  if (!c.authed) return read_auth(c);
  uint8_t buf[65536];
  for (;;) {
    const int64_t whole = complete_frame(c.in, kMaxFrameBytes);
    if (whole < 0) return false;
    // Read ahead of the requests being handled by a bounded amount only.
    if (whole > 0 && c.in.size() >= kInputBuffered) break;
    const ssize_t n = recv(c.fd, buf, sizeof(buf), 0);
    if (n > 0) {
      if (c.in.empty()) c.frame_from = Clock::now();
      c.in.insert(c.in.end(), buf, buf + n);
      recharge(c);
      shed();
      if (c.doomed) return false;
      continue;
    }
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
    if (n < 0 && errno == EINTR) continue;
    return false;  // EOF or error: the peer is gone (maybe mid-request)
  }
  return read_frames(c);
}

bool StoreServer::Impl::read_frames(Connection& c) {
  if (!c.authed) return true;  // read_auth's: the handshake is one frame, read alone
  size_t pos = 0;
  int handled = 0;
  while (!c.waiting && !c.closing && c.out.size() < kOutputHighWater) {
    if (c.in.size() - pos < 4) break;
    const uint32_t len = decode_u32(c.in.data() + pos);
    if (len == 0 || len > kMaxFrameBytes) return false;
    if (c.in.size() - pos - 4 < len) break;
    if (handled++ == kFramesPerRound) {  // the others' turn: the rest waits for the next round
      c.backlog = true;
      backlog.push_back(c.fd);
      break;
    }
    Reader r(c.in.data() + pos + 4, len);
    pos += 4 + len;
    try {
      handle(c, r);
    } catch (const std::bad_alloc&) {
      throw;  // the connection goes: poll_once reports it
    } catch (const std::exception& e) {
      reply(c, Writer(uint8_t(Status::kError)).str(e.what()));
    }
  }
  c.in.erase(c.in.begin(), c.in.begin() + static_cast<std::ptrdiff_t>(pos));
  if (pos > 0 && !c.in.empty()) c.frame_from = Clock::now();
  if (c.in.empty() && c.in.capacity() > kKeptBuffer) std::vector<uint8_t>().swap(c.in);
  recharge(c);
  if (c.doomed || (c.closing && c.out.empty())) return false;
  return true;
}

void StoreServer::Impl::reply(Connection& c, const Writer& w) {
  if (c.doomed) return;
  if (c.out.empty()) c.out_since = Clock::now();
  w.append_frame_to(c.out);
  flush(c);
  recharge(c);  // flush charges only what it sent
  shed();
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
  if (sent == 0) return;
  c.out_since = Clock::now();  // the client reads: its deadline starts again
  c.out.erase(c.out.begin(), c.out.begin() + static_cast<std::ptrdiff_t>(sent));
  if (c.out.empty() && c.out.capacity() > kKeptBuffer) std::vector<uint8_t>().swap(c.out);
  recharge(c);
}

// Answers the waiters a mutation made ready and reads what they and drained connections had
// pipelined, until nothing more is ready: a loop where a recursion would be as deep as the chain of
// connections waiting on each other's keys.
void StoreServer::Impl::settle() {
  for (;;) {
    if (changed) {
      changed = false;
      answer_ready_waiters();
    }
    if (ready.empty()) return;
    std::vector<int> batch;
    batch.swap(ready);
    std::sort(batch.begin(), batch.end());
    batch.erase(std::unique(batch.begin(), batch.end()), batch.end());
    for (int fd : batch) {
      auto it = conns.find(fd);
      if (it == conns.end()) continue;
      try {
        if (!read_frames(it->second)) drop(fd);
      } catch (const std::bad_alloc&) {
        report("dropped a connection it had no memory for");
        drop(fd);
      }
    }
    reap();
  }
}

void StoreServer::Impl::reap() {
  for (int fd : std::exchange(doomed, {}))
    if (conns.count(fd)) drop(fd);
}

void StoreServer::Impl::expire(Clock::time_point now) {
  trim_surplus(now);
  for (auto it = waiters.begin(); it != waiters.end();) {
    if (!it->has_deadline || it->deadline > now) {
      ++it;
      continue;
    }
    auto c = conns.find(it->fd);
    if (c != conns.end()) {
      c->second.waiting = false;
      reply(c->second, Writer(uint8_t(Status::kTimeout)));
      ready.push_back(it->fd);
    }
    it = waiters.erase(it);
  }
  std::vector<int> late;
  for (const auto& kv : conns) {
    const Connection& c = kv.second;
    if (!c.authed && now - c.opened >= limits.handshake_timeout) {
      if (!c.closing) {  // a refused one was counted when refused
        ++rejected;
        notice(Refusal::kHandshake, "closed the connection from " + c.peer + ": no handshake within " +
                                        std::to_string(limits.handshake_timeout.count()) + " ms");
      }
      late.push_back(kv.first);
    } else if (!c.in.empty() && !c.waiting && now - c.frame_from >= limits.frame_timeout &&
               complete_frame(c.in, kMaxFrameBytes) == 0) {
      late.push_back(kv.first);  // a frame begun and never finished: a stuck or hostile peer
    } else if (!c.out.empty() && now - c.out_since >= limits.unread_reply_timeout) {
      notice(Refusal::kUnread, "dropped the connection from " + c.peer + ": it read none of its " +
                                   std::to_string(c.out.size()) + " bytes of replies for " +
                                   std::to_string(limits.unread_reply_timeout.count()) + " ms");
      late.push_back(kv.first);
    }
  }
  for (int fd : late) drop(fd);
}

void StoreServer::Impl::drop(int fd) {
  waiters.erase(std::remove_if(waiters.begin(), waiters.end(), [fd](const Waiter& w) { return w.fd == fd; }),
                waiters.end());
  auto it = conns.find(fd);
  if (it != conns.end()) {
    if (it->second.authed)
      --authed_count;
    else
      leave_handshake(it->second);
    buffered -= it->second.charged;
    conns.erase(it);
  }
  open_connections = conns.size();
  close(fd);
}

}  // namespace dtrain::store
