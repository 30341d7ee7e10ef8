// Shared-memory collectives through the process-group interface, on 2, 3 and 4 real ranks of one
// host (dtrain-run): the default group uses them, results match Gloo (bit for bit on 2 ranks),
// unsupported calls fall back to Gloo, hierarchical all-reduce across simulated hosts (of
// rank-dependent data too, against the sum of every rank's inputs), errors.
//
// `shm_dist_test --loop_allreduce` (used by test_shm.py): init, print "ready", all_reduce until a
// collective fails, print that error and exit 1.
//
// `shm_dist_test --all_reduce_mib M [--fill_pause DIR]` (used by test_small_shm.py, with a small
// /dev/shm): init, all_reduce M MiB of floats and check the sums exactly. With DIR: write
// DIR/ready.<rank>, wait for DIR/filled (the test has filled /dev/shm meanwhile), then send and
// receive 4 MiB each way over the default group (its point-to-point rings' first use), make a new
// group (a segment created on the full /dev/shm) and all_reduce on it, and on the default group
// again. Each step prints one line naming whether the group uses shared memory; exit 0 when all
// results are right, 1 (one error line) otherwise.
#include <dirent.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <thread>
#include <optional>
#include <string>

#include <ATen/ATen.h>
#include <torch/version.h>

#include "dist_main.h"
#include "dtrain/errors.h"
#include "test_util.h"
#include "matchers.h"

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
  // docs/features.md: "Gloo 1.13 cannot all-reduce or reduce bfloat16 at all; the shared-memory path can" (the
  // latter: Shm.AllReduceOpsAndDtypes). The call is rejected before anything is sent.
  at::Tensor bf = at::ones({4}, at::kBFloat16);
  EXPECT_THAT(error_of([&] { all_reduce(bf, ReduceOp::SUM, gloo); }), HasSubstr("has no BFloat16 collectives"));
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
  EXPECT_THAT(error_of([&] { broadcast(nc, 0); }), HasSubstr("not contiguous"));
  at::Tensor r = at::full({3}, 2.0);
  reduce(r, 0, ReduceOp::SUM);
  if (R() == 0) {
    EXPECT_EQ(r[0].item<double>(), 2.0 * N());
  }
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

namespace {
// Every rank's input for one call: values that differ between ranks and between elements, drawn from a
// seed that names the rank, so that each rank can regenerate all the others' inputs. `integral`: small
// integers, whose sums are exact in every dtype and order (|sum| <= 64 on 4 ranks, exact in bfloat16).
std::vector<at::Tensor> inputs_of_all_ranks(int64_t n, at::ScalarType dt, bool integral, int call) {
  std::vector<at::Tensor> in;
  for (int r = 0; r < N(); ++r) {
    auto g = at::make_generator<at::CPUGeneratorImpl>(100000 * call + r);
    in.push_back((integral ? at::randint(-16, 17, {n}, g, at::kDouble) : at::randn({n}, g, at::kDouble)).to(dt));
  }
  return in;
}

// Unit roundoff of each floating dtype, for the bound on a sum's rounding error.
double eps_of(at::ScalarType dt) {
  switch (dt) {
    case at::kDouble:
      return 0x1p-52;
    case at::kFloat:
      return 0x1p-23;
    case at::kHalf:
      return 0x1p-10;
    default:
      return 0x1p-7;  // bfloat16
  }
}
}  // namespace

