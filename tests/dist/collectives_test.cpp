// Collectives on 2 and 3 real processes (run by dtrain-run under ctest; on 2 also with DTRAIN_SHM=0,
// all over Gloo).
#include <chrono>
#include <thread>

#include <ATen/ATen.h>

#include "dist_main.h"
#include "dtrain/errors.h"
#include "dtrain/safetensors.h"
#include "common/util.h"
#include "test_util.h"
#include "matchers.h"

using namespace dtrain;

namespace {
int R() { return rank(); }
int N() { return world_size(); }
using dtrain::test_util::dtrain_error_of;
using dtrain::test_util::error_of;
using dtrain::util::now_ns;

// A group of every rank whose collectives all run over Gloo (TCP), as between hosts.
Group gloo_group() {
  dtrain::test_util::EnvOverride off("DTRAIN_SHM", "0");
  return new_group({});
}

}  // namespace

// Shared memory here, Gloo in dist_collectives_test_gloo_2.
TEST(Collectives, DefaultGroupRunsOverTheTransportThisRunTests) { expect_default_group_transport_from_env(); }

TEST(Collectives, RankAndLocalRank) {
  EXPECT_TRUE(is_initialized());
  EXPECT_EQ(local_world_size(), N());  // dtrain-run on one node
  EXPECT_EQ(local_rank(), R());
  EXPECT_EQ(backend(), "gloo");
}

// Groups created and dropped back to back, each behind new_group's barrier
// (Note [new_group barrier]): every one completes, and a group made after them still works. The race the barrier
// closes (a member dropping its connections during a peer's handshake) was seen only on a loaded
// machine, about one group in six; this loop does not reproduce it reliably without the barrier.
TEST(Collectives, GroupsCreatedAndDroppedAtOnce) {
  for (int i = 0; i < 20; ++i) gloo_group();
  at::Tensor t = at::ones({2});
  all_reduce(t, ReduceOp::SUM, gloo_group());
  EXPECT_EQ(t[0].item<float>(), static_cast<float>(N()));
}

// Gloo groups take CPU tensors; choosing a CUDA device on this GPU-less machine says why it cannot.
TEST(Collectives, CollectiveDeviceAndSetCudaDevice) {
  EXPECT_EQ(collective_device(), at::Device(at::kCPU));
  const std::string err = dtrain_error_of([] { set_cuda_device(R()); });
  EXPECT_THAT(err, HasSubstr("set_cuda_device(" + std::to_string(R()) + ")")) << err;
  EXPECT_THAT(err, HasSubstr("no CUDA device is visible")) << err;
}

TEST(Collectives, AllReduceOps) {
  auto v = [](ReduceOp op) {
    at::Tensor t = at::full({3}, R() + 1.0);
    all_reduce(t, op);
    return t[1].item<double>();
  };
  double n = N();
  EXPECT_DOUBLE_EQ(v(ReduceOp::SUM), n * (n + 1) / 2);
  EXPECT_DOUBLE_EQ(v(ReduceOp::AVG), (n + 1) / 2);
  EXPECT_DOUBLE_EQ(v(ReduceOp::MIN), 1);
  EXPECT_DOUBLE_EQ(v(ReduceOp::MAX), n);
  double fact = 1;
  for (int i = 1; i <= N(); ++i) fact *= i;
  EXPECT_DOUBLE_EQ(v(ReduceOp::PRODUCT), fact);
}

TEST(Collectives, AsyncAllReduceAndAvgAfterWait) {
  at::Tensor a = at::full({1000}, static_cast<float>(R()));
  at::Tensor b = at::full({10}, 2.0f * R());
  Work wa = all_reduce(a, ReduceOp::AVG, Group(), /*async_op=*/true);
  Work wb = all_reduce(b, ReduceOp::SUM, Group(), true);
  wb.wait();
  wa.wait();
  wa.wait();  // waiting twice is harmless (the division happens once)
  EXPECT_FLOAT_EQ(a[999].item<float>(), (N() - 1) / 2.0f);
  EXPECT_FLOAT_EQ(b[0].item<float>(), static_cast<float>(N() * (N() - 1)));
  EXPECT_TRUE(wa.is_completed());
}

