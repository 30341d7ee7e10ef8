// The store against clients that are not the job's or that misbehave (src/store): the job secret's
// handshake, limits in size, count and time, back-pressure, a server stopped under a client, and a
// hostile client sending random frames while a well-behaved one keeps being served.
#include <arpa/inet.h>
#include <fcntl.h>
#include <pthread.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <fstream>
#include <iterator>
#include <random>
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
using detail::Op;
using detail::Status;
using detail::Writer;
using ::testing::AnyOf;
using ::testing::HasSubstr;
using namespace store_test;

namespace {

constexpr Millis kConnect{5000};
const std::string kSecret(40, 's');
const std::string kOther(40, 'o');

// What a ForkedServer's process may use.
struct ChildLimits {
  int max_files = 0;         // RLIMIT_NOFILE; 0: inherited
  size_t thread_stack = 0;   // the server thread's stack, in bytes; 0: the default (8 MiB)
  size_t memory_margin = 0;  // RLIMIT_AS: what the process maps once serving, plus this; 0: none
  std::string stderr_path;   // where the child's stderr goes; "": inherited
};

// Bytes of address space this process maps now.
size_t mapped_bytes() {
  std::ifstream f("/proc/self/statm");
  size_t pages = 0;
  f >> pages;
  return pages * static_cast<size_t>(sysconf(_SC_PAGESIZE));
}

// A StoreServer in a child process (to stop it, or to limit its descriptors, stack or memory);
// killed when this goes.
struct ForkedServer {
  pid_t pid = -1;
  uint16_t port = 0;
  explicit ForkedServer(ChildLimits child = {}, ServerLimits limits = {}) {
    int fds[2];
    if (pipe(fds) != 0) ADD_FAILURE() << "pipe failed";
    pid = fork();
    if (pid == 0) {
      if (!child.stderr_path.empty()) {
        const int fd = open(child.stderr_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
        dup2(fd, STDERR_FILENO);
      }
      if (child.max_files > 0) {
        rlimit r{rlim_t(child.max_files), rlim_t(child.max_files)};
        setrlimit(RLIMIT_NOFILE, &r);
      }
      if (child.thread_stack > 0) {  // the default of threads made from now on: the server's
        pthread_attr_t a;
        pthread_attr_init(&a);
        pthread_attr_setstacksize(&a, child.thread_stack);
        pthread_setattr_default_np(&a);
      }
      StoreServer server("127.0.0.1", 0, "", limits);
      if (child.memory_margin > 0) {
        const rlim_t cap = mapped_bytes() + child.memory_margin;
        rlimit r{cap, cap};
        setrlimit(RLIMIT_AS, &r);
      }
      const uint16_t p = server.port();
      (void)!write(fds[1], &p, sizeof p);
      pause();
      _exit(0);
    }
    if (read(fds[0], &port, sizeof port) != static_cast<ssize_t>(sizeof port)) ADD_FAILURE() << "no port";
    close(fds[0]);
    close(fds[1]);
  }
  ~ForkedServer() {
    kill(pid, SIGKILL);
    waitpid(pid, nullptr, 0);
  }
};

// ---- The job secret ------------------------------------------------------------------------------

TEST(StoreSecret, OnlyAClientWithTheSecretIsServed) {
  StoreServer server("127.0.0.1", 0, kSecret);
  StoreClient job("127.0.0.1", server.port(), kConnect, kSecret);
  job.set("k", to_bytes("v"));

  // No secret: one line on the joining side, naming what is missing and the remedy.
  const std::string none = error_of([&] { StoreClient("127.0.0.1", server.port(), kConnect); });
  EXPECT_THAT(none, HasSubstr("requires the job's secret")) << none;
  EXPECT_THAT(none, HasSubstr("DTRAIN_JOB_SECRET")) << none;
  // A wrong secret.
  const std::string wrong = error_of([&] { StoreClient("127.0.0.1", server.port(), kConnect, kOther); });
  EXPECT_THAT(wrong, HasSubstr("its job secret is not the job's")) << wrong;
  EXPECT_EQ(std::count(wrong.begin(), wrong.end(), '\n'), 0) << wrong;
  // A raw connection that skips the handshake and sends a SET: closed, nothing written.
  {
    Raw raw(server.port());
    raw.send_bytes(Writer(uint8_t(Op::kSet)).str("intruder").blob(to_bytes("x")).frame());
    EXPECT_TRUE(raw.closed_within(2000ms));
  }
  // A raw connection that sends a made-up digest.
  {
    Raw raw(server.port());
    raw.send_bytes(auth_frame(std::vector<uint8_t>(32, 1), std::vector<uint8_t>(32, 2)));
    raw.send_bytes(Writer(uint8_t(Op::kSet)).str("intruder").blob(to_bytes("x")).frame());
    EXPECT_TRUE(raw.closed_within(2000ms));
  }
  EXPECT_EQ(server.rejected_connections(), 4u);
  // The job goes on, and nobody else wrote.
  EXPECT_EQ(to_string(job.get("k", 1000ms)), "v");
  EXPECT_FALSE(job.check({"intruder"}));
  EXPECT_EQ(job.num_keys(), 1);
}

TEST(StoreSecret, AClientWithASecretRefusesAStoreThatCannotProveIt) {
  StoreServer open("127.0.0.1", 0);
  const std::string msg = error_of([&] { StoreClient("127.0.0.1", open.port(), kConnect, kSecret); });
  EXPECT_THAT(msg, HasSubstr("asks for no job secret, so it is not this job's store")) << msg;
  // An open store still serves clients without a secret, as PyTorch's TCPStore does.
  StoreClient c("127.0.0.1", open.port(), kConnect);
  c.set("a", to_bytes("1"));
  EXPECT_EQ(c.num_keys(), 1);
}

// A squatter on the port that asks for a secret but cannot prove it knows it (it answers a made-up
// digest): the client refuses it, so a launcher never joins another job's store.
TEST(StoreSecret, AStoreThatAnswersAWrongProofIsRefused) {
  const int ls = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(bind(ls, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
  ASSERT_EQ(listen(ls, 4), 0);
  socklen_t len = sizeof a;
  getsockname(ls, reinterpret_cast<sockaddr*>(&a), &len);
  std::thread squatter([ls] {
    const int fd = accept(ls, nullptr, nullptr);
    const auto hello =
        Writer(uint8_t(Status::kOk)).str(detail::kMagic).i64(1).blob(std::vector<uint8_t>(32, 7)).frame();
    (void)!send(fd, hello.data(), hello.size(), MSG_NOSIGNAL);
    uint8_t buf[512];
    (void)!recv(fd, buf, sizeof buf, 0);  // the client's AUTH
    const auto ok = Writer(uint8_t(Status::kOk)).blob(std::vector<uint8_t>(32, 9)).frame();
    (void)!send(fd, ok.data(), ok.size(), MSG_NOSIGNAL);
    uint8_t one;
    (void)!recv(fd, &one, 1, 0);  // until the client closes
    close(fd);
  });
  const std::string msg = error_of([&] { StoreClient("127.0.0.1", ntohs(a.sin_port), kConnect, kSecret); });
  squatter.join();
  close(ls);
  EXPECT_THAT(msg, HasSubstr("did not prove it knows this job's secret")) << msg;
}

// A proof recorded on one connection is worth nothing on another: each HELLO carries a fresh nonce,
// and the proof covers it, so an eavesdropper that replays a job member's AUTH is refused.
TEST(StoreSecret, AReplayedProofIsRefused) {
  StoreServer server("127.0.0.1", 0, kSecret);
  StoreClient job("127.0.0.1", server.port(), kConnect, kSecret);
  const std::vector<uint8_t> client_nonce(32, 5);
  Raw first(server.port());
  const auto nonce1 = first.hello_nonce();
  ASSERT_EQ(nonce1.size(), 32u);
  const auto recorded =
      auth_frame(client_nonce, detail::handshake_mac(kSecret, detail::kClientRole, nonce1, client_nonce));
  first.send_bytes(recorded);
  const auto answer = first.read_frame();
  ASSERT_FALSE(answer.empty());
  EXPECT_EQ(answer[0], uint8_t(Status::kOk)) << "the proof is good on the connection it was made for";
  first.send_bytes(Writer(uint8_t(Op::kSet)).str("first").blob(to_bytes("1")).frame());
  EXPECT_EQ(to_string(job.get("first", 2000ms)), "1");

  Raw second(server.port());
  const auto nonce2 = second.hello_nonce();
  EXPECT_NE(nonce1, nonce2) << "every connection gets its own nonce";
  second.send_bytes(recorded);
  second.send_bytes(Writer(uint8_t(Op::kSet)).str("replayed").blob(to_bytes("x")).frame());
  EXPECT_TRUE(second.closed_within(2000ms));
  EXPECT_EQ(server.rejected_connections(), 1u);
  EXPECT_FALSE(job.check({"replayed"}));
}

TEST(StoreSecret, AShortSecretIsRefusedInOneLine) {
  const std::string msg = error_of([] { StoreServer("127.0.0.1", 0, "short"); });
  EXPECT_THAT(msg, HasSubstr("holds 5 bytes: a job secret has at least 32")) << msg;
}

TEST(StoreSecret, AConnectionThatNeverShakesHandsIsClosedAndCounted) {
  ServerLimits limits;
  limits.handshake_timeout = 300ms;
  StoreServer server("127.0.0.1", 0, kSecret, limits);
  Raw silent(server.port());
  EXPECT_TRUE(silent.closed_within(3000ms));
  EXPECT_EQ(server.rejected_connections(), 1u);
}

// ---- Limits in size and count --------------------------------------------------------------------

TEST(StoreLimits, KeysValuesAndTheKeyCountAreCapped) {
  ServerLimits limits;
  limits.max_keys = 3;
  StoreServer server("127.0.0.1", 0, "", limits);
  StoreClient c("127.0.0.1", server.port(), kConnect);
  EXPECT_THAT(error_of([&] { c.set(std::string(detail::kMaxKeyBytes + 1, 'k'), to_bytes("v")); }),
              HasSubstr("the store takes keys of at most 8192"));
  EXPECT_THAT(error_of([&] { c.set("big", Bytes(detail::kMaxValueBytes + 1)); }),
              HasSubstr("the store takes values of at most 67108864"));
  for (const char* k : {"a", "b", "c"}) c.set(k, to_bytes("1"));
  EXPECT_THAT(error_of([&] { c.set("d", to_bytes("1")); }), HasSubstr("the store holds 3 keys, its limit"));
  EXPECT_THAT(error_of([&] { c.add("e", 1); }), HasSubstr("its limit"));
  c.set("a", to_bytes("2"));  // an existing key still changes
  EXPECT_EQ(to_string(c.get("a", 1000ms)), "2");
  EXPECT_EQ(c.num_keys(), 3);
  // A WAIT or CHECK of too many keys is refused before any is read.
  std::vector<std::string> many(detail::kMaxKeysPerRequest + 1, "x");
  EXPECT_THAT(error_of([&] { c.check(many); }), HasSubstr("the store takes 0 to 65536 in one"));
}

// A client that pipelines GETs of a large value and never reads the replies: the server stops
// reading its requests once the replies it holds pass the high-water mark (here 100 GETs of 8 MiB
// would hold 800 MiB), and keeps serving the others.
TEST(StoreLimits, RepliesThatDoNotDrainStopTheReadingNotTheServer) {
  StoreServer server("127.0.0.1", 0);
  StoreClient good("127.0.0.1", server.port(), kConnect);
  good.set("big", Bytes(8 << 20, 1));
  const double before = rss_mib();
  Raw greedy(server.port());
  int rcvbuf = 4096;
  setsockopt(greedy.fd, SOL_SOCKET, SO_RCVBUF, &rcvbuf, sizeof rcvbuf);
  greedy.send_bytes(auth_frame({}, {}));
  std::vector<uint8_t> gets;
  for (int i = 0; i < 100; ++i) {
    const auto f = Writer(uint8_t(Op::kGet)).str("big").i64(0).frame();
    gets.insert(gets.end(), f.begin(), f.end());
  }
  greedy.send_bytes(gets);
  // Measured once the server says it stopped reading the client (a server that has not read the
  // requests yet would hold nothing either): a server without the limit never says so.
  const auto deadline = std::chrono::steady_clock::now() + 20s;
  while (server.throttled_connections() == 0 && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(10ms);
  ASSERT_EQ(server.throttled_connections(), 1u) << "the server never stopped reading the client that does not read";
  const double grown = rss_mib() - before;
  EXPECT_LT(grown, 100.0 + kQuarantineMiB)
      << "the server holds " << grown << " MiB more for one client that does not read";
  good.set("k", to_bytes("v"));
  EXPECT_EQ(to_string(good.get("k", 1000ms)), "v");
}

// Past the cap, a client retries until its connect timeout, as it does a refused connect: it gets in
// once a slot frees, and else fails in one line that names the limit.
TEST(StoreLimits, ConnectionsPastTheCapAreRetriedThenRefusedInOneLine) {
  ServerLimits limits;
  limits.max_connections = 3;
  StoreServer server("127.0.0.1", 0, "", limits);
  auto a = std::make_unique<StoreClient>("127.0.0.1", server.port(), kConnect);
  StoreClient b("127.0.0.1", server.port(), kConnect), c("127.0.0.1", server.port(), kConnect);
  const std::string msg = error_of([&] { StoreClient("127.0.0.1", server.port(), 500ms); });
  EXPECT_THAT(msg, HasSubstr("within 0.5s: the store at 127.0.0.1:" + std::to_string(server.port()) +
                             " serves 3 connections, its limit"))
      << msg;
  std::thread leaves([&a] {
    std::this_thread::sleep_for(300ms);
    a.reset();
  });
  const std::string late = error_of([&] {
    StoreClient d("127.0.0.1", server.port(), kConnect);
    d.set("still", to_bytes("served"));
  });
  leaves.join();
  EXPECT_EQ(late, "") << "a client refused for the cap retries until a slot frees";
  EXPECT_TRUE(c.check({"still"}));
}

TEST(StoreLimits, AFrameThatNeverEndsIsClosed) {
  ServerLimits limits;
  limits.frame_timeout = 300ms;
  StoreServer server("127.0.0.1", 0, "", limits);
  Raw slow(server.port());
  slow.send_bytes(auth_frame({}, {}));
  slow.send_bytes({100, 0, 0, 0, uint8_t(Op::kSet)});  // 100 bytes announced, 1 sent
  EXPECT_TRUE(slow.closed_within(3000ms));
  StoreClient c("127.0.0.1", server.port(), kConnect);
  EXPECT_EQ(c.num_keys(), 0);
}

// 2000 connections, each waiting for the key the one before it sets: the server answers the whole
// chain from one SET, iteratively. Its thread runs on a 160 KiB stack (a connection's read buffer
// takes 64 KiB of it), where a recursion as deep as the chain, even of 50 bytes a level, overflows
// and kills the server.
TEST(StoreLimits, AChainOfWaitersIsAnsweredWithoutRecursion) {
#if defined(DTRAIN_TEST_ASAN)
  constexpr size_t kStack = 512 << 10;  // AddressSanitizer's redzones widen every frame
#else
  constexpr size_t kStack = 160 << 10;
#endif
  rlimit r{};
  getrlimit(RLIMIT_NOFILE, &r);
  if (r.rlim_cur < 4096 && r.rlim_max > r.rlim_cur) {
    r.rlim_cur = std::min<rlim_t>(r.rlim_max, 4096);
    setrlimit(RLIMIT_NOFILE, &r);
  }
  getrlimit(RLIMIT_NOFILE, &r);
  const int kChain = static_cast<int>(std::min<rlim_t>(2000, r.rlim_cur - 128));
  ASSERT_GE(kChain, 1000) << "raise ulimit -n: the chain needs 1000 connections to mean anything";
  ChildLimits child;
  child.thread_stack = kStack;
  ForkedServer server(child);
  std::vector<std::unique_ptr<Raw>> chain;
  for (int i = 0; i < kChain; ++i) {
    chain.push_back(std::make_unique<Raw>(server.port));
    auto f = auth_frame({}, {});
    const auto w = Writer(uint8_t(Op::kWait)).i64(0).i64(1).str("k" + std::to_string(i)).frame();
    const auto s = Writer(uint8_t(Op::kSet)).str("k" + std::to_string(i + 1)).blob(to_bytes("1")).frame();
    f.insert(f.end(), w.begin(), w.end());
    f.insert(f.end(), s.begin(), s.end());
    chain.back()->send_bytes(f);
  }
  StoreClient c("127.0.0.1", server.port, kConnect);
  std::this_thread::sleep_for(200ms);
  EXPECT_FALSE(c.check({"k1"}));
  c.set("k0", to_bytes("go"));
  c.wait({"k" + std::to_string(kChain)}, 10000ms);
  EXPECT_EQ(c.num_keys(), kChain + 1);
}

// The server thread out of memory: a 60 MiB SET into a process that may map 48 MiB more costs that
// client its connection, with one line on stderr, and the store goes on serving the others.
// AddressSanitizer and ThreadSanitizer abort on a failed allocation instead of throwing bad_alloc.
TEST(StoreLimits, OutOfMemoryDropsOneConnectionAndTheStoreGoesOn) {
#if defined(DTRAIN_TEST_SANITIZER)
  GTEST_SKIP() << "a sanitizer's allocator aborts on a failed allocation instead of throwing bad_alloc";
#endif
  char path[] = "/tmp/dtrain_store_oom_XXXXXX";
  close(mkstemp(path));
  ChildLimits child;
  child.memory_margin = 48 << 20;
  child.stderr_path = path;
  {
    ForkedServer server(child);
    StoreClient before("127.0.0.1", server.port, kConnect);
    before.set("small", to_bytes("kept"));
    StoreClient big("127.0.0.1", server.port, kConnect);
    EXPECT_THAT(error_of([&] { big.set("big", Bytes(60 << 20, 7)); }),
                AnyOf(HasSubstr("closed the connection"), HasSubstr("lost the connection")));
    StoreClient after("127.0.0.1", server.port, kConnect);
    EXPECT_EQ(to_string(after.get("small", 1000ms)), "kept");
    after.set("more", to_bytes("1"));
    EXPECT_TRUE(before.check({"more"}));
    EXPECT_FALSE(before.check({"big"}));
  }
  std::ifstream f(path);
  const std::string err((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  unlink(path);
  EXPECT_THAT(err, HasSubstr("dropped a connection it had no memory for"));
}

// ---- A server that stops answering ---------------------------------------------------------------

// The store's host stopped (SIGSTOP: the kernel still holds the connection, so keepalive cannot see
// it): a request fails at the client's deadline instead of waiting forever.
TEST(StoreDeadline, AStoppedServerIsATimeoutNotAHang) {
  ForkedServer server;
  StoreClient c("127.0.0.1", server.port, 1000ms);
  c.set("k", to_bytes("v"));
  kill(server.pid, SIGSTOP);
  int status = 0;
  ASSERT_EQ(waitpid(server.pid, &status, WUNTRACED), server.pid);  // stopped for sure
  ASSERT_TRUE(WIFSTOPPED(status));
  const auto t0 = std::chrono::steady_clock::now();
  const std::string msg = error_of([&] { c.set("k2", to_bytes("v")); });
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_THAT(msg, HasSubstr("did not answer in time")) << msg;
  EXPECT_LT(took, 5.0 * dtrain::test_util::kTimeScale);
  EXPECT_THAT(error_of([&] { c.num_keys(); }), HasSubstr("was closed after the store did not answer in time"));
}

// Out of descriptors: the server refuses what it cannot accept without spinning on poll().
TEST(StoreLimits, OutOfDescriptorsTheServerDoesNotSpin) {
  ServerLimits limits;
  limits.max_connections = 1000;  // past the descriptor limit on purpose
  ChildLimits child;
  child.max_files = 48;
  ForkedServer server(child, limits);
  std::vector<std::unique_ptr<Raw>> conns;
  for (int i = 0; i < 80; ++i) conns.push_back(std::make_unique<Raw>(server.port));
  auto cpu_ticks = [&server] {
    std::ifstream f("/proc/" + std::to_string(server.pid) + "/stat");
    std::string field;
    long ticks = 0;
    for (int i = 1; f >> field && i <= 15; ++i)
      if (i == 14 || i == 15) ticks += std::stol(field);
    return ticks;
  };
  std::this_thread::sleep_for(200ms);
  const long t0 = cpu_ticks();
  std::this_thread::sleep_for(1000ms);
  const double busy = static_cast<double>(cpu_ticks() - t0) / static_cast<double>(sysconf(_SC_CLK_TCK));
  EXPECT_LT(busy, 0.3) << "the server used " << busy << " s of CPU in 1 s at its descriptor limit";
}

// ---- A hostile client ------------------------------------------------------------------------------

// Random, truncated and oversized frames on many connections, before and after the handshake (an
// open store, so that they reach the request parser), for about two seconds: a well-behaved client
// is served throughout, and the server's memory stays bounded (sampled).
TEST(StoreHostile, RandomFramesNeitherStopTheStoreNorGrowItsMemory) {
  ServerLimits limits;
  limits.frame_timeout = 200ms;
  limits.handshake_timeout = 200ms;
  StoreServer server("127.0.0.1", 0, "", limits);
  StoreClient good("127.0.0.1", server.port(), kConnect);
  const double before = rss_mib();
  std::atomic<bool> stop{false};
  std::thread hostile([&] {
    std::mt19937 rng(12345);
    while (!stop) {
      Raw raw(server.port());
      const int kind = static_cast<int>(rng() % 4);
      std::vector<uint8_t> bytes;
      if (kind == 0) {  // random bytes
        bytes.resize(rng() % 600);
        for (auto& b : bytes) b = static_cast<uint8_t>(rng());
      } else if (kind == 1) {  // an oversized length
        const uint32_t len = 0x7fffffffu - (rng() % 1000);
        bytes = {uint8_t(len), uint8_t(len >> 8), uint8_t(len >> 16), uint8_t(len >> 24), 1};
      } else if (kind == 2) {  // a truncated AUTH
        bytes = auth_frame(std::vector<uint8_t>(32, 3), std::vector<uint8_t>(32, 4));
        bytes.resize(rng() % bytes.size());
      } else {  // the handshake, then a valid-looking request and random bytes
        bytes = auth_frame({}, {});
        const auto req = Writer(uint8_t(1 + rng() % 9)).str("key").blob(Bytes(rng() % 64, 5)).i64(7).frame();
        bytes.insert(bytes.end(), req.begin(), req.end());
        for (int i = static_cast<int>(rng() % 64); i > 0; --i) bytes.push_back(static_cast<uint8_t>(rng()));
      }
      raw.send_bytes(bytes);
      if (rng() % 8 == 0) std::this_thread::sleep_for(1ms);
    }
  });
  double peak = 0;
  int served = 0;
  for (auto end = std::chrono::steady_clock::now() + 2s; std::chrono::steady_clock::now() < end; ++served) {
    good.set("n", to_bytes(std::to_string(served)));
    ASSERT_EQ(to_string(good.get("n", 1000ms)), std::to_string(served));
    if (served % 20 == 0) peak = std::max(peak, rss_mib() - before);
  }
  stop = true;
  hostile.join();
  EXPECT_GT(served, 50);
  EXPECT_LT(peak, 64.0 + kQuarantineMiB) << "the server grew by " << peak << " MiB under random frames";
  EXPECT_EQ(to_string(good.get("n", 1000ms)), std::to_string(served - 1));
  EXPECT_GT(server.rejected_connections(), 0u);
}

}  // namespace