// all_reduce of rank-dependent, non-constant data, element by element against the sum of every rank's
// input computed here. A constant fill cannot show a chunk reduced twice, a part taken from the wrong
// rank or the wrong offset, or a tail left out; these inputs do. Lengths straddle chunk boundaries
// (1 KiB of elements per chunk with 4 KiB slots; DDP's default 1 MiB slots too), on three layouts of
// simulated hosts: one host; ranks 0-1 | the rest; even | odd ranks (the hosts' leaders are then 0 and 1
// and their local ranks are not contiguous). With 3 and 4 ranks the last two are hierarchical:
// shared memory inside each host, Gloo between the leaders, shared memory again to spread the result.
TEST(Shm, AllReduceOfRankDependentDataEqualsTheSumOfEveryRanksInputs) {
  struct Layout {
    const char* name;
    std::string (*host)(int rank);
  };
  const Layout layouts[] = {{"one host", [](int) { return std::string("one"); }},
                            {"0-1 | rest", [](int r) { return std::string(r < 2 ? "a" : "b"); }},
                            {"even | odd", [](int r) { return std::string(r % 2 ? "odd" : "even"); }}};
  const std::pair<const char*, std::vector<int64_t>> slots[] = {{"4096", {1, 3, 1021, 5003, 70001}},
                                                                {"1048576", {1, 300007}}};
  int call = 0;
  for (const Layout& layout : layouts)
    for (const auto& [slot_bytes, lengths] : slots) {
      Group g = [&, slot_bytes = slot_bytes] {  // a structured binding: captured by name
        EnvOverride host("DTRAIN_SHM_HOST", layout.host(R()));
        EnvOverride slot("DTRAIN_SHM_SLOT_BYTES", slot_bytes);
        return new_group({});
      }();
      int on_my_host = 0;
      bool some_host_shared = false;
      for (int r = 0; r < N(); ++r) {
        on_my_host += layout.host(r) == layout.host(R());
        for (int k = 0; k < r; ++k) some_host_shared = some_host_shared || layout.host(k) == layout.host(r);
      }
      ASSERT_EQ(g.uses_shared_memory(), on_my_host > 1) << layout.name;
      for (auto dt : {at::kFloat, at::kDouble, at::kHalf, at::kBFloat16}) {
        // With no two ranks on a host the group is Gloo alone, and Gloo 1.13 has no bfloat16.
        if (dt == at::kBFloat16 && !some_host_shared) continue;
        for (int64_t n : lengths)
          for (bool integral : {true, false}) {
            const std::string where = std::string(layout.name) + ", slots of " + slot_bytes + ", " + c10::toString(dt) +
                                      ", n=" + std::to_string(n) + (integral ? ", integers" : ", normal");
            auto in = inputs_of_all_ranks(n, dt, integral, ++call);
            at::Tensor sum = at::zeros({n}, at::kDouble), abs_sum = at::zeros({n}, at::kDouble);
            for (const auto& x : in) {
              sum += x.to(at::kDouble);
              abs_sum += x.to(at::kDouble).abs();
            }
            at::Tensor t = in[R()].clone();
            all_reduce(t, ReduceOp::SUM, g);
            at::Tensor err = (t.to(at::kDouble) - sum).abs();
            if (integral) {
              EXPECT_EQ(err.max().item<double>(), 0.0)
                  << where << ": first wrong element " << err.nonzero().min().item<int64_t>();
            } else {
              // Each of the N - 1 additions rounds once (bfloat16: the leaders add in float32):
              // |error| <= N * eps * sum |x_r|. A missing or misplaced part is off by a whole input.
              at::Tensor excess = err - N() * eps_of(dt) * abs_sum;
              EXPECT_LE(excess.max().item<double>(), 0.0)
                  << where << ": first element beyond rounding " << (excess > 0).nonzero().min().item<int64_t>();
            }
            t = in[R()].clone();
            all_reduce(t, ReduceOp::MAX, g);
            EXPECT_TRUE(at::equal(t, at::stack(in).amax(0))) << where << " (MAX)";
          }
      }
    }
}

TEST(Shm, RequiredWithoutASharedHostFailsOnEveryRank) {
  EnvOverride required("DTRAIN_SHM", "1");
  std::string err = error_of([] { group_with_env("DTRAIN_SHM_HOST", "h" + std::to_string(R())); });
  EXPECT_THAT(err, HasSubstr("DTRAIN_SHM=1 but no two of the group's")) << err;
}

TEST(Shm, MismatchedShapesFailEveryRankNamingBothCalls) {
  Group g = new_group({});  // it is unusable afterwards
  ASSERT_TRUE(g.uses_shared_memory());
  at::Tensor t = at::ones({R() == 0 ? 8 : 16});
  std::string err = error_of([&] { all_reduce(t, ReduceOp::SUM, g); });
  EXPECT_THAT(err, HasSubstr("mismatched collectives")) << err;
  if (R() < 2) {
    EXPECT_THAT(err, HasSubstr("all_reduce of 8 float32 (SUM)")) << err;
  }
  EXPECT_EQ(err.rfind("rank " + std::to_string(R()) + ": ", 0), 0u) << err;  // names this rank first
  EXPECT_NE(error_of([&] { all_reduce(t, ReduceOp::SUM, g); }), "");
}