// DDP's average in place: the same bits as dividing a flat copy and summing it (all_reduce SUM), on
// the default group (shared memory where this run has it) and over Gloo; rank 0 passes a transposed
// tensor, which the shared-memory way cannot take, so the ranks mix the two ways in one call.
TEST(Collectives, AllReduceDividedEqualsDividingAFlatCopyAndSumming) {
  for (const Group& group : {Group(), gloo_group()})
    for (at::ScalarType dtype : {at::kFloat, at::kDouble})
      for (int64_t divisor : {static_cast<int64_t>(N()), int64_t{3}}) {
        auto make = [&] {
          at::manual_seed(100 + R());
          std::vector<at::Tensor> ts{at::randn({37, 41}, dtype), at::randn({5}, dtype), at::randn({0}, dtype),
                                     at::randn({3, 3000}, dtype)};
          if (R() == 0) ts[0] = at::randn({41, 37}, dtype).t();
          return ts;
        };
        std::vector<at::Tensor> expect = make(), got = make();
        std::vector<at::Tensor> flat_parts;
        for (auto& t : expect) flat_parts.push_back(t.reshape({-1}) / divisor);
        at::Tensor flat = at::cat(flat_parts);
        all_reduce(flat, ReduceOp::SUM, group);
        at::Tensor scratch = at::empty({20000}, dtype);
        all_reduce_divided(got, divisor, group, R() == 1 ? scratch : at::Tensor());
        int64_t offset = 0;
        for (auto& t : got) {
          EXPECT_TRUE(at::equal(t.reshape({-1}), flat.narrow(0, offset, t.numel())))
              << "dtype " << dtype << " divisor " << divisor << " tensor of " << t.sizes();
          offset += t.numel();
        }
      }
}

TEST(Collectives, AllReduceDividedBadInputIsAClearError) {
  std::vector<at::Tensor> ts{at::ones({2})};
  EXPECT_THAT(dtrain_error_of([&] { all_reduce_divided(ts, 0); }),
              HasSubstr("all_reduce_divided: divisor=0 is not positive"));
  std::vector<at::Tensor> mixed{at::ones({2}), at::ones({2}, at::kDouble)};
  EXPECT_THAT(dtrain_error_of([&] { all_reduce_divided(mixed, 2); }),
              HasSubstr("pass tensors of one floating-point dtype"));
  std::vector<at::Tensor> none;
  EXPECT_THAT(dtrain_error_of([&] { all_reduce_divided(none, 2); }), HasSubstr("no tensors"));
  // Nothing was sent: the group still works.
  all_reduce_divided(ts, 1);
  EXPECT_EQ(ts[0][0].item<float>(), static_cast<float>(N()));
}

TEST(Collectives, AvgOnIntegersIsAClearError) {
  at::Tensor t = at::ones({2}, at::kLong);
  EXPECT_THAT(error_of([&] { all_reduce(t, ReduceOp::AVG); }), HasSubstr("needs a floating-point tensor"));
  // reduce too, on every rank (only the destination divides, but every rank must refuse alike).
  EXPECT_THAT(error_of([&] { reduce(t, 0, ReduceOp::AVG); }),
              HasSubstr("reduce: ReduceOp::AVG needs a floating-point tensor"));
}

