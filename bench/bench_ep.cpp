// bench_ep: expert parallelism on one host. A mixture-of-experts block (dtrain::MoE: dim 512, 8
// SwiGLU experts of hidden 1024, top-2, float32) over 4096 tokens per step, forward, a mean-square
// loss plus the auxiliary loss, backward and an SGD step:
//   - expert parallel: 2 ranks of one thread, 4 experts each, each rank its own 2048 tokens,
//     dispatched to the experts' ranks with all_to_all_single and back;
//   - one process holding all 8 experts, 2 threads on the same cores, the 4096 tokens at once.
// Each round runs the 2-rank job and then the 1-process job, so the two alternate under the same load;
// each job prints its median step time, and the driver reports the median over rounds of each round's
// ratio, with the 2-rank job's share of the step spent in its exchanges (the all-to-alls of one
// forward, timed alone on the last step's splits, times two for backward).
//   RESULT ep_step_vs_one_process=R ep_exchange_fraction=F   (reported; no goal)
//
//   ./build/bin/bench_ep [--steps 10] [--rounds 3]
#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <CLI/CLI.hpp>
#include <torch/optim/sgd.h>

#include "dtrain/expert_parallel.h"
#include "dtrain/process_group.h"
#include "spawn.h"

namespace {

using namespace bench;

constexpr int64_t kDim = 512, kHidden = 1024, kExperts = 8, kTokens = 4096;

int worker_main(int argc, char** argv) {
  CLI::App app{"bench_ep worker"};
  int steps = 10, threads = 1;
  app.add_option("--steps", steps);
  app.add_option("--threads", threads);
  CLI11_PARSE(app, argc, argv);
  at::set_num_threads(threads);
  dtrain::init_process_group();
  const int64_t n = dtrain::world_size();
  torch::manual_seed(0);  // every rank the same whole experts, each keeping its own
  dtrain::MoEOptions options(kDim, kHidden, kExperts);
  if (n > 1) options.ep_group(dtrain::Group());
  dtrain::MoE moe(options);
  torch::optim::SGD opt(moe->parameters(), torch::optim::SGDOptions(1e-3));
  torch::manual_seed(1 + static_cast<uint64_t>(dtrain::rank()));
  const at::Tensor x = at::randn({kTokens / n, kDim});
  std::vector<double> secs;
  for (int i = 0; i <= steps; ++i) {
    if (n > 1) dtrain::barrier();
    const auto t0 = Clock::now();
    opt.zero_grad();
    const at::Tensor y = moe(x);  // before aux_loss(), which the forward sets
    (y.pow(2).mean() + 0.01 * moe->aux_loss()).backward();
    opt.step();
    if (i > 0) secs.push_back(secs_since(t0));
  }
  double exchange_ms = 0;
  if (n > 1) {  // the last forward's two token exchanges, alone, times two for backward's
    const dtrain::MoEDispatch& d = moe->last_dispatch();
    int64_t sent = 0, got = 0;
    for (int64_t c : d.send_counts) sent += c;
    for (int64_t c : d.recv_counts) got += c;
    at::Tensor in = at::randn({sent, kDim}), out = at::empty({got, kDim});
    std::vector<double> t;
    for (int i = 0; i <= steps; ++i) {
      dtrain::barrier();
      const auto t0 = Clock::now();
      dtrain::all_to_all_single(out, in, d.recv_counts, d.send_counts);
      dtrain::all_to_all_single(in, out, d.send_counts, d.recv_counts);
      if (i > 0) t.push_back(secs_since(t0));
    }
    exchange_ms = 2e3 * median(t);
  }
  if (dtrain::rank() == 0) std::printf("step_ms=%.3f exchange_ms=%.3f\n", 1e3 * median(secs), exchange_ms);
  dtrain::destroy_process_group();
  return 0;
}

int driver_main(int argc, char** argv) {
  CLI::App app{"Expert parallelism: a MoE block on 2 ranks of one thread vs one process of 2 threads"};
  int steps = 10, rounds = 3;
  double timeout_s = 600;
  app.add_option("--steps", steps, "timed steps per job (median)");
  app.add_option("--rounds", rounds, "rounds of (2-rank job, 1-process job)");
  app.add_option("--timeout", timeout_s, "seconds per job");
  CLI11_PARSE(app, argc, argv);
  std::printf("bench_ep: MoE dim %lld, %lld SwiGLU experts of %lld, top-2, %lld tokens per step, float32; load %s\n\n",
              static_cast<long long>(kDim), static_cast<long long>(kExperts), static_cast<long long>(kHidden),
              static_cast<long long>(kTokens), load_average().c_str());
  std::printf(
      "| round | ep 2 x 1 thread: step ms | 1 process x 2 threads: step ms | ratio | exchange share |\n"
      "|---|---|---|---|---|\n");
  std::vector<double> ratios, fractions;
  for (int r = 0; r < rounds; ++r) {
    auto args = [&](const char* threads) {
      return std::vector<std::string>{self_exe(), "--worker", "--steps", std::to_string(steps), "--threads", threads};
    };
    const std::string ep = run_job(args("1"), 2, timeout_s, "bench_ep");
    const std::string one = run_job(args("2"), 1, timeout_s, "bench_ep");
    const double ep_ms = parse_value(ep, "step_ms"), one_ms = parse_value(one, "step_ms");
    ratios.push_back(ep_ms / one_ms);
    fractions.push_back(parse_value(ep, "exchange_ms") / ep_ms);
    std::printf("| %d | %.1f | %.1f | %.3f | %.3f |\n", r, ep_ms, one_ms, ratios.back(), fractions.back());
  }
  std::printf("\nstep ratio %.3f (%.3f-%.3f), exchanges %.3f of the 2-rank step\n", median(ratios),
              *std::min_element(ratios.begin(), ratios.end()), *std::max_element(ratios.begin(), ratios.end()),
              median(fractions));
  std::printf("\nRESULT ep_step_vs_one_process=%.3f ep_exchange_fraction=%.3f\n", median(ratios), median(fractions));
  return 0;
}

}  // namespace

int main(int argc, char** argv) { return bench::main_of("bench_ep", argc, argv, worker_main, driver_main); }
