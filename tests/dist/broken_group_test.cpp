// A group that breaks at run time over Gloo (Note [Broken groups]): every rank must learn it within
// seconds, not at its own timeout, and every later call on any rank must fail at once with one line
// naming the rank that broke the group, its operation and its first failure.
//
// The failure is a real one: rank 0 creates the group with a 2 s timeout, the ranks in between with
// 4 s, the last rank with 60 s; all but the last rank start an all_reduce, the last rank does not
// come. Rank 0's Gloo times out after 2 s (the first failure). The last rank starts its all_reduce
// only after all the others have returned (it waits in a barrier of the default group, which is not
// affected): it must fail at once with rank 0's line, where it used to wait for its 60 s timeout.
// The ranks in between must report rank 0's line too; over Gloo alone they may still wait for their
// own (4 s) timeout, since what they wait for in the ring can be the absent last rank rather than
// rank 0 (Note [Broken groups]); across hosts the segment releases them at once.
#include <chrono>
#include <functional>
#include <optional>
#include <string>
#include <thread>

#include <ATen/ATen.h>

#include "dist_main.h"
#include "dtrain/errors.h"
#include "test_util.h"
#include "matchers.h"

using namespace dtrain;
using dtrain::test_util::dtrain_error_of;
using dtrain::test_util::EnvOverride;