// The small control messages: plain values in and out, on the world and on a subgroup of the others.
TEST(Collectives, SmallMessages) {
  EXPECT_EQ(all_reduce_values(std::vector<int64_t>{R(), 1}, ReduceOp::MAX), (std::vector<int64_t>{N() - 1, 1}));
  EXPECT_EQ(all_reduce_values(std::vector<double>{0.5 * R()})[0], 0.25 * N() * (N() - 1));
  const auto gathered = all_gather_values(std::vector<double>{1.0 * R(), -1.0});
  ASSERT_EQ(gathered.size(), static_cast<size_t>(N()));
  for (int r = 0; r < N(); ++r) EXPECT_EQ(gathered[r], (std::vector<double>{1.0 * r, -1.0}));

  // Texts of different lengths, the empty one included.
  auto text_of = [](int r) { return std::string(static_cast<size_t>(r) * 3, static_cast<char>('a' + r)); };
  EXPECT_EQ(broadcast_bytes(R() == N() - 1 ? text_of(N() - 1) : "ignored", N() - 1), text_of(N() - 1));
  EXPECT_EQ(broadcast_bytes(R() == 0 ? "" : "ignored", 0), "");
  const auto all = all_gather_bytes(text_of(R()));
  ASSERT_EQ(all.size(), static_cast<size_t>(N()));
  for (int r = 0; r < N(); ++r) EXPECT_EQ(all[r], text_of(r));

  std::vector<int> others;
  for (int r = 1; r < N(); ++r) others.push_back(r);
  Group sub = new_group(others);
  if (!sub.is_member()) return;
  const auto at_last = gather_bytes(text_of(R()), N() - 1, sub);
  if (R() != N() - 1) {
    EXPECT_TRUE(at_last.empty());
  } else {
    ASSERT_EQ(at_last.size(), others.size());
    for (size_t i = 0; i < others.size(); ++i) EXPECT_EQ(at_last[i], text_of(others[i]));
  }
  EXPECT_EQ(all_gather_values(std::vector<int64_t>{R()}, sub).front(), std::vector<int64_t>{1});
}

// A model in parts (as pipeline stages hold it): rank r holds r + 1 tensors of its own dtype and
// shape, one named with a space and a newline; the last rank gets them all, in group-rank order.
TEST(Collectives, GatherNamedTensorsPutsEveryMembersOnOneRank) {
  const auto part_of = [](int r) {
    NamedTensors part;
    for (int i = 0; i <= r; ++i)
      part.emplace_back("rank " + std::to_string(r) + "\n.t" + std::to_string(i),
                        at::arange((r + 1) * (i + 2), r % 2 ? at::kDouble : at::kFloat).view({r + 1, i + 2}).add(r));
    return part;
  };
  const NamedTensors got = gather_named_tensors(part_of(R()), N() - 1);
  if (R() != N() - 1) {
    EXPECT_TRUE(got.empty());
    return;
  }
  NamedTensors want;
  for (int r = 0; r < N(); ++r)
    for (auto& nt : part_of(r)) want.push_back(nt);
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_EQ(got[i].first, want[i].first);
    EXPECT_EQ(got[i].second.scalar_type(), want[i].second.scalar_type()) << want[i].first;
    EXPECT_TRUE(at::equal(got[i].second, want[i].second)) << want[i].first;
  }
}

TEST(Collectives, BroadcastFromLastRank) {
  at::Tensor t = at::full({5}, static_cast<float>(R()));
  broadcast(t, N() - 1);
  EXPECT_FLOAT_EQ(t.sum().item<float>(), 5.0f * (N() - 1));
}

TEST(Collectives, ReduceToRankZero) {
  at::Tensor t = at::full({2}, 1.0);
  reduce(t, 0, ReduceOp::SUM);
  if (R() == 0) {
    EXPECT_DOUBLE_EQ(t[0].item<double>(), N());
  }
}

// AVG is a SUM and a division on the destination only (Note [AVG on Gloo]), blocking or not, on the
// default group and on a Gloo-only one.
TEST(Collectives, ReduceAvgGivesTheMeanOnTheDestination) {
  const int dst = N() - 1;
  const double mean = (N() + 1) / 2.0;  // of 1..N
  for (const Group& g : {Group(), gloo_group()}) {
    at::Tensor t = at::full({3}, R() + 1.0);
    reduce(t, dst, ReduceOp::AVG, g);
    if (R() == dst) {
      EXPECT_DOUBLE_EQ(t[2].item<double>(), mean);
    }
    at::Tensor f = at::full({5}, static_cast<float>(R() + 1));
    Work w = reduce(f, dst, ReduceOp::AVG, g, /*async_op=*/true);
    w.wait();
    w.wait();  // divided once
    if (R() == dst) {
      EXPECT_FLOAT_EQ(f[4].item<float>(), static_cast<float>(mean));
    }
  }
}

