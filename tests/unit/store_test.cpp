// Tests for the torch-free rendezvous store (src/store): semantics, blocking, timeouts, errors,
// and that the server listens on the given address only.
#include "store/store.h"

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sched.h>
#include <sys/mount.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>
#include "matchers.h"
#include "time_scale.h"

using namespace dtrain::store;
using namespace std::chrono_literals;

namespace {

constexpr Millis kConnect{5000};

// A port that nothing listens on: bind port 0, read it, close.
uint16_t closed_port() {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a));
  socklen_t len = sizeof(a);
  getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  close(fd);
  return ntohs(a.sin_port);
}

// Local address of the listening socket on `port` from /proc/net/tcp ("0100007F" = 127.0.0.1).
std::vector<std::string> listeners_on(uint16_t port) {
  std::ifstream f("/proc/net/tcp");
  std::string line;
  std::vector<std::string> out;
  std::getline(f, line);  // header
  char want[8];
  snprintf(want, sizeof(want), "%04X", port);
  while (std::getline(f, line)) {
    std::istringstream ss(line);
    std::string sl, local, remote, state;
    ss >> sl >> local >> remote >> state;
    if (state == "0A" && local.substr(local.find(':') + 1) == want) out.push_back(local.substr(0, local.find(':')));
  }
  return out;
}

}  // namespace

TEST(Store, SetGet) {
  StoreServer server("127.0.0.1", 0);
  ASSERT_NE(server.port(), 0);
  StoreClient c("127.0.0.1", server.port(), kConnect);
  c.set("a", to_bytes("hello"));
  EXPECT_EQ(to_string(c.get("a", 1000ms)), "hello");
  c.set("a", to_bytes(""));
  EXPECT_EQ(to_string(c.get("a", 1000ms)), "");
  Bytes big(3 << 20, 7);  // several MiB value crosses many socket buffers
  c.set("big", big);
  EXPECT_EQ(c.get("big", 1000ms), big);
  EXPECT_EQ(c.local_address(), "127.0.0.1");
}

TEST(Store, GetBlocksUntilAnotherClientSets) {
  StoreServer server("127.0.0.1", 0);
  std::atomic<bool> got{false};
  std::string value;
  std::thread waiter([&] {
    StoreClient c("127.0.0.1", server.port(), kConnect);
    value = to_string(c.get("late", 10000ms));
    got = true;
  });
  std::this_thread::sleep_for(200ms);
  EXPECT_FALSE(got.load());
  StoreClient setter("127.0.0.1", server.port(), kConnect);
  setter.set("late", to_bytes("now"));
  waiter.join();
  EXPECT_EQ(value, "now");
}

TEST(Store, WaitersHaveTheirOwnTimeouts) {
  StoreServer server("127.0.0.1", 0);
  std::atomic<bool> long_done{false};
  std::thread long_waiter([&] {
    StoreClient c("127.0.0.1", server.port(), kConnect);
    c.wait({"k1", "k2"}, 10000ms);
    long_done = true;
  });
  StoreClient c("127.0.0.1", server.port(), kConnect);
  auto t0 = std::chrono::steady_clock::now();
  try {
    c.wait({"never"}, 300ms);
    FAIL() << "wait should time out";
  } catch (const TimeoutError& e) {
    EXPECT_THAT(std::string(e.what()), HasSubstr("'never'")) << e.what();
  }
  EXPECT_LT(std::chrono::steady_clock::now() - t0, dtrain::test_util::scaled(3s));
  EXPECT_FALSE(long_done.load());
  c.set("k1", to_bytes("1"));
  EXPECT_FALSE(c.check({"k1", "k2"}));
  c.add("k2", 1);
  long_waiter.join();
  EXPECT_TRUE(long_done.load());
  // The connection stays usable after a timeout.
  EXPECT_EQ(to_string(c.get("k1", 1000ms)), "1");
}

TEST(Store, GetTimeoutNamesTheKey) {
  StoreServer server("127.0.0.1", 0);
  StoreClient c("127.0.0.1", server.port(), kConnect);
  try {
    c.get("missing/key", 100ms);
    FAIL();
  } catch (const TimeoutError& e) {
    EXPECT_THAT(std::string(e.what()), HasSubstr("missing/key")) << e.what();
  }
}

