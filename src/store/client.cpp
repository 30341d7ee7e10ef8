// StoreClient: one blocking connection to a StoreServer.
//
// Steps:
//   1. Resolve host (resolve_waiting): a name that does not resolve yet is asked again until
//      connect_timeout, with one line on stderr (Note [Names that resolve late] in resolve.cpp).
//   2. Try each address with a non-blocking connect bounded by the remaining time; a refused or
//      unreachable peer (the server not up yet) is retried every kRetryInterval until
//      connect_timeout, then "cannot reach the rendezvous at HOST:PORT within Ns: <strerror>".
//   3. The handshake (Note [Store handshake] in server.cpp): HELLO read, AUTH sent, the server's
//      proof checked. The socket keeps TCP keepalive on (protocol.h). A store that closes the
//      connection in the handshake, or refuses it for now (its answer ends with a 1: too many
//      connections), is tried again as a refused connect is, until connect_timeout.
//      See Note [Store budgets] in server_guard.cpp.
//   4. Each call sends one request frame (protocol.h, MSG_NOSIGNAL) and waits for its response
//      until a deadline: connect_timeout, or a GET's/WAIT's own timeout plus kReplyGrace (the
//      server answers TIMEOUT at the timeout itself, so the stream never holds a stale reply when
//      the server is alive). Past the deadline the connection is closed and the call throws
//      TimeoutError: the store's host is stopped or gone.
#include "store/auth.h"
#include "store/protocol.h"
#include "store/store.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <optional>
#include <thread>

namespace dtrain::store {

using namespace detail;
using Clock = std::chrono::steady_clock;

namespace {

constexpr Millis kRetryInterval{75};
constexpr Millis kReplyGrace{5000};
constexpr Millis kHandshakeBudget{10000};             // at least, after the connect
constexpr Millis kForever{Millis(int64_t{1} << 40)};  // about 35 years: no deadline

// The store closed the connection, or refused it for now: in the handshake, worth another try.
struct RefusedForNow : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// An ERROR answer's message, and whether the store asks the client to try again later.
std::string refusal(Reader& r, bool* again) {
  std::string why = r.str();
  *again = false;
  try {
    *again = !r.done() && r.i64() == 1;
  } catch (const std::runtime_error&) {
  }
  return why;
}

std::string seconds_text(Millis ms) {
  char buf[32];
  double s = ms.count() / 1000.0;
  if (ms.count() % 1000 == 0)
    snprintf(buf, sizeof(buf), "%llds", static_cast<long long>(ms.count() / 1000));
  else
    snprintf(buf, sizeof(buf), "%.1fs", s);
  return buf;
}

// One connect attempt to one address, bounded by `budget`. Returns the fd or -1 with errno set.
int try_connect(const addrinfo* ai, Millis budget) {
  int fd = socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, ai->ai_protocol);
  if (fd < 0) return -1;
  if (connect(fd, ai->ai_addr, ai->ai_addrlen) != 0) {
    if (errno != EINPROGRESS) {
      int e = errno;
      close(fd);
      errno = e;
      return -1;
    }
    pollfd p{fd, POLLOUT, 0};
    int n = poll(&p, 1, static_cast<int>(std::max<int64_t>(budget.count(), 1)));
    int err = 0;
    socklen_t len = sizeof(err);
    if (n <= 0)
      err = n == 0 ? ETIMEDOUT : errno;
    else
      getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len);
    if (err != 0) {
      close(fd);
      errno = err;
      return -1;
    }
  }
  set_keepalive(fd);  // stays non-blocking: every wait is a poll() with a deadline
  return fd;
}

}  // namespace

struct StoreClient::Impl {
  std::string host;
  uint16_t port = 0;
  int fd = -1;
  bool shaking = false;  // in the handshake: a closed connection is a RefusedForNow
  std::string secret;
  Millis op_timeout{0};
  bool lost = false;  // closed after a deadline passed: no reply can be trusted on this stream

  std::string where() const { return host_port(host, port); }
  void send_all(const std::vector<uint8_t>& frame, Clock::time_point deadline);
  void recv_all(uint8_t* p, size_t n, Clock::time_point deadline);
  // Waits for `events` on fd until `deadline`; throws TimeoutError after closing the connection.
  void await(short events, Clock::time_point deadline);
  std::vector<uint8_t> read_frame(Clock::time_point deadline);
  void handshake(Clock::time_point deadline);
  // Sends the request and returns the response payload; status in `status`. `wait`: a GET's or
  // WAIT's own timeout (0: forever), which bounds the request instead of op_timeout.
  std::vector<uint8_t> call(const Writer& request, Status* status, std::optional<Millis> wait);
  std::vector<uint8_t> call_ok(const Writer& request, std::optional<Millis> wait = std::nullopt);
};