TEST(Collectives, AllGatherInRankOrder) {
  std::vector<at::Tensor> out;
  for (int i = 0; i < N(); ++i) out.push_back(at::empty({2, 2}));
  all_gather(out, at::full({2, 2}, 10.0f * R()));
  for (int i = 0; i < N(); ++i) EXPECT_FLOAT_EQ(out[i][1][1].item<float>(), 10.0f * i);
}

TEST(Collectives, ReduceScatter) {
  // inputs[j] on rank r = r*100 + j; output on rank j = sum_r (r*100 + j).
  std::vector<at::Tensor> in;
  for (int j = 0; j < N(); ++j) in.push_back(at::full({4}, 100.0f * R() + j));
  at::Tensor out = at::empty({4});
  reduce_scatter(out, in);
  float expected = 100.0f * N() * (N() - 1) / 2 + static_cast<float>(N()) * R();
  EXPECT_FLOAT_EQ(out[3].item<float>(), expected);
  at::Tensor avg = at::empty({4});
  Work w = reduce_scatter(avg, in, ReduceOp::AVG, Group(), true);
  w.wait();
  EXPECT_FLOAT_EQ(avg[0].item<float>(), expected / N());
}

TEST(Collectives, IsCompletedMeansTheResultsAreInPlace) {
  // PyTorch's contract: once is_completed() is true the outputs are final, without wait(). For
  // AVG (a SUM, then a local division) and reduce_scatter (an all_reduce, then a local copy) the
  // last step must have run by then.
  auto poll = [](Work& w) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    while (!w.is_completed()) {
      ASSERT_LT(std::chrono::steady_clock::now(), deadline) << "is_completed() never became true";
      std::this_thread::yield();
    }
  };
  at::Tensor t = at::full({1000}, static_cast<float>(R() + 1));
  Work a = all_reduce(t, ReduceOp::AVG, Group(), /*async_op=*/true);
  poll(a);
  EXPECT_FLOAT_EQ(t[999].item<float>(), (N() + 1) / 2.0f);
  std::vector<at::Tensor> in;
  for (int j = 0; j < N(); ++j) in.push_back(at::full({4}, static_cast<float>(j + 1)));
  at::Tensor out = at::zeros({4});
  Work b = reduce_scatter(out, in, ReduceOp::SUM, Group(), /*async_op=*/true);
  poll(b);
  EXPECT_FLOAT_EQ(out[0].item<float>(), static_cast<float>(N() * (R() + 1)));
  a.wait();
  b.wait();
}

TEST(Collectives, GatherAndScatter) {
  std::vector<at::Tensor> list;
  if (R() == 1)
    for (int i = 0; i < N(); ++i) list.push_back(at::empty({3}));
  gather(at::full({3}, static_cast<float>(R())), list, /*dst=*/1);
  if (R() == 1) {
    for (int i = 0; i < N(); ++i) EXPECT_FLOAT_EQ(list[i][2].item<float>(), static_cast<float>(i));
  }

  std::vector<at::Tensor> parts;
  if (R() == 0)
    for (int i = 0; i < N(); ++i) parts.push_back(at::full({2}, 7.0f * i));
  at::Tensor mine = at::empty({2});
  scatter(mine, parts, /*src=*/0);
  EXPECT_FLOAT_EQ(mine[0].item<float>(), 7.0f * R());
}

TEST(Collectives, ListSizeMismatchIsAClearError) {
  std::vector<at::Tensor> out{at::empty({2})};
  if (N() > 1) {
    EXPECT_THAT(error_of([&] { all_gather(out, at::ones({2})); }), HasSubstr("pass one tensor per rank"));
  }
}

