// Shared-memory collectives through the process-group interface, on 2, 3 and 4 real ranks of one
// host (dtrain-run): the default group uses them, results match Gloo (bit for bit on 2 ranks),
// unsupported calls fall back to Gloo, hierarchical all-reduce across simulated hosts, errors.
//
// `shm_dist_test --loop_allreduce` (used by test_shm.py): init, print "ready", all_reduce until a
// collective fails, print that error and exit 1.
#include <dirent.h>
#include <unistd.h>

#include <cstdlib>
#include <iostream>
#include <optional>
#include <string>

#include <ATen/ATen.h>
#include <torch/version.h>

#include "dist_main.h"
#include "dtrain/errors.h"
#include "test_util.h"

using namespace dtrain;

namespace {
int R() { return rank(); }
int N() { return world_size(); }
using dtrain::test_util::EnvOverride;
using dtrain::test_util::error_of;

// A group built with extra environment (read by the backend at construction), restored after.
Group group_with_env(const char* var, const std::string& value) {
  EnvOverride e(var, value);
  return new_group({});
}

at::Tensor rank_data(int64_t n, at::ScalarType t, int r) {
  auto g = at::make_generator<at::CPUGeneratorImpl>(1000 + r);
  return at::randn({n}, g).to(t);
}
}  // namespace

TEST(Shm, DefaultGroupUsesSharedMemoryAndLeavesNoNameBehind) {
  EXPECT_TRUE(Group().uses_shared_memory());
  // Every segment name carries its creator's pid; the names are unlinked once all ranks attached.
  at::Tensor pid = at::full({1}, static_cast<int64_t>(getpid()), at::kLong);
  std::vector<at::Tensor> pids(N());
  for (auto& p : pids) p = at::empty({1}, at::kLong);
  all_gather(pids, pid);
  DIR* d = opendir("/dev/shm");
  ASSERT_NE(d, nullptr);
  while (dirent* e = readdir(d))
    for (auto& p : pids)
      EXPECT_NE(std::string(e->d_name).rfind("dtrain-" + std::to_string(p.item<int64_t>()) + "-", 0), 0u)
          << "left behind: /dev/shm/" << e->d_name;
  closedir(d);
}

TEST(Shm, AllReduceOpsAndDtypes) {
  for (auto dt : {at::kFloat, at::kDouble, at::kBFloat16, at::kHalf}) {
    at::Tensor t = at::full({300000}, R() + 1.0, dt);  // several 1 MB chunks in float64
    all_reduce(t, ReduceOp::SUM);
    EXPECT_TRUE(at::all(t == N() * (N() + 1) / 2.0).item<bool>()) << dt;
    t.fill_(R() + 1.0);
    all_reduce(t, ReduceOp::AVG);
    EXPECT_TRUE(at::all(t == (N() + 1) / 2.0).item<bool>()) << dt;
    t.fill_(R() + 1.0);
    all_reduce(t, ReduceOp::MIN);
    EXPECT_TRUE(at::all(t == 1).item<bool>()) << dt;
    t.fill_(R() + 1.0);
    all_reduce(t, ReduceOp::MAX);
    EXPECT_TRUE(at::all(t == N()).item<bool>()) << dt;
  }
}

TEST(Shm, SumMatchesGlooBitForBitOnTwoRanks) {
  Group gloo = group_with_env("DTRAIN_SHM", "0");
  ASSERT_FALSE(gloo.uses_shared_memory());
#if TORCH_VERSION_MAJOR < 2
  // README: "Gloo 1.13 cannot all-reduce bfloat16 at all; the shared-memory path can" (the latter:
  // Shm.AllReduceOpsAndDtypes).
  at::Tensor bf = at::ones({4}, at::kBFloat16);
  EXPECT_NE(error_of([&] { all_reduce(bf, ReduceOp::SUM, gloo); }).find("Invalid scalar type"), std::string::npos);
#endif
  for (auto dt : {at::kFloat, at::kDouble, at::kHalf})
    for (int64_t n : {1, 1000, 700001}) {
      at::Tensor a = rank_data(n, dt, R()), b = a.clone();
      all_reduce(a, ReduceOp::SUM);
      all_reduce(b, ReduceOp::SUM, gloo);
      if (N() == 2)
        EXPECT_TRUE(at::equal(a, b)) << dt << " n=" << n;
      else  // Gloo's ring adds in another order
        EXPECT_TRUE(at::allclose(a.to(at::kDouble), b.to(at::kDouble), 1e-2, 1e-2)) << dt << " n=" << n;
    }
}

TEST(Shm, BroadcastAllGatherBarrier) {
  for (int src = 0; src < N(); ++src) {
    at::Tensor t = src == R() ? at::arange(600000, at::kInt) : at::zeros({600000}, at::kInt);
    broadcast(t, src);
    EXPECT_TRUE(at::equal(t, at::arange(600000, at::kInt))) << "src " << src;
  }
  at::Tensor in = at::full({400000}, R() * 10, at::kLong);
  std::vector<at::Tensor> out(N());
  for (auto& o : out) o = at::empty({400000}, at::kLong);
  all_gather(out, in);
  for (int k = 0; k < N(); ++k) EXPECT_TRUE(at::all(out[k] == k * 10).item<bool>()) << k;
  barrier();
  Work w = barrier(Group(), /*async_op=*/true);
  w.wait();
}