StoreClient::StoreClient(const std::string& host, uint16_t port, Millis connect_timeout, std::string secret,
                         Millis reply_timeout)
    : impl_(std::make_unique<Impl>()) {
  impl_->host = host;
  impl_->port = port;
  impl_->secret = secret.empty() ? secret : check_job_secret(secret, "the job secret");
  impl_->op_timeout = std::min(connect_timeout, kForever);
  const auto deadline = Clock::now() + impl_->op_timeout;
  // A name that does not resolve yet (a pod's DNS record) is waited for within connect_timeout.
  AddrInfoPtr res =
      resolve_waiting(host, port, impl_->op_timeout, "MASTER_ADDR or --master_addr",
                      [](const std::string& line) { std::fprintf(stderr, "dtrain: %s\n", line.c_str()); });
  std::string last_reason = std::strerror(ETIMEDOUT);
  for (;;) {
    for (addrinfo* ai = res.get(); ai && impl_->fd < 0; ai = ai->ai_next) {
      auto left = std::chrono::duration_cast<Millis>(deadline - Clock::now());
      impl_->fd = try_connect(ai, std::max(left, Millis(1)));
      if (impl_->fd < 0) last_reason = std::strerror(errno);
    }
    if (impl_->fd >= 0) {
      try {
        impl_->handshake(reply_timeout.count() > 0 ? Clock::now() + std::min(reply_timeout, kForever)
                                                   : std::max(deadline, Clock::now() + kHandshakeBudget));
        break;
      } catch (const RefusedForNow& e) {
        last_reason = e.what();  // closed or refused for now: tried again, as a refused connect
      } catch (...) {
        if (impl_->fd >= 0) close(impl_->fd);
        impl_->fd = -1;
        throw;
      }
      if (impl_->fd >= 0) close(impl_->fd);
      impl_->fd = -1;
    }
    if (Clock::now() >= deadline) break;
    auto left = std::chrono::duration_cast<Millis>(deadline - Clock::now());
    std::this_thread::sleep_for(std::min(left, kRetryInterval));
  }
  if (impl_->fd < 0)
    throw std::runtime_error("cannot reach the rendezvous at " + impl_->where() + " within " +
                             seconds_text(connect_timeout) + ": " + last_reason);
  if (reply_timeout.count() > 0) set_timeout(reply_timeout);
}

StoreClient::~StoreClient() {
  if (impl_->fd >= 0) close(impl_->fd);
}

void StoreClient::Impl::await(short events, Clock::time_point deadline) {
  for (;;) {
    const auto left = std::chrono::ceil<Millis>(deadline - Clock::now()).count();
    pollfd p{fd, events, 0};
    const int n = poll(&p, 1, static_cast<int>(std::clamp<int64_t>(left, 0, 1 << 30)));
    if (n > 0) return;  // ready, or an error the next recv/send reports
    if (n < 0 && errno == EINTR) continue;
    if (n == 0 && left > (int64_t{1} << 30)) continue;  // a wait longer than poll takes at once
    close(fd);
    fd = -1;
    lost = true;
    throw TimeoutError("the rendezvous store at " + where() +
                       " did not answer in time: its host is stopped, overloaded or gone (the connection is closed)");
  }
}

void StoreClient::Impl::send_all(const std::vector<uint8_t>& frame, Clock::time_point deadline) {
  size_t sent = 0;
  while (sent < frame.size()) {
    ssize_t n = send(fd, frame.data() + sent, frame.size() - sent, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      await(POLLOUT, deadline);
      continue;
    }
    if (n <= 0 && shaking)
      throw RefusedForNow(std::string("the store closed the connection in the handshake: ") + std::strerror(errno));
    if (n <= 0)
      throw std::runtime_error("lost the connection to the rendezvous at " + where() + ": " + std::strerror(errno));
    sent += static_cast<size_t>(n);
  }
}

