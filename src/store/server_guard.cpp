// What a peer without the job secret can make StoreServer do: the handshake read alone, the
// connections still in it on their own budget, the store's memory budget, and node 0's lines about
// what it refuses.
//
// Note [Store budgets]: anyone who reaches the store's port can connect, so whatever a connection
// costs before it has proved the secret must be small, bounded, and never at the job's expense.
//   - A connection in the handshake counts toward its own budget (ServerLimits::max_unauthenticated,
//     and max_unauthenticated_per_peer from one address), never toward the authenticated one. When
//     it is full, the oldest such connection (of the newcomer's address first) is closed to take
//     the newcomer: a peer that holds idle connections only ever closes its own, or, from many
//     addresses, its oldest, while a job client needs one round trip to get through. Such a client
//     closed in the handshake, or refused for the authenticated cap, retries until its connect
//     timeout, as it does a refused connect.
//   - Each connection has kEvictAfter (50 ms) of grace to answer its greeting: a job client that
//     does is never closed for a newcomer, from its own address either (a local process that
//     floods from 127.0.0.1). While its address's budget is full of young connections, a newcomer
//     is taken beyond it, as the surplus, which that address pays for alone (it never counts toward
//     max_unauthenticated); once out of their grace, the address's oldest are closed down to its
//     budget (trim_surplus), so a flood holds no slot for longer. The surplus is at most
//     kHandshakeSurplus in all (or an eighth of the descriptors, kept out of the authenticated
//     cap): past it, the flooding address's oldest is closed however young. A client is thus safe
//     from a flood of up to kHandshakeSurplus connections from its address within its answer's
//     round trip (1024 in 50 ms: about 20 000 a second, what this store accepts on a busy core).
//   - Before the secret is proved, the server reads one frame of at most kMaxAuthFrameBytes and
//     nothing behind it; a first frame that is not a well-formed AUTH closes the connection without
//     a reply, so junk costs one read and no write. The handshake has its own deadline
//     (handshake_timeout, 5 s).
//   - After it, each poll round handles at most kFramesPerRound requests of one connection; the
//     rest waits until every other connection had its turn, so a client that pipelines tiny frames
//     cannot starve the others.
//   - Stored bytes, queued replies and half-received requests, over every connection, share one
//     memory budget (memory_budget, 3 GiB: the 2 GiB of stored bytes and 1 GiB more): the
//     connection whose request or reply takes the store past it is dropped with a line naming it,
//     and a SET past it is refused. A reply the client does not read for unread_reply_timeout
//     drops the connection: queued bytes never stay forever.
//   - While this happens node 0 says so, one line per kind of refusal every 10 s at most, naming
//     the peer; the launcher's final count says how many there were in all.
#include <arpa/inet.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>

#include "store/auth.h"
#include "store/server_impl.h"