// Every rank passes one tensor (right only on the root): the root's call runs, but the others fail
// before communicating, so the root's check of its own list runs alone: give it the wrong size too.
TEST(Collectives, GatherAndScatterListsOnlyOnTheRoot) {
  if (N() < 2) return;
  std::vector<at::Tensor> one{at::empty({2})};
  const std::string g = error_of([&] { gather(at::ones({2}), one, /*dst=*/0); });
  const std::string s = error_of([&] { scatter(one[0], one, /*src=*/N() - 1); });
  if (R() != 0)
    EXPECT_THAT(g, HasSubstr("gather_list must be empty on non-destination rank " + std::to_string(R()) +
                             " (dst=0): pass gather_list only on the destination rank"))
        << g;
  else
    EXPECT_THAT(g, HasSubstr("pass one tensor per rank")) << g;
  if (R() != N() - 1)
    EXPECT_THAT(s, HasSubstr("scatter_list must be empty on non-source rank " + std::to_string(R()))) << s;
  else
    EXPECT_THAT(s, HasSubstr("pass one tensor per rank")) << s;
}

TEST(Collectives, SendRecvRing) {
  int next = (R() + 1) % N(), prev = (R() + N() - 1) % N();
  at::Tensor got = at::empty({8});
  Work s = isend(at::full({8}, static_cast<float>(R())), next, Group(), /*tag=*/3);
  Work r = irecv(got, prev, Group(), 3);
  r.wait();
  s.wait();
  EXPECT_FLOAT_EQ(got[7].item<float>(), static_cast<float>(prev));
}

TEST(Collectives, BlockingSendAndRecvFromAnySource) {
  if (R() == 0) {
    std::set<int> senders;
    for (int i = 1; i < N(); ++i) {
      at::Tensor t = at::empty({1});
      int from = recv(t, -1);
      EXPECT_FLOAT_EQ(t[0].item<float>(), 1000.0f + from);
      senders.insert(from);
    }
    EXPECT_EQ(static_cast<int>(senders.size()), N() - 1);
  } else {
    send(at::full({1}, 1000.0f + R()), 0);
  }
}

// Nobody leaves a barrier before the last rank has entered it: the last rank sleeps 300 ms first,
// and every rank's exit time must come after its entry (one host: steady_clock is shared).
TEST(Collectives, BarrierWaitsForTheLastRank) {
  const int late = N() - 1;
  for (const Group& g : {Group(), gloo_group()}) {
    at::Tensor sync = at::ones({1});
    all_reduce(sync, ReduceOp::SUM, g);           // start together (not a barrier: that is what is tested)
    at::Tensor mine = at::zeros({2}, at::kLong);  // {entered, left}
    if (R() == late) std::this_thread::sleep_for(std::chrono::milliseconds(300));
    mine[0] = now_ns();
    barrier(g);
    mine[1] = now_ns();
    std::vector<at::Tensor> all;
    for (int r = 0; r < N(); ++r) all.push_back(at::empty({2}, at::kLong));
    all_gather(all, mine, g);
    const int64_t entered = all[late][0].item<int64_t>();
    for (int r = 0; r < N(); ++r)
      EXPECT_GE(all[r][1].item<int64_t>(), entered)
          << "rank " << r << " left the barrier " << (entered - all[r][1].item<int64_t>()) / 1e6 << " ms before rank "
          << late << " entered it (group " << (g.uses_shared_memory() ? "shm" : "gloo") << ")";
  }
}