void StoreClient::Impl::recv_all(uint8_t* p, size_t n, Clock::time_point deadline) {
  while (n > 0) {
    ssize_t r = recv(fd, p, n, 0);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      await(POLLIN, deadline);
      continue;
    }
    if (r == 0 && shaking) throw RefusedForNow("the store closed the connection in the handshake");
    if (r == 0) throw std::runtime_error("the rendezvous at " + where() + " closed the connection");
    if (r < 0 && shaking)
      throw RefusedForNow(std::string("the store reset the connection in the handshake: ") + std::strerror(errno));
    if (r < 0)
      throw std::runtime_error("lost the connection to the rendezvous at " + where() + ": " + std::strerror(errno));
    p += r;
    n -= static_cast<size_t>(r);
  }
}

std::vector<uint8_t> StoreClient::Impl::read_frame(Clock::time_point deadline) {
  uint8_t len_le[4];
  recv_all(len_le, 4, deadline);
  uint32_t len = decode_u32(len_le);
  if (len == 0 || len > kMaxFrameBytes)
    throw std::runtime_error("malformed response from the rendezvous at " + where());
  std::vector<uint8_t> payload(len);
  recv_all(payload.data(), len, deadline);
  return payload;
}

void StoreClient::Impl::handshake(Clock::time_point deadline) {
  shaking = true;
  struct Done {
    bool& flag;
    ~Done() { flag = false; }
  } done{shaking};
  const std::vector<uint8_t> hello = read_frame(deadline);
  Reader r(hello.data(), hello.size());
  const auto status = static_cast<Status>(r.head());
  if (status == Status::kError) {  // it names the store and why
    bool again = false;
    const std::string why = refusal(r, &again);
    if (again) throw RefusedForNow(why);
    throw std::runtime_error(why);
  }
  std::string magic;
  int64_t auth = 0;
  Bytes server_nonce;
  try {
    magic = r.str();
    auth = r.i64();
    server_nonce = r.blob();
  } catch (const std::exception&) {
    magic.clear();
  }
  if (status != Status::kOk || magic != kMagic)
    throw std::runtime_error("the server at " + where() +
                             " is not a dtrain rendezvous store (its first message is not the store's greeting): "
                             "another program holds the port");
  if (auth && secret.empty())
    throw std::runtime_error("the rendezvous at " + where() +
                             " requires the job's secret, which this process was "
                             "not given: start it with dtrain-run, or set " +
                             kSecretEnv + " to the job's secret");
  if (!auth && !secret.empty())
    throw std::runtime_error("the rendezvous at " + where() +
                             " asks for no job secret, so it is not this job's "
                             "store (a job started without the secret, or another program on the port): "
                             "give every launcher of the job the same secret");
  Writer w{uint8_t(Op::kAuth)};
  Bytes client_nonce;
  if (auth) {
    client_nonce = random_bytes(kNonceBytes);
    w.blob(client_nonce).blob(handshake_mac(secret, kClientRole, server_nonce, client_nonce));
  } else {
    w.blob({}).blob({});
  }
  send_all(w.frame(), deadline);
  const std::vector<uint8_t> answer = read_frame(deadline);
  Reader a(answer.data(), answer.size());
  if (static_cast<Status>(a.head()) != Status::kOk) {
    bool again = false;
    const std::string why = refusal(a, &again);
    if (again) throw RefusedForNow("the store at " + where() + " " + why);
    throw std::runtime_error("the rendezvous at " + where() + " " + why +
                             (auth ? " (check that every launcher of the job has the same secret)" : ""));
  }
  const Bytes proof = a.blob();
  if (auth && !same_digest(proof, handshake_mac(secret, kServerRole, server_nonce, client_nonce)))
    throw std::runtime_error("the rendezvous at " + where() +
                             " did not prove it knows this job's secret: it is not "
                             "this job's store");
}

std::vector<uint8_t> StoreClient::Impl::call(const Writer& request, Status* status, std::optional<Millis> wait) {
  if (fd < 0)
    throw std::runtime_error("the connection to the rendezvous at " + where() +
                             (lost ? " was closed after the store did not answer in time" : " is closed"));
  // A GET's or WAIT's own timeout bounds it (0: forever); any other request, op_timeout.
  const Millis budget = !wait ? op_timeout : wait->count() > 0 ? std::min(*wait, kForever) + kReplyGrace : kForever;
  const auto deadline = Clock::now() + budget;
  send_all(request.frame(), deadline);
  std::vector<uint8_t> payload = read_frame(deadline);
  *status = static_cast<Status>(payload[0]);
  return payload;
}

