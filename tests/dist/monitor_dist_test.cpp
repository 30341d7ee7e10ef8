// Monitoring and debug mode on real ranks: the merged trace, rank-0 aggregation with a slow rank,
// DTRAIN_DEBUG=INFO bucket logging and DETAIL catching mismatched collectives.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <thread>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>

#include "common/util.h"
#include "dist_main.h"
#include "dtrain/ddp.h"
#include "dtrain/monitor.h"
#include "svg_check.h"
#include "test_util.h"
#include "matchers.h"

namespace fs = std::filesystem;
using namespace dtrain;
using dtrain::test_util::error_of;

namespace {

// A folder every rank of this job names alike (they share the machine).
fs::path shared_dir(const std::string& what) {
  const char* port = std::getenv("MASTER_PORT");
  return fs::temp_directory_path() / ("dtrain_monitor_" + what + "_" + (port ? port : "0"));
}

// Several layers and tiny buckets: the first buckets are full (and start their all-reduce) while
// backward still computes the first layers' gradients.
torch::nn::Sequential mlp() {
  using namespace torch::nn;
  return Sequential(Linear(64, 256), ReLU(), Linear(256, 256), ReLU(), Linear(256, 256), ReLU(), Linear(256, 10));
}

}  // namespace

TEST(Monitor, TraceFromEveryRankShowsOverlapAndRankZeroFindsTheSlowRank) {
  const fs::path dir = shared_dir("trace");
  torch::manual_seed(0);
  auto model = mlp();
  DistributedDataParallel ddp(model, DDPOptions().first_bucket_cap_mb(0.05).bucket_cap_mb(0.1));
  ASSERT_GE(ddp.bucket_param_indices().size(), 3u);
  torch::optim::SGD opt(ddp.parameters(), 0.01);
  const int steps = 8;
  Monitor mon(MonitorOptions().output_dir(dir.string()).log_every(4).trace_steps(steps).progress(false));
  mon.watch(ddp);
  for (int s = 0; s < steps; ++s) {
    at::Tensor x = at::randn({32, 64}), loss;
    {
      auto p = mon.phase(Phase::kForward);
      if (rank() == 1) std::this_thread::sleep_for(std::chrono::milliseconds(30));  // the slow rank
      at::Tensor h = ddp(x);
      loss = h.pow(2).mean();
    }
    {
      auto p = mon.phase(Phase::kBackward);
      opt.zero_grad();
      loss.backward();
    }
    {
      auto p = mon.phase(Phase::kOptimizer);
      opt.step();
    }
    mon.end_step(StepInfo().loss(loss.item<double>()).samples(32).lr(0.01));
    EXPECT_GT(mon.last_step().comm_ms, 0.0) << "bucket all-reduces measured from their work handles";
  }
  mon.close();

  if (rank() == 0) {
    // Aggregation: two windows of 4 steps; rank 1 spends 30 ms more in forward.
    ASSERT_EQ(mon.windows().size(), 2u);
    for (const auto& w : mon.windows()) {
      EXPECT_EQ(w.forward_ms.max_rank, 1);
      EXPECT_GT(w.forward_ms.max - w.forward_ms.min, 20.0);
      EXPECT_NEAR(w.forward_ms.mean, (w.forward_ms.max + w.forward_ms.min) / 2, 1e-9);
      EXPECT_EQ(w.slowest_rank, 1) << "the rank the others wait for";
      EXPECT_GT(w.comm_wait_ms.max, 0.0);
      EXPECT_GT(w.samples_per_s, 0.0);
    }
    std::ifstream metrics(dir / "metrics.jsonl");
    int lines = 0;
    for (std::string l; std::getline(metrics, l); ++lines) EXPECT_EQ(nlohmann::json::parse(l)["slowest_rank"], 1);
    EXPECT_EQ(lines, 2);

    // The trace: valid JSON, events from both ranks, and on each rank a bucket all-reduce that
    // started before autograd finished (the "ddp wait" span starts where backward's own work ends).
    auto trace = nlohmann::json::parse(dtrain::util::read_file(dir / "trace.json"));
    std::set<int> pids;
    std::map<std::pair<int, int64_t>, double> first_launch, wait_start;  // (rank, step) -> us
    for (const auto& e : trace["traceEvents"]) {
      if (e["ph"] != "X") continue;
      const int pid = e["pid"];
      pids.insert(pid);
      const int64_t step = e["args"]["step"];
      const std::string name = e["name"];
      const double ts = e["ts"];
      if (name.rfind("allreduce bucket", 0) == 0) {
        EXPECT_EQ(e["tid"], 1);
        auto key = std::make_pair(pid, step);
        if (!first_launch.count(key) || ts < first_launch[key]) first_launch[key] = ts;
      }
      if (name == "ddp wait for gradients") wait_start[{pid, step}] = ts;
    }
    EXPECT_EQ(pids, (std::set<int>{0, 1}));
    for (int r = 0; r < 2; ++r) {
      int overlapped = 0;
      for (int64_t s = 1; s <= steps; ++s) {
        auto key = std::make_pair(r, s);
        ASSERT_TRUE(first_launch.count(key) && wait_start.count(key)) << "rank " << r << " step " << s;
        overlapped += first_launch[key] < wait_start[key];
      }
      EXPECT_EQ(overlapped, steps) << "rank " << r << ": a bucket's all-reduce starts before backward ends";
    }
    EXPECT_FALSE(fs::exists(dir / "trace_rank0.part")) << "parts are removed after the merge";
    const std::string svg = dtrain::util::read_file(dir / "plot.svg");
    EXPECT_EQ(test_util::svg_problem(svg), "");
  }
  barrier();  // rank 1 removes its part after the gather: look only once it is past close()
  if (rank() == 0) {
    EXPECT_FALSE(fs::exists(dir / "trace_rank1.part")) << "parts are removed after the merge";
    fs::remove_all(dir);
  }
}

