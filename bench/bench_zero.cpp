// bench_zero: optimizer-state bytes per rank with ZeroRedundancyOptimizer (Adam) on a 21 M-parameter
// MLP (20 x Linear 1024-1024), on 1, 2 and 4 ranks of this host.
//
//   ./build/bin/bench_zero
//
// Each job trains one step under DDP with ZeroRedundancyOptimizer(Adam), then every rank measures
// the tensors of its own optimizer state (local_state_bytes(): numel * element_size of Adam's two
// moment tensors per parameter); the job prints the largest rank's bytes and the sum over
// ranks. The 1-rank job's sum is the unsharded state. Ratios over it:
//   RESULT zero_state_fraction_2=X zero_state_fraction_4=Y zero_step_ms_2=T   (goal: fractions <= 1/N + 0.05)
// The partition deals out whole parameters, balancing elements, so the largest share can exceed 1/N
// by up to one parameter: 20 layers of 1 M weights each (rather than 5 of 4 M) keep that small.
// Each job then times --steps more opt.step() calls (the sharded Adam step and the broadcast of every
// share) and prints rank 0's median: `step_ms` per rank count, and RESULT's zero_step_ms_2 (2 ranks).
#include <cstdio>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <CLI/CLI.hpp>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adam.h>

#include "dtrain/ddp.h"
#include "dtrain/process_group.h"
#include "dtrain/zero.h"
#include "spawn.h"

namespace {

using namespace bench;

constexpr int64_t kWidth = 1024;
constexpr int kLayers = 20;

int worker_main(int argc, char** argv) {
  CLI::App app{"bench_zero worker"};
  int steps = 7;
  app.add_option("--steps", steps, "timed steps after the first");
  CLI11_PARSE(app, argc, argv);
  at::set_num_threads(1);
  dtrain::init_process_group();
  torch::manual_seed(0);
  torch::nn::Sequential net;
  for (int i = 0; i < kLayers; ++i) {
    net->push_back(torch::nn::Linear(kWidth, kWidth));
    net->push_back(torch::nn::Tanh());
  }
  int64_t params = 0;
  for (const auto& p : net->parameters()) params += p.numel();
  dtrain::DistributedDataParallel ddp(net);
  dtrain::ZeroRedundancyOptimizer opt(ddp.parameters(),
                                      dtrain::optimizer_factory<torch::optim::Adam>(torch::optim::AdamOptions(1e-3)));
  opt.zero_grad();
  ddp(at::randn({4, kWidth})).pow(2).mean().backward();
  opt.step();
  const int64_t mine = opt.local_state_bytes();
  const int64_t most = dtrain::all_reduce_values(std::vector<int64_t>{mine}, dtrain::ReduceOp::MAX)[0];
  const int64_t total = dtrain::all_reduce_values(std::vector<int64_t>{mine}, dtrain::ReduceOp::SUM)[0];
  // The gradients stay as they are: each step is the same work (Adam on this rank's share, then
  // every share broadcast from its owner).
  std::vector<double> step_s;
  for (int i = 0; i < steps; ++i) {
    const auto t0 = Clock::now();
    opt.step();
    step_s.push_back(secs_since(t0));
  }
  if (dtrain::rank() == 0)
    std::printf("params=%lld state_bytes_max=%lld state_bytes_total=%lld step_ms=%.2f\n",
                static_cast<long long>(params), static_cast<long long>(most), static_cast<long long>(total),
                1e3 * median(step_s));
  dtrain::destroy_process_group();
  return 0;
}

int driver_main(int argc, char** argv) {
  CLI::App app{"Optimizer-state bytes per rank with ZeroRedundancyOptimizer (Adam), 1 vs 2 vs 4 ranks"};
  double timeout_s = 300;
  int steps = 7;
  app.add_option("--timeout", timeout_s, "seconds per job");
  app.add_option("--steps", steps, "timed steps per job (rank 0's median reported)");
  CLI11_PARSE(app, argc, argv);
  std::printf("bench_zero: Adam state per rank, %d x Linear %lld-%lld under DDP, load %s\n\n", kLayers,
              static_cast<long long>(kWidth), static_cast<long long>(kWidth), load_average().c_str());
  std::printf(
      "| ranks | state bytes, largest rank | over unsharded | goal | step ms (median of %d) |\n"
      "|---|---|---|---|---|\n",
      steps);
  double unsharded = 0, fraction[5] = {0, 0, 0, 0, 0}, step_ms[5] = {0, 0, 0, 0, 0};
  for (int n : {1, 2, 4}) {
    const std::string out =
        run_job({self_exe(), "--worker", "--steps", std::to_string(steps)}, n, timeout_s, "bench_zero");
    const double most = parse_value(out, "state_bytes_max"), total = parse_value(out, "state_bytes_total");
    if (n == 1) unsharded = total;
    fraction[n] = most / unsharded;
    step_ms[n] = parse_value(out, "step_ms");
    std::printf("| %d | %s (of %s in all) | %.3f | %s | %.1f |\n", n, human_bytes(static_cast<size_t>(most)).c_str(),
                human_bytes(static_cast<size_t>(total)).c_str(), fraction[n],
                n == 1 ? "-" : (fraction[n] <= 1.0 / n + 0.05 ? "<= 1/N + 0.05: met" : "<= 1/N + 0.05: missed"),
                step_ms[n]);
  }
  std::printf("\nRESULT zero_state_fraction_2=%.3f zero_state_fraction_4=%.3f zero_step_ms_2=%.1f\n", fraction[2],
              fraction[4], step_ms[2]);
  return 0;
}

}  // namespace

int main(int argc, char** argv) { return bench::main_of("bench_zero", argc, argv, worker_main, driver_main); }