namespace {

using Clock = std::chrono::steady_clock;

int R() { return rank(); }
int N() { return world_size(); }
int last() { return N() - 1; }

constexpr auto kShortTimeout = std::chrono::seconds(2);   // rank 0's: the one that fails first
constexpr auto kMiddleTimeout = std::chrono::seconds(4);  // the ranks in between
constexpr auto kLongTimeout = std::chrono::seconds(60);   // the last rank's: never reached
// "At once": far below kLongTimeout, well above a loaded machine's (or a sanitizer's) latency.
constexpr auto kPromptly = std::chrono::seconds(8);

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// The group under test, rank 0's with the short timeout; made with DTRAIN_SHM=`shm` and, unless
// `host` is empty, DTRAIN_SHM_HOST=`host` (a faked host).
Group make_group(const std::string& shm, const std::string& host) {
  EnvOverride mode("DTRAIN_SHM", shm);
  std::optional<EnvOverride> fake_host;
  if (!host.empty()) fake_host.emplace("DTRAIN_SHM_HOST", host);
  const auto timeout = std::chrono::milliseconds(R() == 0        ? kShortTimeout
                                                 : R() == last() ? kLongTimeout
                                                                 : kMiddleTimeout);
  return new_group({}, timeout);
}

// The documented line of a call on a broken group whose first failure was rank 0's all_reduce
// timing out.
void expect_first_failure_line(const std::string& e, const std::string& op, const Group& g, const std::string& where) {
  EXPECT_EQ(e.rfind("rank " + std::to_string(R()) + ": " + op + " on group '" + g.name() + "'", 0), 0u)
      << where << ": " << e;
  EXPECT_THAT(e,
              HasSubstr("failed: the group is unusable since an earlier collective failed (rank 0: allreduce failed: "))
      << where << ": " << e;
  EXPECT_THAT(e, HasSubstr("imed out")) << where << ": rank 0's timeout is the first failure: " << e;
  EXPECT_THAT(e, HasSubstr("destroy the process group and create it again, or restart the job")) << e;
  EXPECT_THAT(e, Not(HasSubstr("\n"))) << where << ": one line: " << e;
  EXPECT_THAT(e, Not(HasSubstr("onnection closed"))) << where << ": the consequence, not the cause: " << e;
}

// Breaks `g` as the file's comment says, then checks what every rank sees.
void break_and_check(const Group& g, bool check_send) {
  at::Tensor warm = at::ones({4});
  all_reduce(warm, ReduceOp::SUM, g);  // the group works, its connections are up
  ASSERT_EQ(warm[0].item<float>(), static_cast<float>(N()));
  barrier();

  at::Tensor t = at::ones({1000});
  const auto t0 = Clock::now();
  if (R() != last()) {
    const std::string e = dtrain_error_of([&] { all_reduce(t, ReduceOp::SUM, g); });
    const double took = seconds_since(t0);
    if (R() == 0) {
      // The first failure, in the Work's words for a timeout.
      EXPECT_THAT(e, HasSubstr("rank 0: all_reduce on group '" + g.name() + "'")) << e;
      EXPECT_THAT(e, HasSubstr(" timed out (a rank of the group did not take part in time")) << e;
    } else {
      // Released by rank 0 closing its connections or its segment, at the latest by its own timeout,
      // and then reporting rank 0's line (the store's), not its own.
      expect_first_failure_line(e, "all_reduce", g, "rank in between, the failing all_reduce");
      EXPECT_LT(took, std::chrono::duration<double>(kMiddleTimeout + kPromptly).count()) << e;
    }
    barrier();  // now the last rank comes
  } else {
    barrier();
    const auto t_late = Clock::now();
    const std::string e = dtrain_error_of([&] { all_reduce(t, ReduceOp::SUM, g); });
    expect_first_failure_line(e, "all_reduce", g, "the last rank's all_reduce");
    EXPECT_LT(seconds_since(t_late), std::chrono::duration<double>(kPromptly).count()) << e;
  }

  // Every later call, of any kind and on any rank, fails at once with the same line.
  const auto t1 = Clock::now();
  at::Tensor f = at::ones({3});
  at::Tensor i32 = at::ones({3}, at::kInt);
  const std::vector<std::pair<std::string, std::function<void()>>> later = {
      {"barrier", [&] { barrier(g); }},
      {"all_reduce", [&] { all_reduce(f, ReduceOp::SUM, g); }},
      {"reduce", [&] { reduce(i32, 0, ReduceOp::SUM, g); }},
      {"broadcast", [&] { broadcast(f, N() - 1, g, /*async_op=*/true).wait(); }},
  };
  for (const auto& [op, call] : later) expect_first_failure_line(dtrain_error_of(call), op, g, "later " + op);
  // Point-to-point over Gloo too (over shared memory a send reports the segment's abort in its own words).
  if (check_send)
    expect_first_failure_line(dtrain_error_of([&] { isend(f, (R() + 1) % N(), g).wait(); }), "send", g, "later send");
  EXPECT_LT(seconds_since(t1), std::chrono::duration<double>(kPromptly).count());

  // The default group is another group: it still works.
  at::Tensor ok = at::full({2}, static_cast<float>(R() + 1));
  all_reduce(ok);
  EXPECT_EQ(ok[1].item<float>(), N() * (N() + 1) / 2.0f);
}

}  // namespace

// Gloo alone between every pair of ranks: the path of ranks on different hosts, and of DTRAIN_SHM=0.
TEST(BrokenGroup, OverGlooEveryRankFailsAtOnceNamingTheFirstFailure) {
  const Group g = make_group("0", "");
  ASSERT_FALSE(g.uses_shared_memory());
  break_and_check(g, /*check_send=*/true);
}

// Several hosts faked on one machine (DTRAIN_SHM_HOST): ranks 0..N-2 share host "a" (shared memory,
// rank 0 its leader), the last rank is alone on host "b"; all_reduce goes over shared memory inside
// "a" and over Gloo between the leaders. Rank 0's Gloo times out; its host's ranks learn it through
// the segment, the last rank through the closed connection and the store. With 2 ranks each host
// has one rank, which is Gloo alone again.
TEST(BrokenGroup, AcrossHostsEveryRankFailsAtOnceNamingTheFirstFailure) {
  const Group g = make_group("auto", R() == last() ? "b" : "a");
  EXPECT_EQ(g.uses_shared_memory(), N() > 2 && R() != last());  // the last rank is alone on its host
  break_and_check(g, /*check_send=*/N() == 2);
}

DTRAIN_DIST_TEST_MAIN()