// Point-to-point over shared memory (Note [Shared-memory point-to-point]): a ring of isend/irecv
// over every dtype and sizes from empty to several times the 1 MiB ring, against Gloo's group.
TEST(Shm, SendRecvInARingMatchesGlooForEveryDtypeAndSize) {
  Group shm = new_group({});
  Group gloo = group_with_env("DTRAIN_SHM", "0");
  ASSERT_TRUE(shm.uses_shared_memory());
  ASSERT_FALSE(gloo.uses_shared_memory());
  const int next = (R() + 1) % N(), prev = (R() + N() - 1) % N();
  for (auto dt : {at::kFloat, at::kDouble, at::kBFloat16, at::kLong, at::kByte, at::kBool}) {
    for (int64_t n : {int64_t{0}, int64_t{1}, int64_t{1000}, int64_t{3} << 20}) {
      at::Tensor mine = rank_data(n, at::kFloat, R()).reshape({n == 1000 ? 10 : 1, -1}).to(dt);
      at::Tensor from_shm = at::empty_like(mine), from_gloo = at::empty_like(mine);
      for (auto* g : {&shm, &gloo}) {
        Work s = isend(mine, next, *g, /*tag=*/7);
        Work r = irecv(g == &shm ? from_shm : from_gloo, prev, *g, 7);
        r.wait();
        s.wait();
      }
      at::Tensor expected = rank_data(n, at::kFloat, prev).reshape(mine.sizes()).to(dt);
      EXPECT_TRUE(at::equal(from_shm, expected)) << dt << " " << n;
      EXPECT_TRUE(at::equal(from_gloo, expected)) << dt << " " << n;
    }
  }
}

TEST(Shm, SendRecvOfDifferentShapesFailsBothRanksWithOneLine) {
  Group g = new_group({});  // the pair 0-1 is unusable afterwards
  ASSERT_TRUE(g.uses_shared_memory());
  if (R() > 1) return;
  std::string err = error_of([&] {
    if (R() == 0) {
      send(at::ones({4}), 1, g, /*tag=*/3);
    } else {
      at::Tensor t = at::empty({5});
      recv(t, 0, g, 3);
    }
  });
  EXPECT_THAT(err,
              HasSubstr("rank 1: recv from rank 0 (tag 3) expected Float [5] but rank 0 sent Float [4]: sender and "
                        "receiver must pass tensors of the same dtype and shape"))
      << err;
  EXPECT_THAT(err, Not(HasSubstr("\n"))) << err;
  std::string later = error_of([&] {
    at::Tensor t = at::ones({5});
    if (R() == 0)
      send(t, 1, g, 4);
    else
      recv(t, 0, g, 4);
  });
  EXPECT_THAT(later, HasSubstr("expected Float [5] but rank 0 sent Float [4]")) << later;
}

namespace {

// Values whose sums over ranks are exact in float: (i % 251) * (rank + 1).
at::Tensor pattern(int64_t numel) { return at::arange(numel, at::kLong).remainder(251).to(at::kFloat); }

void check_all_reduce(const Group& g, int64_t numel, const std::string& what) {
  const int n = g.size();
  at::Tensor t = pattern(numel) * static_cast<float>(g.rank() + 1);
  all_reduce(t, ReduceOp::SUM, g);
  DTRAIN_CHECK(at::equal(t, pattern(numel) * static_cast<float>(n * (n + 1) / 2)), what, ": wrong sums");
  std::cout << what << ": all_reduce of " << (numel * 4 >> 20) << " MiB over " << n
            << " ranks right, shared memory: " << (g.uses_shared_memory() ? "yes" : "no") << std::endl;
}

void wait_for_file(const std::string& path) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (access(path.c_str(), F_OK) != 0) {
    DTRAIN_CHECK(std::chrono::steady_clock::now() < deadline, "rank ", R(), ": ", path, " did not appear in 30 s");
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

int small_shm_mode(int64_t mib, const std::string& pause_dir) {
  try {
    init_process_group(InitOptions().timeout(std::chrono::seconds(60)));
    check_all_reduce(Group(), mib << 18, "default group");
    if (!pause_dir.empty()) {
      std::ofstream(pause_dir + "/ready." + std::to_string(R())) << "ready\n";
      wait_for_file(pause_dir + "/filled");
      // Every rank sends to the next and receives from the one before, through rings never written yet.
      const int64_t numel = int64_t{1} << 20;
      at::Tensor out = pattern(numel) + R(), in = at::empty({numel});
      const int next = (R() + 1) % N(), prev = (R() + N() - 1) % N();
      Work sent = isend(out, next);
      recv(in, prev);
      sent.wait();
      DTRAIN_CHECK(at::equal(in, pattern(numel) + prev), "rank ", R(), ": wrong bytes received from rank ", prev);
      std::cout << "default group: send/recv of 4 MiB right, shared memory: "
                << (Group().uses_shared_memory() ? "yes" : "no") << std::endl;
      Group later = new_group({});
      check_all_reduce(later, mib << 18, "later group");
      check_all_reduce(Group(), mib << 18, "default group again");
    }
    destroy_process_group();
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "shm_dist_test: error: " << e.what() << std::endl;
    return 1;
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc > 2 && std::string(argv[1]) == "--all_reduce_mib")
    return small_shm_mode(std::stoll(argv[2]), argc > 4 && std::string(argv[3]) == "--fill_pause" ? argv[4] : "");
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
