// The store against a peer on the cluster network without the job secret, acting as an attacker
// would (Note [Store budgets]): idle connections that hold every slot, junk before the handshake,
// pipelined floods, and clients that make the store hold memory. Each attack runs against a real
// server on 127.0.0.1, bounded in count and time, and checks what a client with the secret still
// gets: it connects and is greeted within 0.1 s.
#include <gtest/gtest.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <deque>
#include <fstream>
#include <functional>
#include <iterator>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "matchers.h"
#include "sanitizer.h"
#include "store/auth.h"
#include "store/protocol.h"
#include "store/store.h"
#include "store_raw.h"
#include "time_scale.h"

using namespace dtrain::store;
using namespace std::chrono_literals;
using namespace store_test;
using detail::Op;
using detail::Writer;
using dtrain::test_util::kTimeScale;
using dtrain::test_util::scaled;
using ::testing::HasSubstr;

namespace {

using Clock = std::chrono::steady_clock;

constexpr Millis kConnect{5000};
const std::string kJobSecret(40, 'j');
constexpr auto kGreeting = 100ms;  // what a client with the secret waits for its greeting, at most

// Seconds a client with `secret` takes to connect, be greeted and prove the secret; a client that
// fails records its error in *error.
double seconds_to_join(uint16_t port, const std::string& secret, std::string* error) {
  const auto t0 = Clock::now();
  *error = error_of([&] {
    StoreClient c("127.0.0.1", port, kConnect, secret);
    c.num_keys();
  });
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// Bytes `raw` receives until the server closes it or `within` passes.
size_t bytes_until_closed(const Raw& raw, Millis within) {
  const auto end = Clock::now() + within;
  size_t got = 0;
  uint8_t buf[4096];
  while (Clock::now() < end) {
    pollfd p{raw.fd, POLLIN, 0};
    if (poll(&p, 1, 20) <= 0) continue;
    const ssize_t n = recv(raw.fd, buf, sizeof buf, 0);
    if (n <= 0) break;
    got += static_cast<size_t>(n);
  }
  return got;
}

// Whether the server closed `raw` (what it sent before is read and dropped), without waiting.
bool closed_now(const Raw& raw) {
  uint8_t buf[4096];
  for (;;) {
    const ssize_t n = recv(raw.fd, buf, sizeof buf, MSG_DONTWAIT);
    if (n == 0) return true;
    if (n < 0) return errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR;
  }
}

size_t count_lines(const std::string& text, const std::string& with) {
  size_t n = 0, from = 0;
  for (size_t eol; (eol = text.find('\n', from)) != std::string::npos; from = eol + 1)
    if (text.substr(from, eol - from).find(with) != std::string::npos) ++n;
  return n;
}

// Finding: connections that had not proved the secret counted toward the store's connection cap
// until their handshake timeout, so whoever held `cap` idle sockets kept every launcher and rank out.
TEST(StoreHostile, IdleConnectionsWithoutTheSecretDoNotKeepTheJobOut) {
  ServerLimits limits;
  limits.max_connections = 8;
  StoreServer server("127.0.0.1", 0, kJobSecret, limits);
  StoreClient member("127.0.0.1", server.port(), kConnect, kJobSecret);
  std::vector<std::unique_ptr<Raw>> idle;
  // From another host, past every budget, and from the job's own address past its per-peer one.
  for (int i = 0; i < 150; ++i) idle.push_back(std::make_unique<Raw>(server.port(), "127.0.0.2"));
  for (int i = 0; i < 40; ++i) idle.push_back(std::make_unique<Raw>(server.port()));
  std::this_thread::sleep_for(200ms);
  // The connections in the handshake have their own budget, 64 in all and 16 from one address:
  // the oldest were closed, so that the idle ones hold no more descriptors than that.
  EXPECT_LE(server.connections(), 1u + 64u);
  const auto local_closed = std::count_if(idle.end() - 40, idle.end(), [](const auto& r) { return closed_now(*r); });
  EXPECT_GE(local_closed, 40 - 16) << "from the job's own address";
  for (int i = 0; i < 10; ++i) {  // more members than the cap's free slots: each leaves before the next
    std::string error;
    const double took = seconds_to_join(server.port(), kJobSecret, &error);
    EXPECT_EQ(error, "") << "member " << i;
    EXPECT_LT(took, scaled(kGreeting).count()) << "member " << i << " waited " << took << " s to join";
  }
  member.set("k", to_bytes("v"));
  EXPECT_EQ(member.num_keys(), 1);
  EXPECT_GT(server.rejected_connections(), 100u) << "the idle connections were closed and counted";
}

// Finding: a truncated AUTH frame (length 1, the AUTH opcode) was answered with an ERROR and the
// connection stayed open, so a few connections sending 5-byte frames kept the store's thread busy
// for seconds and delayed every greeting.
TEST(StoreHostile, JunkBeforeTheHandshakeGetsNoReplyAndNoTime) {
  StoreServer server("127.0.0.1", 0, kJobSecret);
  std::atomic<bool> stop{false};
  std::atomic<size_t> answered{0}, attempts{0};
  std::vector<uint8_t> junk;
  for (int i = 0; i < 1000; ++i) junk.insert(junk.end(), {1, 0, 0, 0, uint8_t(Op::kAuth)});
  std::vector<std::thread> attackers;
  for (int t = 0; t < 8; ++t)
    attackers.emplace_back([&] {
      while (!stop) {
        Raw raw(server.port());
        if (raw.read_frame().empty()) continue;  // its greeting
        raw.send_bytes(junk);
        answered += bytes_until_closed(raw, 1000ms);
        ++attempts;
      }
    });
  double slowest = 0;
  for (auto end = Clock::now() + 1s; Clock::now() < end;) {
    std::string error;
    slowest = std::max(slowest, seconds_to_join(server.port(), kJobSecret, &error));
    EXPECT_EQ(error, "");
    std::this_thread::sleep_for(20ms);
  }
  stop = true;
  for (auto& t : attackers) t.join();
  std::string error;
  const double after = seconds_to_join(server.port(), kJobSecret, &error);
  EXPECT_EQ(error, "");
  EXPECT_EQ(answered.load(), 0u) << "junk before the handshake was answered";
  EXPECT_GT(attempts.load(), 8u);
  EXPECT_LT(slowest, scaled(kGreeting).count()) << "a member waited " << slowest << " s under the attack";
  EXPECT_LT(after, scaled(kGreeting).count()) << "a member waited " << after << " s after the attack";
}

// The handshake is read as one frame alone (Note [Store budgets]): a request a peer pipelines in the
// same write behind a wrong proof is never read, so it never runs. On an open store the same bytes do
// run it, which shows the probe can see a request that ran.
TEST(StoreHostile, ARequestPipelinedBehindAWrongProofNeverRuns) {
  auto behind_a_proof = [](uint16_t port) {
    Raw raw(port);
    const auto nonce = raw.hello_nonce();
    std::vector<uint8_t> bytes = auth_frame(std::vector<uint8_t>(nonce.size(), 7), std::vector<uint8_t>(32, 0));
    const auto set = Writer(uint8_t(Op::kSet)).str("planted").blob({1, 2, 3}).frame();
    bytes.insert(bytes.end(), set.begin(), set.end());
    raw.send_bytes(bytes);
    bytes_until_closed(raw, 1000ms);
  };
  {
    StoreServer server("127.0.0.1", 0, kJobSecret);
    behind_a_proof(server.port());
    StoreClient member("127.0.0.1", server.port(), kConnect, kJobSecret);
    EXPECT_FALSE(member.check({"planted"})) << "a request behind a wrong proof ran";
  }
  {
    StoreServer server("127.0.0.1", 0);
    behind_a_proof(server.port());
    StoreClient anyone("127.0.0.1", server.port(), kConnect);
    EXPECT_TRUE(anyone.check({"planted"})) << "the probe cannot see a request that ran";
  }
}

// A client (on an open store, anyone) that pipelines tiny requests as fast as it can: each poll round
// handles a bounded number of them, so another client is answered within one round, not one batch.
TEST(StoreHostile, APipeliningClientDoesNotStarveTheOthers) {
  StoreServer server("127.0.0.1", 0);
  StoreClient good("127.0.0.1", server.port(), kConnect);
  Raw flood(server.port());
  flood.send_bytes(auth_frame({}, {}));
  std::vector<uint8_t> frames;
  for (int i = 0; i < 200000; ++i) frames.insert(frames.end(), {1, 0, 0, 0, uint8_t(Op::kNumKeys)});
  std::atomic<bool> stop{false};
  std::thread writer([&] {
    while (!stop) flood.send_bytes(frames);
  });
  std::thread reader([&] {  // reads every reply: never throttled by the replies it leaves unread
    uint8_t buf[65536];
    while (!stop) {
      pollfd p{flood.fd, POLLIN, 0};
      if (poll(&p, 1, 20) > 0 && recv(flood.fd, buf, sizeof buf, 0) <= 0) break;
    }
  });
  std::this_thread::sleep_for(100ms);
  double slowest = 0;
  int served = 0;
  for (auto end = Clock::now() + 1s; Clock::now() < end; ++served) {
    const auto t0 = Clock::now();
    good.num_keys();
    slowest = std::max(slowest, std::chrono::duration<double>(Clock::now() - t0).count());
  }
  stop = true;
  shutdown(flood.fd, SHUT_RDWR);
  writer.join();
  reader.join();
  EXPECT_GT(served, 10);
  EXPECT_LT(slowest, scaled(kGreeting).count()) << "a request waited " << slowest << " s behind the flood";
}

// Finding: on an open store every connection could make the server hold its unread replies (8 MiB
// and a reply) and a partial frame (up to 128 MiB), so 6 clients added hundreds of MiB, linearly to
// the connection cap. Now they share one memory budget, and whoever holds the most goes first.
TEST(StoreLimits, TheMemoryBudgetHoldsAcrossConnections) {
  ServerLimits limits;
  limits.memory_budget = 48 << 20;
  StoreServer server("127.0.0.1", 0, "", limits);
  StoreClient good("127.0.0.1", server.port(), kConnect);
  good.set("big", Bytes(8 << 20, 1));
  std::vector<uint8_t> gets = auth_frame({}, {});
  for (int i = 0; i < 20; ++i) {
    const auto f = Writer(uint8_t(Op::kGet)).str("big").i64(0).frame();
    gets.insert(gets.end(), f.begin(), f.end());
  }
  std::vector<uint8_t> partial = auth_frame({}, {});
  const uint32_t announced = 100 << 20;  // a SET of 100 MiB, of which 24 MiB are sent
  partial.insert(partial.end(), {uint8_t(announced), uint8_t(announced >> 8), uint8_t(announced >> 16),
                                 uint8_t(announced >> 24), uint8_t(Op::kSet)});
  partial.resize(partial.size() + (24 << 20), 7);
  testing::internal::CaptureStderr();
  const double before = rss_mib();
  std::vector<std::unique_ptr<Raw>> clients;
  std::vector<std::thread> senders;
  for (int i = 0; i < 12; ++i) {
    clients.push_back(std::make_unique<Raw>(server.port()));
    int rcvbuf = 4096;
    setsockopt(clients.back()->fd, SOL_SOCKET, SO_RCVBUF, &rcvbuf, sizeof rcvbuf);
    senders.emplace_back([&raw = *clients.back(), &bytes = i % 2 ? gets : partial] { raw.send_bytes(bytes); });
  }
  size_t peak_held = 0, peak_connections = 0;
  double peak_rss = 0;
  bool dropped = false;  // a connection closed after all 13 were open: the store dropped one
  // 1.5 s of attack, longer until the store has dropped one (under ThreadSanitizer it got there
  // after the 1.5 s once, and its line came after the capture had ended).
  const auto start = Clock::now();
  while (Clock::now() < start + 1500ms || (!dropped && Clock::now() < start + scaled(1500ms))) {
    peak_held = std::max(peak_held, server.held_bytes());
    peak_rss = std::max(peak_rss, rss_mib() - before);
    peak_connections = std::max(peak_connections, server.connections());
    dropped = dropped || (peak_connections == clients.size() + 1 && server.connections() <= clients.size());
    std::this_thread::sleep_for(20ms);
  }
  for (auto& c : clients) shutdown(c->fd, SHUT_RDWR);  // a sender still blocked returns
  for (auto& t : senders) t.join();
  const std::string err = testing::internal::GetCapturedStderr();
  EXPECT_LE(peak_held, limits.memory_budget) << "the store held " << (peak_held >> 20) << " MiB";
  // The accounted bytes are the budget (above, exactly); the process also keeps what the allocator
  // has not given back and a reply's copy while it is made: under 4 times the budget (152 MiB was
  // seen once with a compiler running beside the test, 3 times is too tight), where the same attack
  // without one grows by 240 MiB and more. ThreadSanitizer's shadow pages (several hundred MiB
  // whatever the store holds) leave resident memory nothing to say there: the accounted bytes do.
#if !defined(DTRAIN_TEST_TSAN)
  EXPECT_LT(peak_rss, 4 * 48 + kQuarantineMiB) << "the store grew by " << peak_rss << " MiB";
#endif
  EXPECT_THAT(err, HasSubstr("past its memory budget of 48 MiB")) << err;
  EXPECT_THAT(err, HasSubstr("dropped the connection from 127.0.0.1:")) << err;
  EXPECT_EQ(to_string(good.get("big", 1000ms)).size(), size_t{8} << 20);
  std::string error;
  const double took = seconds_to_join(server.port(), "", &error);
  EXPECT_EQ(error, "");
  EXPECT_LT(took, scaled(kGreeting).count());
}

// Finding: a reply nobody reads was kept forever. Now it has a deadline.
TEST(StoreLimits, AReplyNobodyReadsHasADeadline) {
  ServerLimits limits;
  limits.unread_reply_timeout = 300ms;
  StoreServer server("127.0.0.1", 0, "", limits);
  StoreClient good("127.0.0.1", server.port(), kConnect);
  good.set("big", Bytes(4 << 20, 1));
  Raw greedy(server.port());
  int rcvbuf = 4096;
  setsockopt(greedy.fd, SOL_SOCKET, SO_RCVBUF, &rcvbuf, sizeof rcvbuf);
  std::vector<uint8_t> gets = auth_frame({}, {});
  for (int i = 0; i < 3; ++i) {
    const auto f = Writer(uint8_t(Op::kGet)).str("big").i64(0).frame();
    gets.insert(gets.end(), f.begin(), f.end());
  }
  const auto sent = Clock::now();
  greedy.send_bytes(gets);
  const auto deadline = Clock::now() + 5s;
  while (server.held_bytes() < (size_t{8} << 20) && Clock::now() < deadline) std::this_thread::sleep_for(1ms);
  ASSERT_GE(server.held_bytes(), size_t{8} << 20) << "the replies were never queued";
  while (server.connections() > 1 && Clock::now() < deadline) std::this_thread::sleep_for(10ms);
  EXPECT_EQ(server.connections(), 1u) << "the connection that reads no reply is still open";
  EXPECT_GE(Clock::now() - sent, 300ms) << "dropped before its deadline";
  good.num_keys();  // one more round: held_bytes is that of the round after the drop
  EXPECT_LT(server.held_bytes(), size_t{5} << 20) << "the store still holds the unread replies";
}

// A burst of real clients larger than the handshake budget (a job's ranks starting at once): the
// store leaves the newcomers in the listen backlog while the connections in the handshake are young,
// instead of closing them for newer ones that would be closed in turn.
TEST(StoreLimits, ABurstOfClientsIsNotChurnedByTheHandshakeBudget) {
  ServerLimits limits;
  limits.max_unauthenticated = 2;
  StoreServer server("127.0.0.1", 0, kJobSecret, limits);
  std::atomic<int> joined{0};
  std::vector<std::thread> clients;
  for (int i = 0; i < 10; ++i)
    clients.emplace_back([&] {
      std::string error;
      seconds_to_join(server.port(), kJobSecret, &error);
      joined += error.empty() ? 1 : 0;
    });
  for (auto& t : clients) t.join();
  EXPECT_EQ(joined.load(), 10);
  // Closing a connection in the handshake for a newer one is for connections that sat idle for
  // 50 ms: a client answers its greeting within a round trip (a few may be slower on a busy machine).
  EXPECT_LT(server.rejected_connections(), 4u);
}

// Node 0 names the peer while it refuses, one line per kind of refusal (10 s apart at most),
// instead of saying nothing until the job ends.
TEST(StoreHostile, NodeZeroNamesThePeerOncePerKindOfRefusal) {
  testing::internal::CaptureStderr();
  {
    StoreServer server("127.0.0.1", 0, kJobSecret);
    for (int i = 0; i < 20; ++i) {
      Raw junk(server.port());
      junk.send_bytes({1, 0, 0, 0, uint8_t(Op::kAuth)});
      EXPECT_TRUE(junk.closed_within(2000ms));
    }
    std::vector<std::unique_ptr<Raw>> idle;
    for (int i = 0; i < 40; ++i) idle.push_back(std::make_unique<Raw>(server.port()));
    // The 24 past the address's budget are closed once out of their 50 ms of grace.
    EXPECT_TRUE(idle.front()->closed_within(2000ms));
    std::string error;
    seconds_to_join(server.port(), kJobSecret, &error);  // a round trip: every eviction was made
    EXPECT_EQ(error, "");
  }
  const std::string err = testing::internal::GetCapturedStderr();
  EXPECT_EQ(count_lines(err, "is not a well-formed handshake"), 1u) << err;
  EXPECT_EQ(count_lines(err, "still without the handshake"), 1u) << err;
  EXPECT_EQ(count_lines(err, "dtrain: the store at"), 2u) << err;
  EXPECT_EQ(count_lines(err, "from 127.0.0.1:"), 2u) << err;
}

// Finding: a newcomer from a connection's own address closed the oldest one in the handshake at
// once, however young, so a local process that opened connections from 127.0.0.1 in a loop closed
// the job's own clients there while their answer to the greeting was on its way (they retried
// every 75 ms and got through only by luck). A connection now has kEvictAfter (50 ms) to answer.
TEST(StoreHostile, AFloodFromTheJobsOwnAddressDoesNotCloseItsClientsInTheHandshake) {
  StoreServer server("127.0.0.1", 0, kJobSecret);
  std::atomic<bool> stop{false};
  std::atomic<size_t> greeted{0};  // the attacker's connections the store accepted
  std::vector<std::deque<std::unique_ptr<Raw>>> held(2);
  std::vector<std::thread> attackers;
  for (size_t t = 0; t < held.size(); ++t)
    attackers.emplace_back([&, t] {  // each holds its newest connections, never answers a greeting
      auto& mine = held[t];
      while (!stop) {
        mine.push_back(std::make_unique<Raw>(server.port()));
        if (mine.back()->read_frame().empty()) continue;
        ++greeted;
        if (mine.size() > 128) mine.pop_front();
      }
    });
  std::this_thread::sleep_for(200ms);  // the address's slots are full of the attacker's
  int in_grace = 0, first_try = 0;
  double slowest = 0;
  constexpr int kClients = 20;
  for (int i = 0; i < kClients; ++i) {
    const auto t0 = Clock::now();
    Raw client(server.port());
    const auto nonce = client.hello_nonce();
    const auto hello_at = Clock::now();
    slowest = std::max(slowest, std::chrono::duration<double>(hello_at - t0).count());
    // A client on a busy node answers within milliseconds, not within the microseconds the flood
    // needs: here once 48 more of the attacker's connections were greeted (2 to 20 ms after its own).
    const size_t before = greeted;
    while (Clock::now() < hello_at + 20ms && (Clock::now() < hello_at + 2ms || greeted < before + 48))
      std::this_thread::sleep_for(1ms);
    // Within the grace (its connect began 40 ms ago at most): it must not have been closed. A
    // client this machine's load made slower may have been, as past the grace.
    const bool prompt = Clock::now() - t0 < 40ms;
    const std::vector<uint8_t> mine(detail::kNonceBytes, uint8_t(i));
    client.send_bytes(auth_frame(mine, detail::handshake_mac(kJobSecret, detail::kClientRole, nonce, mine)));
    const auto answer = client.read_frame();
    const bool joined = !nonce.empty() && !answer.empty() && answer[0] == uint8_t(detail::Status::kOk);
    in_grace += prompt ? 1 : 0;
    first_try += prompt && joined ? 1 : 0;
  }
  stop = true;
  for (auto& t : attackers) t.join();
  EXPECT_GT(greeted.load(), 1000u) << "the attacker opened too few connections to fill the address's slots";
  EXPECT_GE(in_grace, kClients / 2) << "too few clients answered within the grace on this machine to tell";
  EXPECT_EQ(first_try, in_grace) << "clients that answered within the grace were closed by the flood";
  EXPECT_LT(slowest, scaled(kGreeting).count()) << "a client waited " << slowest << " s for its greeting";
  // The flood holds no more than its address's budget once its connections are out of their grace.
  std::this_thread::sleep_for(200ms);
  EXPECT_LE(server.connections(), 16u);
  size_t open = 0;
  for (auto& mine : held)
    open += std::count_if(mine.begin(), mine.end(), [](const auto& r) { return !closed_now(*r); });
  EXPECT_LE(open, 16u);
}

// A store in a process of its own: the CPU time it spends serving what others send is its own.
struct StoreProcess {
  pid_t pid = -1;
  int stop_fd = -1;  // the child exits when this closes
  uint16_t port = 0;
  explicit StoreProcess(const std::string& secret) {
    int port_pipe[2], stop_pipe[2];
    if (pipe(port_pipe) != 0 || pipe(stop_pipe) != 0) ADD_FAILURE() << "pipe failed";
    pid = fork();
    if (pid == 0) {
      close(port_pipe[0]);
      close(stop_pipe[1]);
      StoreServer server("127.0.0.1", 0, secret);
      const uint16_t p = server.port();
      (void)!write(port_pipe[1], &p, sizeof p);
      char b;
      (void)!read(stop_pipe[0], &b, 1);
      _exit(0);
    }
    close(port_pipe[1]);
    close(stop_pipe[0]);
    stop_fd = stop_pipe[1];
    if (read(port_pipe[0], &port, sizeof port) != sizeof port) ADD_FAILURE() << "the store process did not start";
    close(port_pipe[0]);
  }
  ~StoreProcess() {
    close(stop_fd);
    waitpid(pid, nullptr, 0);
  }
  // User and system CPU seconds it has used (/proc/PID/stat).
  double cpu_seconds() const {
    std::ifstream f("/proc/" + std::to_string(pid) + "/stat");
    std::string stat((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    std::istringstream rest(stat.substr(stat.rfind(')') + 2));  // after "pid (comm) "
    std::string field;
    double ticks = 0;
    for (int i = 3; i <= 15 && rest >> field; ++i)
      if (i >= 14) ticks += std::stod(field);  // utime, stime
    return ticks / static_cast<double>(sysconf(_SC_CLK_TCK));
  }
};

struct CpuUnderAttack {
  double cpu_s = 0;         // the store's, over the attack
  size_t units = 0;         // connections or requests the attackers made
  double slowest_join = 0;  // of a client with the secret during the attack
};

// Runs `attack(port, stop)` on 8 threads for 3 s against a store process; a client joins every 100 ms.
CpuUnderAttack store_cpu_under(const std::string& secret,
                               const std::function<size_t(uint16_t, const std::atomic<bool>&)>& attack) {
  StoreProcess store(secret);
  CpuUnderAttack r;
  std::atomic<bool> stop{false};
  std::atomic<size_t> units{0};
  const double cpu0 = store.cpu_seconds();
  std::vector<std::thread> attackers;
  for (int t = 0; t < 8; ++t) attackers.emplace_back([&] { units += attack(store.port, stop); });
  for (auto end = Clock::now() + 3s; Clock::now() < end;) {
    std::string error;
    r.slowest_join = std::max(r.slowest_join, seconds_to_join(store.port, secret, &error));
    EXPECT_EQ(error, "");
    std::this_thread::sleep_for(100ms);
  }
  stop = true;
  for (auto& t : attackers) t.join();
  r.cpu_s = store.cpu_seconds() - cpu0;
  r.units = units;
  return r;
}

// Finding: 8 connections sending 5-byte frames (a truncated AUTH, answered and left open) for 3 s
// cost the store 6.4 s of CPU. Now the first such frame closes the connection unanswered: the
// attacker pays a connect for each, and the store's time is per connection. On an open store the
// same frames, once past the empty AUTH, are requests (NUM_KEYS): served, kFramesPerRound a turn.
// docs/benchmarks.md has the numbers this prints.
TEST(StoreHostile, FiveByteFramesFromEightConnectionsCostTheStoreLittleCpu) {
  std::vector<uint8_t> junk;
  for (int i = 0; i < 4096; ++i) junk.insert(junk.end(), {1, 0, 0, 0, uint8_t(Op::kAuth)});
  const auto closed = store_cpu_under(kJobSecret, [&](uint16_t port, const std::atomic<bool>& stop) {
    size_t n = 0;
    for (; !stop; ++n) {
      Raw r(port);
      r.send_bytes(junk);
      r.closed_within(1000ms);
    }
    return n;
  });
  std::vector<uint8_t> requests;
  for (int i = 0; i < 4096; ++i) requests.insert(requests.end(), {1, 0, 0, 0, uint8_t(Op::kNumKeys)});
  const auto served = store_cpu_under("", [&](uint16_t port, const std::atomic<bool>& stop) {
    Raw r(port);
    r.read_frame();
    r.send_bytes(auth_frame({}, {}));
    r.read_frame();
    size_t n = 0;
    uint8_t buf[65536];
    while (!stop) {  // as fast as the replies come back: the store's pace, not the socket buffer's
      r.send_bytes(requests);
      n += 4096;
      for (size_t got = 0; got < 4096 * 17 && !stop;) {
        pollfd p{r.fd, POLLIN, 0};
        if (poll(&p, 1, 100) <= 0) continue;
        const ssize_t k = recv(r.fd, buf, sizeof buf, 0);
        if (k <= 0) return n;
        got += static_cast<size_t>(k);
      }
    }
    return n;
  });
  std::printf("junk before the handshake: store CPU %.2f s for %zu connections (%.1f us each), slowest join %.3f s\n",
              closed.cpu_s, closed.units, 1e6 * closed.cpu_s / std::max<size_t>(closed.units, 1), closed.slowest_join);
  std::printf("requests on an open store: store CPU %.2f s for %zu requests (%.2f us each), slowest join %.3f s\n",
              served.cpu_s, served.units, 1e6 * served.cpu_s / std::max<size_t>(served.units, 1), served.slowest_join);
  // Loosely: what an attacker's connection or request costs the store, and what a client waits. The
  // store's CPU grows under a sanitizer as its elapsed time does (108 us a junk connection under
  // ThreadSanitizer, 12-20 in the normal build), so both bounds take the time scale.
  EXPECT_LT(1e6 * closed.cpu_s / std::max<size_t>(closed.units, 1), 100.0 * kTimeScale)
      << "us of store CPU a junk connection";
  EXPECT_LT(1e6 * served.cpu_s / std::max<size_t>(served.units, 1), 20.0 * kTimeScale) << "us of store CPU a request";
  EXPECT_LT(closed.slowest_join, 5 * scaled(kGreeting).count());  // 3-7 ms, 0.24 s once under a load of 6
  EXPECT_LT(served.slowest_join, 5 * scaled(kGreeting).count());
}

}  // namespace