std::vector<uint8_t> StoreClient::Impl::call_ok(const Writer& request, std::optional<Millis> wait) {
  Status st;
  auto payload = call(request, &st, wait);
  if (st == Status::kError) {
    Reader r(payload.data(), payload.size());
    r.head();
    throw std::runtime_error("rendezvous store at " + where() + ": " + r.str());
  }
  return payload;
}

void StoreClient::set(const std::string& key, const Bytes& value) {
  impl_->call_ok(Writer(uint8_t(Op::kSet)).str(key).blob(value));
}

Bytes StoreClient::get(const std::string& key, Millis timeout) {
  auto p = impl_->call_ok(Writer(uint8_t(Op::kGet)).str(key).i64(timeout.count()), timeout);
  Reader r(p.data(), p.size());
  if (static_cast<Status>(r.head()) == Status::kTimeout)
    throw TimeoutError("timed out after " + seconds_text(timeout) + " waiting for key '" + key +
                       "' in the rendezvous store at " + impl_->where());
  return r.blob();
}

Bytes StoreClient::compare_set(const std::string& key, const Bytes& expected, const Bytes& desired) {
  auto p = impl_->call_ok(Writer(uint8_t(Op::kCompareSet)).str(key).blob(expected).blob(desired));
  Reader r(p.data(), p.size());
  r.head();
  return r.blob();
}

int64_t StoreClient::add(const std::string& key, int64_t delta) {
  auto p = impl_->call_ok(Writer(uint8_t(Op::kAdd)).str(key).i64(delta));
  Reader r(p.data(), p.size());
  r.head();
  return r.i64();
}

bool StoreClient::check(const std::vector<std::string>& keys) {
  Writer w{uint8_t(Op::kCheck)};
  w.i64(static_cast<int64_t>(keys.size()));
  for (const auto& k : keys) w.str(k);
  auto p = impl_->call_ok(w);
  Reader r(p.data(), p.size());
  r.head();
  return r.i64() != 0;
}

bool StoreClient::delete_key(const std::string& key) {
  auto p = impl_->call_ok(Writer(uint8_t(Op::kDelete)).str(key));
  Reader r(p.data(), p.size());
  r.head();
  return r.i64() != 0;
}

int64_t StoreClient::num_keys() {
  auto p = impl_->call_ok(Writer(uint8_t(Op::kNumKeys)));
  Reader r(p.data(), p.size());
  r.head();
  return r.i64();
}

void StoreClient::wait(const std::vector<std::string>& keys, Millis timeout) {
  Writer w{uint8_t(Op::kWait)};
  w.i64(timeout.count()).i64(static_cast<int64_t>(keys.size()));
  for (const auto& k : keys) w.str(k);
  auto p = impl_->call_ok(w, timeout);
  if (static_cast<Status>(p[0]) == Status::kTimeout) {
    std::string names;
    for (const auto& k : keys) names += (names.empty() ? "'" : ", '") + k + "'";
    throw TimeoutError("timed out after " + seconds_text(timeout) + " waiting for key" +
                       (keys.size() == 1 ? " " : "s ") + names + " in the rendezvous store at " + impl_->where());
  }
}

std::string StoreClient::local_address() const {
  sockaddr_storage ss{};
  socklen_t len = sizeof(ss);
  if (getsockname(impl_->fd, reinterpret_cast<sockaddr*>(&ss), &len) != 0)
    throw std::runtime_error(std::string("getsockname failed: ") + std::strerror(errno));
  char buf[INET6_ADDRSTRLEN] = {0};
  if (ss.ss_family == AF_INET6) {
    auto* a6 = reinterpret_cast<sockaddr_in6*>(&ss);
    if (IN6_IS_ADDR_V4MAPPED(&a6->sin6_addr))
      inet_ntop(AF_INET, &a6->sin6_addr.s6_addr[12], buf, sizeof(buf));
    else
      inet_ntop(AF_INET6, &a6->sin6_addr, buf, sizeof(buf));
  } else {
    inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(&ss)->sin_addr, buf, sizeof(buf));
  }
  return buf;
}

void StoreClient::set_timeout(Millis timeout) { impl_->op_timeout = std::clamp(timeout, Millis(1), kForever); }
Millis StoreClient::timeout() const { return impl_->op_timeout; }

const std::string& StoreClient::host() const { return impl_->host; }
uint16_t StoreClient::port() const { return impl_->port; }

}  // namespace dtrain::store