TEST(Shm, UnsupportedCallsFallBackToGloo) {
  at::Tensor i = at::full({5}, R() + 1, at::kLong);  // int64: Gloo
  all_reduce(i, ReduceOp::SUM);
  EXPECT_EQ(i[0].item<int64_t>(), N() * (N() + 1) / 2);
  at::Tensor nc = at::full({4, 4}, 1.0).t();  // broadcast of a non-contiguous view is refused upstream
  EXPECT_NE(error_of([&] { broadcast(nc, 0); }).find("not contiguous"), std::string::npos);
  at::Tensor r = at::full({3}, 2.0);
  reduce(r, 0, ReduceOp::SUM);
  if (R() == 0) EXPECT_EQ(r[0].item<double>(), 2.0 * N());
  at::Tensor out = at::empty({2});
  std::vector<at::Tensor> inputs(N());
  for (int k = 0; k < N(); ++k) inputs[k] = at::full({2}, static_cast<double>(k));
  reduce_scatter(out, inputs, ReduceOp::SUM);
  EXPECT_EQ(out[0].item<double>(), static_cast<double>(N() * R()));
  if (N() >= 2) {
    at::Tensor m = at::full({2}, static_cast<double>(R()));
    if (R() == 0) send(m.fill_(42), 1);
    if (R() == 1) {
      recv(m, 0);
      EXPECT_EQ(m[0].item<double>(), 42);
    }
  }
  barrier();
}

TEST(Shm, HierarchicalAllReduceAcrossSimulatedHosts) {
  // Ranks 0-1 on "host a", the rest on "host b": shared memory inside each, Gloo between leaders.
  Group g = group_with_env("DTRAIN_SHM_HOST", R() < 2 ? "a" : "b");
  const int on_my_host = R() < 2 ? std::min(2, N()) : N() - 2;
  EXPECT_EQ(g.uses_shared_memory(), on_my_host > 1);
  for (auto dt : {at::kFloat, at::kBFloat16}) {
    at::Tensor t = at::full({700001}, R() + 1.0, dt);
    all_reduce(t, ReduceOp::SUM, g);
    EXPECT_TRUE(at::all(t == N() * (N() + 1) / 2.0).item<bool>()) << dt;
    t.fill_(R() + 1.0);
    all_reduce(t, ReduceOp::MAX, g);
    EXPECT_TRUE(at::all(t == N()).item<bool>()) << dt;
  }
  at::Tensor b = at::full({10}, R() == N() - 1 ? 7.0 : 0.0);
  broadcast(b, N() - 1, g);  // across hosts: Gloo
  EXPECT_EQ(b[3].item<double>(), 7.0);
  barrier(g);
}

TEST(Shm, RequiredWithoutASharedHostFailsOnEveryRank) {
  EnvOverride required("DTRAIN_SHM", "1");
  std::string err = error_of([] { group_with_env("DTRAIN_SHM_HOST", "h" + std::to_string(R())); });
  EXPECT_NE(err.find("DTRAIN_SHM=1 but no two of the group's"), std::string::npos) << err;
}

TEST(Shm, MismatchedShapesFailEveryRankNamingBothCalls) {
  Group g = new_group({});  // it is unusable afterwards
  ASSERT_TRUE(g.uses_shared_memory());
  at::Tensor t = at::ones({R() == 0 ? 8 : 16});
  std::string err = error_of([&] { all_reduce(t, ReduceOp::SUM, g); });
  EXPECT_NE(err.find("mismatched collectives"), std::string::npos) << err;
  if (R() < 2) EXPECT_NE(err.find("all_reduce of 8 float32 (SUM)"), std::string::npos) << err;
  EXPECT_EQ(err.rfind("rank " + std::to_string(R()) + ": ", 0), 0u) << err;  // names this rank first
  EXPECT_NE(error_of([&] { all_reduce(t, ReduceOp::SUM, g); }), "");
}

int main(int argc, char** argv) {
  if (argc > 1 && std::string(argv[1]) == "--loop_allreduce") {
    try {
      init_process_group(InitOptions().timeout(std::chrono::seconds(60)));
      at::Tensor t = at::ones({1 << 16});
      all_reduce(t);
      std::cout << "ready" << std::endl;
      for (;;) all_reduce(t);
    } catch (const std::exception& e) {
      std::cerr << "shm_dist_test: error: " << e.what() << std::endl;
      return 1;
    }
  }
  ::testing::InitGoogleTest(&argc, argv);
  ::testing::AddGlobalTestEnvironment(new DistEnvironment());
  return RUN_ALL_TESTS();
}