TEST(Store, AddCompareSetCheckDeleteNumKeys) {
  StoreServer server("127.0.0.1", 0);
  StoreClient c("127.0.0.1", server.port(), kConnect);
  EXPECT_EQ(c.add("n", 5), 5);
  EXPECT_EQ(c.add("n", -2), 3);
  EXPECT_EQ(to_string(c.get("n", 100ms)), "3");
  c.set("text", to_bytes("x"));
  EXPECT_THROW(c.add("text", 1), std::runtime_error);

  EXPECT_EQ(to_string(c.compare_set("cs", {}, to_bytes("first"))), "first");  // absent + empty: set
  EXPECT_EQ(to_string(c.compare_set("cs", to_bytes("wrong"), to_bytes("no"))), "first");
  EXPECT_EQ(to_string(c.compare_set("cs", to_bytes("first"), to_bytes("second"))), "second");
  EXPECT_EQ(to_string(c.compare_set("absent", to_bytes("e"), to_bytes("d"))), "e");
  EXPECT_FALSE(c.check({"absent"}));

  EXPECT_TRUE(c.check({"n", "cs"}));
  EXPECT_FALSE(c.check({"n", "nope"}));
  EXPECT_EQ(c.num_keys(), 3);
  EXPECT_TRUE(c.delete_key("n"));
  EXPECT_FALSE(c.delete_key("n"));
  EXPECT_EQ(c.num_keys(), 2);
}

TEST(Store, PortInUseIsOneClearLine) {
  StoreServer first("127.0.0.1", 0);
  try {
    StoreServer second("127.0.0.1", first.port());
    FAIL() << "second bind should fail";
  } catch (const std::runtime_error& e) {
    std::string msg = e.what();
    EXPECT_THAT(msg, HasSubstr("port " + std::to_string(first.port()) + " on 127.0.0.1 is already in use")) << msg;
    EXPECT_THAT(msg, Not(HasSubstr("\n")));
  }
}

TEST(Store, QuickRebindAfterClose) {
  uint16_t port;
  {
    StoreServer s("127.0.0.1", 0);
    port = s.port();
    StoreClient c("127.0.0.1", port, kConnect);
    c.set("x", to_bytes("y"));
  }  // connections in TIME_WAIT must not block the rerun
  StoreServer again("127.0.0.1", port);
  EXPECT_EQ(again.port(), port);
}

TEST(Store, ConnectTimeoutToClosedPort) {
  uint16_t port = closed_port();
  auto t0 = std::chrono::steady_clock::now();
  try {
    StoreClient c("127.0.0.1", port, 500ms);
    FAIL();
  } catch (const std::runtime_error& e) {
    std::string msg = e.what();
    EXPECT_THAT(msg, HasSubstr("cannot reach the rendezvous at 127.0.0.1:" + std::to_string(port) + " within 0.5s"))
        << msg;
    EXPECT_THAT(msg, HasSubstr("refused")) << msg;
  }
  auto took = std::chrono::steady_clock::now() - t0;
  EXPECT_GE(took, 450ms);
  EXPECT_LT(took, dtrain::test_util::scaled(5s));
}

TEST(Store, ClientRetriesUntilServerComesUp) {
  uint16_t port = closed_port();
  std::unique_ptr<StoreServer> server;
  std::thread late([&] {
    std::this_thread::sleep_for(300ms);
    server = std::make_unique<StoreServer>("127.0.0.1", port);
  });
  StoreClient c("127.0.0.1", port, kConnect);
  late.join();
  c.set("k", to_bytes("v"));
  EXPECT_EQ(to_string(c.get("k", 100ms)), "v");
}

TEST(Store, UnresolvableHostFailsAtTheConnectTimeoutNamingIt) {
  // A name may resolve late (a pod's DNS record): it is asked again until the connect timeout, then
  // the error names it.
  auto t0 = std::chrono::steady_clock::now();
  testing::internal::CaptureStderr();
  try {
    StoreClient c("no-such-host.invalid", 29500, 1200ms);
    FAIL();
  } catch (const std::runtime_error& e) {
    EXPECT_THAT(std::string(e.what()),
                HasSubstr("the rendezvous host name 'no-such-host.invalid' did not resolve within 1.2s"));
  }
  const std::string said = testing::internal::GetCapturedStderr();
  EXPECT_THAT(said, HasSubstr("dtrain: waiting for the rendezvous host name 'no-such-host.invalid'"));
  EXPECT_EQ(std::count(said.begin(), said.end(), '\n'), 1) << said;  // one line, however long the wait
  EXPECT_GE(std::chrono::steady_clock::now() - t0, 1200ms);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, dtrain::test_util::scaled(8s));
}