// Over Gloo (between hosts, or DTRAIN_SHM=0) ranks that pass different sizes used to kill the
// process from Gloo's I/O thread (std::terminate, SIGABRT). Now every rank gets a dtrain::Error on
// its own thread, naming the rank, the operation and both calls, and the group stays usable.
TEST(Collectives, MismatchOverGlooIsACatchableError) {
  Group g = gloo_group();
  ASSERT_FALSE(g.uses_shared_memory());
  const std::string me = "rank " + std::to_string(R()) + ": ";
  at::Tensor t = at::ones({R() == 0 ? 4 : 5});
  std::string e = dtrain_error_of([&] { all_reduce(t, ReduceOp::SUM, g); });
  EXPECT_EQ(e.rfind(me + "all_reduce on group '", 0), 0u) << e;
  EXPECT_THAT(e, HasSubstr("(gloo, ranks [0, 1")) << e;
  EXPECT_THAT(e, HasSubstr("all_reduce of 4 Float elements (SUM)")) << e;
  EXPECT_THAT(e, HasSubstr("all_reduce of 5 Float elements (SUM)")) << e;
  EXPECT_THAT(e, HasSubstr("every rank must call the same collectives")) << e;

  // Asynchronous: the check runs on the group's worker thread, and wait() rethrows its error.
  at::Tensor b = at::zeros({R() == 0 ? 3 : 2});
  Work w = broadcast(b, 0, g, /*async_op=*/true);
  e = dtrain_error_of([&] { w.wait(); });
  EXPECT_EQ(e.rfind(me + "broadcast on group '", 0), 0u) << e;
  EXPECT_THAT(e, HasSubstr("broadcast of 3 Float elements with root rank 0")) << e;

  // Different operations.
  at::Tensor s = at::ones({2});
  e = dtrain_error_of([&] { R() == 0 ? barrier(g) : all_reduce(s, ReduceOp::MAX, g); });
  EXPECT_THAT(e, HasSubstr("calls barrier")) << e;
  EXPECT_THAT(e, HasSubstr("calls all_reduce of 2 Float elements (MAX)")) << e;

  // No data moved: the same group still works.
  at::Tensor ok = at::ones({4});
  all_reduce(ok, ReduceOp::SUM, g);
  EXPECT_FLOAT_EQ(ok[3].item<float>(), static_cast<float>(N()));
}

TEST(Collectives, BarrierAndMonitoredBarrier) {
  barrier();
  Work w = barrier(Group(), true);
  w.wait();
  monitored_barrier(Group(), std::chrono::seconds(30));
}

// A timeout of milliseconds::max() waits as long as it takes (dtrain caps it at 10^9 s): added to
// now() as it is, it would overflow into the past and every wait would time out at once.
TEST(Collectives, TimeoutOfMillisecondsMaxMeansForever) {
  Group g = new_group({}, std::chrono::milliseconds::max());
  at::Tensor t = at::ones({4});
  all_reduce(t, ReduceOp::SUM, g);
  EXPECT_FLOAT_EQ(t[0].item<float>(), static_cast<float>(N()));
  monitored_barrier(g, std::chrono::milliseconds::max());
}

TEST(Collectives, MonitoredBarrierNamesTheMissingRank) {
  Group sub = new_group({0, 1});  // a throwaway group: the failed barrier leaves it unusable
  if (R() == 0) {
    std::string err = error_of([&] { monitored_barrier(sub, std::chrono::milliseconds(600)); });
    EXPECT_THAT(err, HasSubstr("monitored_barrier")) << err;
    EXPECT_THAT(err, HasSubstr("Rank 1")) << err;
  }
  barrier();  // rank 1 did not take part; the world group still works
}

TEST(Collectives, SubgroupsUseGlobalRanks) {
  if (N() < 3) GTEST_SKIP() << "needs 3 ranks";
  Group g = new_group({0, 2});
  Group all = new_group({});
  EXPECT_EQ(all.size(), N());
  if (R() == 1) {
    EXPECT_FALSE(g.is_member());
    at::Tensor t = at::ones({1});
    EXPECT_THAT(error_of([&] { all_reduce(t, ReduceOp::SUM, g); }), HasSubstr("not a member"));
  } else {
    EXPECT_EQ(g.rank(), R() == 0 ? 0 : 1);
    at::Tensor t = at::full({1}, static_cast<float>(R()));
    all_reduce(t, ReduceOp::SUM, g);
    EXPECT_FLOAT_EQ(t[0].item<float>(), 2.0f);
    at::Tensor b = at::full({1}, static_cast<float>(R()));
    broadcast(b, 2, g);  // src is a global rank
    EXPECT_FLOAT_EQ(b[0].item<float>(), 2.0f);
    EXPECT_THAT(error_of([&] { broadcast(b, 1, g); }), HasSubstr("src=1 is not a member"));
  }
  barrier();
}

TEST(Collectives, NewGroupRejectsBadRanks) {
  EXPECT_THAT(error_of([] { new_group({0, N()}); }), HasSubstr("out of range"));
  EXPECT_THAT(error_of([] { new_group({0, 0}); }), HasSubstr("listed twice"));
}

DTRAIN_DIST_TEST_MAIN()
