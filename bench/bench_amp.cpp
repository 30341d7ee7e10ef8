// bench_amp: float32 vs autocast (bfloat16) training-step time of the tutorial's CNN (TrainModel,
// batch 32, Adam) on this CPU, one process. Variants, interleaved over repetitions, median reported:
//   fp32          plain float32 step
//   autocast      Autocast(kCPU) forward + loss, float32 master weights
//   autocast+gs   the same with GradScaler scale/unscale_/step/update (what the tutorial runs)
//
//   build/bin/bench_amp [--threads 1] [--steps 20] [--reps 3]
// Last line: RESULT fp32_ms=... autocast_ms=... autocast_speedup=... scaler_overhead=...
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <map>

#include <ATen/Parallel.h>
#include <CLI/CLI.hpp>
#include <torch/nn/functional/loss.h>
#include <torch/optim/adam.h>

#include "dtrain/amp.h"
#include "spawn.h"
#include "tutorial_models.h"

namespace {

double step_ms(const std::string& variant, int steps) {
  torch::manual_seed(0);
  tutorial::TrainModel model;
  torch::optim::Adam opt(model->parameters(), 1e-3);
  dtrain::GradScaler scaler(dtrain::GradScalerOptions().enabled(variant == "autocast+gs"));
  at::Tensor x = at::randn({32, 3, 32, 32}), y = at::randint(0, 10, {32});
  auto one = [&] {
    opt.zero_grad();
    at::Tensor loss;
    {
      dtrain::Autocast ac(at::kCPU, at::kBFloat16, /*enabled=*/variant != "fp32");
      loss = torch::nn::functional::cross_entropy(model(x), y);
    }
    scaler.scale(loss).backward();
    scaler.step(opt);
    scaler.update();
  };
  for (int i = 0; i < 3; ++i) one();  // warm-up
  auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < steps; ++i) one();
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count() / steps;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"bench_amp: float32 vs autocast step time of the tutorial's CNN"};
  int threads = 1, steps = 20, reps = 3;
  app.add_option("--threads", threads, "intra-op threads");
  app.add_option("--steps", steps, "timed steps per repetition");
  app.add_option("--reps", reps, "repetitions (median reported)");
  CLI11_PARSE(app, argc, argv);
  at::set_num_threads(threads);

  const std::vector<std::string> variants{"fp32", "autocast", "autocast+gs"};
  std::map<std::string, std::vector<double>> runs;
  for (int r = 0; r < reps; ++r)
    for (const auto& v : variants) runs[v].push_back(step_ms(v, steps));

  std::printf("TrainModel (CNN 3x32x32), batch 32, Adam, %d thread(s), %d steps x %d reps\n", threads, steps, reps);
  std::printf("%-12s %10s   runs (ms/step)\n", "variant", "median ms");
  for (const auto& v : variants) {
    std::printf("%-12s %10.2f  ", v.c_str(), bench::median(runs[v]));
    for (double x : runs[v]) std::printf(" %.2f", x);
    std::printf("\n");
  }
  const double fp32 = bench::median(runs["fp32"]), ac = bench::median(runs["autocast"]),
               gs = bench::median(runs["autocast+gs"]);
  std::printf("RESULT fp32_ms=%.2f autocast_ms=%.2f autocast_speedup=%.2f scaler_overhead=%.3f\n", fp32, ac, fp32 / ac,
              gs / ac);
  return 0;
}