TEST(Monitor, InfoLogsBucketsAndSetupOnRankZero) {
  set_debug_level(DebugLevel::INFO);
  testing::internal::CaptureStderr();
  auto model = mlp();
  DistributedDataParallel ddp(model, DDPOptions().bucket_cap_mb(0.1));
  const std::string log = testing::internal::GetCapturedStderr();
  set_debug_level(DebugLevel::OFF);
  if (rank() == 0) {
    EXPECT_THAT(log, HasSubstr("[dtrain DDP] 8 parameters in")) << log;
    EXPECT_THAT(log, HasSubstr("bucket 0:")) << log;
    EXPECT_THAT(log, HasSubstr("6.weight")) << "parameter names: " << log;
    EXPECT_THAT(log, HasSubstr("find_unused_parameters")) << "setup options: " << log;
    // The ranks share a host: the buckets go through shared memory, and the line says so.
    EXPECT_THAT(log, HasSubstr("ranks (gloo, shared memory)")) << log;
  } else {
    EXPECT_THAT(log, Not(HasSubstr("[dtrain DDP]"))) << log;
  }
}

// docs/features.md: DETAIL turns a mismatch into an error on every rank "in milliseconds" instead of a hang.
// After a barrier both ranks call together, so the time is the check's own: a few store round
// trips, 0.2-0.3 ms here. The best of 3 tries must be under 100 ms (scaled under a sanitizer): a
// rank descheduled right after one barrier on a loaded machine cannot fail the claim alone.
TEST(DebugDetail, MismatchedAllReduceShapeFailsEveryRankWithinMilliseconds) {
  set_debug_level(DebugLevel::DETAIL);
  at::Tensor t = at::ones({rank() == 0 ? 4 : 5});
  std::string err;
  double best_ms = 1e9;
  for (int attempt = 0; attempt < 3; ++attempt) {
    barrier();
    const auto t0 = std::chrono::steady_clock::now();
    err = error_of([&] { all_reduce(t); });
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    std::printf("rank %d: DETAIL reported the mismatch after %.2f ms\n", rank(), ms);
    best_ms = std::min(best_ms, ms);
  }
  EXPECT_LT(best_ms, 100.0 * test_util::kTimeScale) << "instead of hanging";
  EXPECT_THAT(err, HasSubstr("rank " + std::to_string(rank()) + ": DTRAIN_DEBUG=DETAIL")) << err;
  EXPECT_THAT(err, HasSubstr("rank 0 calls all_reduce(Float[4], op=SUM)")) << err;
  EXPECT_THAT(err, HasSubstr("rank 1 calls all_reduce(Float[5], op=SUM)")) << err;

  // A different operation is caught too.
  at::Tensor u = at::ones({3});
  const std::string err2 = error_of([&] {
    if (rank() == 0)
      all_reduce(u);
    else
      broadcast(u, 0);
  });
  EXPECT_THAT(err2, HasSubstr("rank 0 calls all_reduce(Float[3], op=SUM) but rank 1 calls broadcast(Float[3], src=0)"))
      << err2;

  // No collective started: the group still works, checked.
  at::Tensor v = at::full({4}, rank() + 1.0f);
  all_reduce(v);
  EXPECT_FLOAT_EQ(v[0].item<float>(), 3.0f);
  set_debug_level(DebugLevel::OFF);
}

TEST(DebugDetail, DDPTrainsUnderDetail) {
  set_debug_level(DebugLevel::DETAIL);
  torch::manual_seed(0);
  auto model = mlp();
  DistributedDataParallel ddp(model, DDPOptions().first_bucket_cap_mb(0.05).bucket_cap_mb(0.1));
  ASSERT_GE(ddp.bucket_param_indices().size(), 3u) << "several checked bucket all-reduces per step";
  for (int s = 0; s < 3; ++s) ddp(at::randn({8, 64})).sum().backward();
  // Every rank holds the same averaged gradient.
  at::Tensor g = model[0]->as<torch::nn::Linear>()->weight.grad().sum().reshape({1});
  std::vector<at::Tensor> all{at::empty({1}), at::empty({1})};
  all_gather(all, g);
  EXPECT_FLOAT_EQ(all[0].item<float>(), all[1].item<float>());
  set_debug_level(DebugLevel::OFF);
}

DTRAIN_DIST_TEST_MAIN()
