// bench_tp: tensor parallelism on one host. A wide MLP block (Linear 1024 -> 4096, tanh,
// Linear 4096 -> 1024, batch 256, float32) split ColwiseParallel -> RowwiseParallel over 2 ranks of
// one thread each, against the whole block in one process with 2 threads on the same cores.
//
//   ./build/bin/bench_tp [--steps 10] [--rounds 3]
//
// A step is forward, a mean-square loss, backward and an SGD step. Each round runs the 2-rank job
// and then the 1-process job (its own job of one rank, at::set_num_threads(2)), so the two alternate
// under the same load; each job prints its median step time, and the driver reports the median over
// rounds of each round's ratio. The 2-rank job also times the step's two activation all-reduces
// ([256, 1024] float32, one in forward and one in backward) alone, and reports their share of its
// step. Parameter bytes per rank come from the sharded model itself.
//   RESULT tp2_step_vs_one_process=R tp2_allreduce_fraction=F tp2_weight_bytes_fraction=W
//   goals: R <= 1.15, W <= 0.51
#include <cstdio>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <CLI/CLI.hpp>
#include <torch/optim/sgd.h>

#include "dtrain/device_mesh.h"
#include "dtrain/process_group.h"
#include "dtrain/tensor_parallel.h"
#include "spawn.h"

namespace {

using namespace bench;

constexpr int64_t kDim = 1024, kHidden = 4096, kBatch = 256;

struct MLPImpl : torch::nn::Module {
  dtrain::ParallelLinear w1{register_module("w1", dtrain::ParallelLinear(kDim, kHidden))};
  dtrain::ParallelLinear w2{register_module("w2", dtrain::ParallelLinear(kHidden, kDim))};
  at::Tensor forward(const at::Tensor& x) { return w2(torch::tanh(w1(x))); }
};
TORCH_MODULE(MLP);

int64_t param_bytes(torch::nn::Module& m) {
  int64_t bytes = 0;
  for (const auto& p : m.parameters()) bytes += p.numel() * static_cast<int64_t>(p.element_size());
  return bytes;
}

// The median time of `steps` calls of fn after two warm-up calls, in ms.
template <typename Fn>
double median_ms(int steps, Fn fn) {
  fn();
  fn();
  std::vector<double> s;
  for (int i = 0; i < steps; ++i) {
    const auto t0 = Clock::now();
    fn();
    s.push_back(secs_since(t0));
  }
  return 1e3 * median(s);
}

int worker_main(int argc, char** argv) {
  CLI::App app{"bench_tp worker"};
  int steps = 10, threads = 1;
  app.add_option("--steps", steps);
  app.add_option("--threads", threads);
  CLI11_PARSE(app, argc, argv);
  at::set_num_threads(threads);
  dtrain::init_process_group();
  torch::manual_seed(0);
  MLP mlp;
  const int64_t whole_bytes = param_bytes(*mlp);
  const bool tp = dtrain::world_size() > 1;
  if (tp) {
    auto mesh = dtrain::init_device_mesh({dtrain::world_size()}, {"tp"});
    dtrain::parallelize_module(*mlp, mesh, {{"w1", dtrain::ColwiseParallel()}, {"w2", dtrain::RowwiseParallel()}});
  }
  torch::optim::SGD opt(mlp->parameters(), torch::optim::SGDOptions(1e-3));
  at::Tensor x = at::randn({kBatch, kDim});
  const double step_ms = median_ms(steps, [&] {
    opt.zero_grad();
    mlp(x).pow(2).mean().backward();
    opt.step();
  });
  double allreduce_ms = 0;
  if (tp) {
    at::Tensor act = at::randn({kBatch, kDim});
    allreduce_ms = 2 * median_ms(steps, [&] { dtrain::all_reduce(act); });
  }
  if (dtrain::rank() == 0)
    std::printf("step_ms=%.3f allreduce_ms=%.3f weight_bytes=%lld whole_bytes=%lld\n", step_ms, allreduce_ms,
                static_cast<long long>(param_bytes(*mlp)), static_cast<long long>(whole_bytes));
  dtrain::destroy_process_group();
  return 0;
}

int driver_main(int argc, char** argv) {
  CLI::App app{"Tensor parallelism: an MLP block on 2 ranks of one thread vs one process of 2 threads"};
  int steps = 10, rounds = 3;
  double timeout_s = 300;
  app.add_option("--steps", steps, "timed steps per job (median)");
  app.add_option("--rounds", rounds, "rounds of (2-rank job, 1-process job)");
  app.add_option("--timeout", timeout_s, "seconds per job");
  CLI11_PARSE(app, argc, argv);
  std::printf("bench_tp: MLP %lld -> %lld -> %lld, batch %lld, float32, load %s\n\n", static_cast<long long>(kDim),
              static_cast<long long>(kHidden), static_cast<long long>(kDim), static_cast<long long>(kBatch),
              load_average().c_str());
  std::printf(
      "| round | tp 2 ranks x 1 thread, step ms | 1 process x 2 threads, step ms | ratio | all-reduce share |\n"
      "|---|---|---|---|---|\n");
  std::vector<double> ratios, fractions;
  double weight_fraction = 0;
  for (int r = 0; r < rounds; ++r) {
    const std::string tp =
        run_job({self_exe(), "--worker", "--steps", std::to_string(steps), "--threads", "1"}, 2, timeout_s, "bench_tp");
    const std::string one =
        run_job({self_exe(), "--worker", "--steps", std::to_string(steps), "--threads", "2"}, 1, timeout_s, "bench_tp");
    const double tp_ms = parse_value(tp, "step_ms"), one_ms = parse_value(one, "step_ms");
    ratios.push_back(tp_ms / one_ms);
    fractions.push_back(parse_value(tp, "allreduce_ms") / tp_ms);
    weight_fraction = parse_value(tp, "weight_bytes") / parse_value(tp, "whole_bytes");
    std::printf("| %d | %.1f | %.1f | %.3f | %.3f |\n", r, tp_ms, one_ms, ratios.back(), fractions.back());
  }
  const double ratio = median(ratios);
  std::printf("\nstep ratio %.3f (goal <= 1.15: %s), weight bytes per rank %.4f of the whole (goal <= 0.51: %s)\n",
              ratio, ratio <= 1.15 ? "met" : "missed", weight_fraction, weight_fraction <= 0.51 ? "met" : "missed");
  std::printf("\nRESULT tp2_step_vs_one_process=%.3f tp2_allreduce_fraction=%.3f tp2_weight_bytes_fraction=%.4f\n",
              ratio, median(fractions), weight_fraction);
  return 0;
}

}  // namespace

int main(int argc, char** argv) { return bench::main_of("bench_tp", argc, argv, worker_main, driver_main); }