namespace dtrain::store {

using namespace detail;

namespace detail {

std::string peer_name(const sockaddr_storage& from, bool with_port) {
  char buf[INET6_ADDRSTRLEN] = {0};
  uint16_t port = 0;
  if (from.ss_family == AF_INET6) {
    const auto* a6 = reinterpret_cast<const sockaddr_in6*>(&from);
    port = ntohs(a6->sin6_port);
    if (IN6_IS_ADDR_V4MAPPED(&a6->sin6_addr))
      inet_ntop(AF_INET, &a6->sin6_addr.s6_addr[12], buf, sizeof(buf));
    else
      inet_ntop(AF_INET6, &a6->sin6_addr, buf, sizeof(buf));
  } else if (from.ss_family == AF_INET) {
    const auto* a4 = reinterpret_cast<const sockaddr_in*>(&from);
    port = ntohs(a4->sin_port);
    inet_ntop(AF_INET, &a4->sin_addr, buf, sizeof(buf));
  } else {
    return "an unknown address";
  }
  return with_port ? host_port(buf, port) : std::string(buf);
}

}  // namespace detail

bool StoreServer::Impl::room_for_one() {
  trim_surplus(Clock::now());
  // The surplus is young connections of addresses past their own budget: theirs to pay for.
  while (unauthed.size() - surplus >= limits.max_unauthenticated) {
    const auto [seq, fd] = *unauthed.begin();
    Connection& c = conns.at(fd);
    if (!settles(c)) continue;
    // Young, in a burst of clients: no churn, the newcomers wait in the listen backlog.
    if (!c.closing && Clock::now() - c.opened < kEvictAfter) {
      accept_after = c.opened + kEvictAfter;
      return false;
    }
    evict(c, "in all");
  }
  return true;
}

void StoreServer::Impl::room_for(const std::string& address) {
  for (;;) {
    const auto mine = unauthed_from.find(address);
    if (mine == unauthed_from.end() || mine->second.size() < limits.max_unauthenticated_per_peer) return;
    Connection& c = conns.at(mine->second.begin()->second);
    if (!settles(c)) continue;
    // Its grace: a job client answers its greeting within a round trip, however many connections
    // others open from its address meanwhile; the newcomer is taken beyond the budget.
    if (!c.closing && Clock::now() - c.opened < kEvictAfter && surplus < surplus_cap) return;
    evict(c, "from one address");
  }
}

void StoreServer::Impl::trim_surplus(Clock::time_point now) {
  if (surplus == 0) return;
  std::vector<std::string> over;
  for (const auto& [address, mine] : unauthed_from)
    if (mine.size() > limits.max_unauthenticated_per_peer) over.push_back(address);
  for (const std::string& address : over) {
    for (;;) {
      const auto mine = unauthed_from.find(address);
      if (mine == unauthed_from.end() || mine->second.size() <= limits.max_unauthenticated_per_peer) break;
      Connection& c = conns.at(mine->second.begin()->second);
      if (!settles(c)) continue;
      if (!c.closing && now - c.opened < kEvictAfter) break;  // the oldest is young: so are the others
      evict(c, "from one address");
    }
  }
}

StoreServer::Impl::Clock::time_point StoreServer::Impl::surplus_until() const {
  Clock::time_point nearest = Clock::time_point::max();
  for (const auto& [address, mine] : unauthed_from)
    if (mine.size() > limits.max_unauthenticated_per_peer)
      nearest = std::min(nearest, conns.at(mine.begin()->second).opened + kEvictAfter);
  return nearest;
}

void StoreServer::Impl::enter_handshake(Connection& c) {
  unauthed.emplace(c.seq, c.fd);
  auto& mine = unauthed_from[c.peer_address];
  mine.emplace(c.seq, c.fd);
  if (mine.size() > limits.max_unauthenticated_per_peer) ++surplus;
}

void StoreServer::Impl::leave_handshake(Connection& c) {
  if (unauthed.erase(c.seq) == 0) return;
  accept_after = {};  // room in the handshake budget
  const auto mine = unauthed_from.find(c.peer_address);
  if (mine == unauthed_from.end()) return;
  if (mine->second.size() > limits.max_unauthenticated_per_peer) --surplus;
  mine->second.erase(c.seq);
  if (mine->second.empty()) unauthed_from.erase(mine);
}

bool StoreServer::Impl::settles(Connection& c) {
  // Its handshake may be waiting in the socket, unread: a client that has sent it is never evicted.
  if (!c.closing && !read_auth(c)) {
    drop(c.fd);
    return false;
  }
  return conns.count(c.fd) && !c.authed && unauthed.count(c.seq);
}

void StoreServer::Impl::evict(Connection& c, const char* scope) {
  if (!c.closing) ++rejected;
  const auto held_ms = std::chrono::duration_cast<Millis>(Clock::now() - c.opened).count();
  const size_t cap = std::string(scope) == "in all" ? limits.max_unauthenticated : limits.max_unauthenticated_per_peer;
  notice(Refusal::kEvicted, "closed the connection from " + c.peer + ", still without the handshake after " +
                                std::to_string(held_ms) + " ms, to take a newer one (" + std::to_string(cap) + " " +
                                scope + " may be in the handshake)");
  // A job client closed here retries: the answer tells it so (a trailing 1, which older clients skip).
  if (!c.closing)
    reply(c, Writer(uint8_t(Status::kError))
                 .str("closed this connection in the handshake to take a newer one (too many connections are "
                      "in the handshake)")
                 .i64(1));
  drop(c.fd);
}

bool StoreServer::Impl::read_auth(Connection& c) {
  // Refused, its answer not sent yet, and now the peer hangs up (it is polled for nothing else):
  // never a second handshake on a refused connection.
  if (c.closing) return false;
  uint8_t buf[4 + kMaxAuthFrameBytes];
  for (;;) {
    // Never past the one frame: nothing a peer sends behind it is read before it proved the secret.
    size_t want = 4 - std::min<size_t>(4, c.in.size());
    if (want == 0) {
      const uint32_t len = decode_u32(c.in.data());
      if (len == 0 || len > kMaxAuthFrameBytes) {
        ++rejected;
        notice(Refusal::kHandshake, "closed the connection from " + c.peer + ": its first frame (of " +
                                        std::to_string(len) + " bytes) is not the handshake");
        return false;
      }
      want = 4 + len - c.in.size();
      if (want == 0) break;
    }
    const ssize_t n = recv(c.fd, buf, want, 0);
    if (n > 0) {
      if (c.in.empty()) c.frame_from = Clock::now();
      c.in.insert(c.in.end(), buf, buf + n);
      recharge(c);
      continue;
    }
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return true;
    if (n < 0 && errno == EINTR) continue;
    // EOF or error: one that left without proving the secret (a client that has none gives up at
    // the greeting) is a refusal too.
    if (!c.closing && !secret.empty()) {
      ++rejected;
      notice(Refusal::kHandshake,
             "refused the connection from " + c.peer + ": it left without proving the job's secret");
    }
    return false;
  }
  std::vector<uint8_t> frame;
  frame.swap(c.in);
  recharge(c);
  return handshake(c, frame.data() + 4, frame.size() - 4);
}

bool StoreServer::Impl::handshake(Connection& c, const uint8_t* frame, size_t len) {
  Reader r(frame, len);
  Bytes client_nonce, mac;
  bool well_formed = false;
  try {
    if (static_cast<Op>(r.head()) == Op::kAuth) {
      client_nonce = r.blob();
      mac = r.blob();
      well_formed = r.done();
    }
  } catch (const std::runtime_error&) {
    well_formed = false;
  }
  if (!well_formed) {  // junk costs one read and no reply
    ++rejected;
    notice(Refusal::kHandshake,
           "closed the connection from " + c.peer + ": its first frame is not a well-formed handshake");
    return false;
  }
  if (!secret.empty() && (client_nonce.size() != kNonceBytes ||
                          !same_digest(mac, handshake_mac(secret, kClientRole, c.nonce, client_nonce)))) {
    ++rejected;
    c.closing = true;
    notice(Refusal::kHandshake, "refused the connection from " + c.peer + ": it did not prove the job's secret");
    reply(c, Writer(uint8_t(Status::kError))
                 .str(mac.empty() ? "requires the job's secret, which this process was not given"
                                  : "refused this process: its job secret is not the job's"));
    return !c.out.empty();  // closed once the answer is sent
  }
  if (authed_count >= limits.max_connections) {
    c.closing = true;
    const std::string full = "serves " + std::to_string(authed_count) + " connections, its limit";
    notice(Refusal::kFull, "refused the connection from " + c.peer + ": it " + full);
    reply(c, Writer(uint8_t(Status::kError)).str(full).i64(1));  // 1: the client retries
    return !c.out.empty();
  }
  leave_handshake(c);
  c.authed = true;
  ++authed_count;
  reply(c, Writer(uint8_t(Status::kOk))
               .blob(secret.empty() ? Bytes{} : handshake_mac(secret, kServerRole, c.nonce, client_nonce)));
  return !c.doomed;
}

void StoreServer::Impl::recharge(Connection& c) {
  if (c.doomed) return;  // uncharged when doomed: its buffers go within this round
  const size_t now_held = c.in.capacity() + c.out.capacity();
  buffered = buffered - c.charged + now_held;
  c.charged = now_held;
}

void StoreServer::Impl::doom(Connection& c) {
  if (c.doomed) return;
  std::vector<uint8_t>().swap(c.out);  // `in` may be being read: it goes with the connection
  buffered -= c.charged;
  c.charged = 0;
  c.doomed = true;
  c.closing = true;
  doomed.push_back(c.fd);
}

void StoreServer::Impl::shed() {
  while (over_budget()) {
    Connection* largest = nullptr;
    for (auto& kv : conns)
      if (!kv.second.doomed && (!largest || kv.second.charged > largest->charged)) largest = &kv.second;
    if (!largest || largest->charged == 0) return;  // the keys alone: put() refuses more
    notice(Refusal::kMemory, "dropped the connection from " + largest->peer + ", whose " +
                                 std::to_string(largest->charged >> 10) +
                                 " KiB of queued replies and unfinished requests were the most of any: the store "
                                 "was past its memory budget of " +
                                 std::to_string(limits.memory_budget >> 20) + " MiB");
    doom(*largest);
  }
}

void StoreServer::Impl::notice(Refusal kind, const std::string& line) {
  const auto k = static_cast<size_t>(kind);
  const auto now = Clock::now();
  if (noticed[k] != Clock::time_point{} && now - noticed[k] < kNoticeEvery) {
    ++unsaid[k];
    return;
  }
  const std::string more =
      unsaid[k] == 0 ? "" : " (and " + std::to_string(unsaid[k]) + " more like it since the last such line)";
  std::fprintf(stderr, "dtrain: the store at %s %s%s\n", where().c_str(), line.c_str(), more.c_str());
  noticed[k] = now;
  unsaid[k] = 0;
}

}  // namespace dtrain::store