// In a child with a mount namespace of its own (root only): /etc/hosts lacks `name` until a thread
// adds it 700 ms after the client started; the client must wait for it and connect. Returns the
// child's exit code: 0 connected, 1 failed, 2 could not set up, 3 the wait was not announced once.
int connect_to_a_name_that_appears_late(const std::string& name) {
  // The files are made here and removed by the parent: the child ends in _exit.
  char dir[] = "/tmp/dtrain_store_dns_XXXXXX";
  if (!mkdtemp(dir)) return 2;
  const pid_t pid = fork();
  if (pid == 0) {
    if (unshare(CLONE_NEWNS) != 0 || mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr) != 0) _exit(2);
    const std::string hosts = std::string(dir) + "/hosts", resolv = std::string(dir) + "/resolv.conf";
    std::ofstream(hosts) << "127.0.0.1 localhost\n";
    std::ofstream(resolv) << "nameserver 127.0.0.1\noptions timeout:1 attempts:1\n";
    if (mount(hosts.c_str(), "/etc/hosts", nullptr, MS_BIND, nullptr) != 0 ||
        mount(resolv.c_str(), "/etc/resolv.conf", nullptr, MS_BIND, nullptr) != 0)
      _exit(2);
    int code = 1;
    {
      StoreServer server("127.0.0.1", 0);
      std::thread dns([&] {
        std::this_thread::sleep_for(700ms);
        std::ofstream(hosts, std::ios::app) << "127.0.0.1 " << name << "\n";  // in place: the bind mount sees it
      });
      testing::internal::CaptureStderr();
      try {
        StoreClient c(name, server.port(), 10000ms);
        c.set("k", to_bytes("v"));
        code = 0;
      } catch (const std::exception&) {
      }
      const std::string said = testing::internal::GetCapturedStderr();
      if (code == 0 && (std::count(said.begin(), said.end(), '\n') != 1 || said.find(name) == std::string::npos))
        code = 3;
      dns.join();
    }
    _exit(code);
  }
  int status = 0;
  waitpid(pid, &status, 0);
  std::filesystem::remove_all(dir);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

TEST(Store, ClientWaitsForANameThatResolvesLate) {
  if (geteuid() != 0) GTEST_SKIP() << "a mount namespace needs root";
  EXPECT_EQ(connect_to_a_name_that_appears_late("late-pod-0.dtrain.test"), 0);
}

TEST(Store, BindsOnlyTheGivenAddress) {
  StoreServer server("127.0.0.1", 0);
  auto listeners = listeners_on(server.port());
  ASSERT_EQ(listeners.size(), 1u);
  EXPECT_EQ(listeners[0], "0100007F");  // 127.0.0.1, not 00000000 (0.0.0.0)
  // Another loopback address of this host is not served.
  EXPECT_THROW(StoreClient("127.0.0.2", server.port(), 200ms), std::runtime_error);
}

TEST(Store, Ipv6Loopback) {
  std::unique_ptr<StoreServer> server;
  try {
    server = std::make_unique<StoreServer>("::1", 0);
  } catch (const std::runtime_error& e) {
    GTEST_SKIP() << "no IPv6 loopback here: " << e.what();
  }
  StoreClient c("::1", server->port(), kConnect);
  c.set("v6", to_bytes("yes"));
  EXPECT_EQ(to_string(c.get("v6", 100ms)), "yes");
  EXPECT_EQ(c.local_address(), "::1");
}

TEST(Store, PeerVanishingMidRequestDoesNotHurtTheServer) {
  StoreServer server("127.0.0.1", 0);
  {  // half a frame, then gone
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(server.port());
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ASSERT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
    const uint8_t partial[] = {100, 0, 0, 0, 1, 3};
    ASSERT_EQ(write(fd, partial, sizeof(partial)), ssize_t(sizeof(partial)));
    close(fd);
  }
  {  // a parked waiter that leaves
    std::thread t([&] {
      StoreClient w("127.0.0.1", server.port(), kConnect);
      EXPECT_THROW(w.get("never", 50ms), TimeoutError);
    });
    t.join();
  }
  StoreClient c("127.0.0.1", server.port(), kConnect);
  c.set("still", to_bytes("alive"));
  EXPECT_EQ(to_string(c.get("still", 100ms)), "alive");
}

TEST(Store, ServerStopsPromptlyWithBlockedClients) {
  auto server = std::make_unique<StoreServer>("127.0.0.1", 0);
  std::thread t([&] {
    StoreClient c("127.0.0.1", server->port(), kConnect);
    EXPECT_THROW(c.get("never", 60000ms), std::runtime_error);  // connection closed by the server
  });
  std::this_thread::sleep_for(100ms);
  auto t0 = std::chrono::steady_clock::now();
  server.reset();
  EXPECT_LT(std::chrono::steady_clock::now() - t0, dtrain::test_util::scaled(1s));
  t.join();
}
