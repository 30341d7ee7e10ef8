// bench_pipeline: step time of the tutorial's SimpleModel (Linear 128-256, ReLU, Linear 256-256, ReLU,
// Linear 256-10) split over 2 ranks (one stage each, 1 thread per rank, Gloo), for chunks 1, 2, 4, 8
// and both schedules, with the measured idle fraction against the theory (p - 1) / (m + p - 1).
//
//   ./build/bin/bench_pipeline [--batch 512] [--steps 40] [--warmup 5] [--reps 3]
//
// How: this binary is the driver and the worker. The driver starts each 2-rank job itself
// (bench/spawn.h: fork/exec of `bench_pipeline --worker ...` with RANK, WORLD_SIZE, MASTER_ADDR,
// MASTER_PORT and OMP_NUM_THREADS=1), one job per (schedule, chunks) and repetition, rotating the order
// each repetition. Each rank times its steps; from the pipeline's own per-step counters it takes the
// time inside its stage's forward/loss/backward ("compute"); idle = 1 - compute / step time, averaged
// over the ranks (an all-reduce), so idle includes the pipeline bubble, the communication and any
// imbalance between the two stages. The driver also times the unsplit model in one process on the
// same batch (1 thread) for scale. Adam steps are included in the step time.
// Last line: RESULT chunks1_ms=.. chunks2_ms=.. chunks4_ms=.. chunks8_ms=.. idle1=.. idle8=.. (1F1B)
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <CLI/CLI.hpp>
#include <torch/nn/functional/loss.h>
#include <torch/optim/adam.h>
#include <torch/utils.h>

#include "dtrain/pipeline.h"
#include "dtrain/process_group.h"
#include "dtrain/system.h"
#include "spawn.h"
#include "tutorial_models.h"

namespace {

using namespace bench;
constexpr int kWorld = 2;
constexpr int kBatches = 4;  // distinct pre-made batches, cycled

at::Tensor loss_fn(const at::Tensor& out, const at::Tensor& t) { return torch::nn::functional::cross_entropy(out, t); }

std::vector<std::pair<at::Tensor, at::Tensor>> make_batches(int64_t batch) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(3);
  std::vector<std::pair<at::Tensor, at::Tensor>> out;
  for (int i = 0; i < kBatches; ++i) out.emplace_back(at::randn({batch, 128}, gen), at::randint(0, 10, {batch}, gen));
  return out;
}

int worker_main(int argc, char** argv) {
  CLI::App app{"bench_pipeline worker"};
  std::string schedule;
  int64_t chunks = 1, batch = 512;
  int steps = 40, warmup = 5;
  app.add_option("--schedule", schedule)->required();
  app.add_option("--chunks", chunks)->required();
  app.add_option("--batch", batch);
  app.add_option("--steps", steps);
  app.add_option("--warmup", warmup);
  CLI11_PARSE(app, argc, argv);
  try {
    dtrain::reduce_allocator_churn();
    at::set_num_threads(1);
    dtrain::init_process_group();
    torch::manual_seed(0);
    tutorial::SimpleModel model;
    dtrain::Pipeline pipe(model->net, dtrain::PipelineOptions().chunks(chunks).schedule(
                                          schedule == "gpipe" ? dtrain::Schedule::kGPipe : dtrain::Schedule::k1F1B));
    torch::optim::Adam opt(pipe.parameters(), torch::optim::AdamOptions(1e-3));
    const auto batches = make_batches(batch);
    double step_s = 0, compute_s = 0;
    for (int i = 0; i < warmup + steps; ++i) {
      if (i == warmup) dtrain::barrier();
      const auto& [x, y] = batches[i % kBatches];
      const auto t0 = Clock::now();
      opt.zero_grad();
      pipe.step(x, y, loss_fn);
      opt.step();
      if (i >= warmup) {
        step_s += secs_since(t0);
        compute_s += pipe.last_step_stats().compute_s;
      }
    }
    // [step time, idle fraction] averaged over the ranks.
    at::Tensor r = at::tensor({step_s / steps, 1.0 - compute_s / step_s}, at::kDouble);
    dtrain::all_reduce(r, dtrain::ReduceOp::AVG);
    if (dtrain::rank() == 0)
      std::printf("balance=%lld+%lld step_ms=%.4f idle=%.4f\n", static_cast<long long>(pipe.balance()[0]),
                  static_cast<long long>(pipe.balance()[1]), r[0].item<double>() * 1e3, r[1].item<double>());
    dtrain::destroy_process_group();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_pipeline worker: error: %s\n", e.what());
    return 1;
  }
  return 0;
}

// The unsplit model in this process, the same batches: ms per step (median of reps).
double single_process_ms(int64_t batch, int steps, int warmup) {
  at::set_num_threads(1);
  torch::manual_seed(0);
  tutorial::SimpleModel model;
  torch::optim::Adam opt(model->parameters(), torch::optim::AdamOptions(1e-3));
  const auto batches = make_batches(batch);
  Clock::time_point t0;
  for (int i = 0; i < warmup + steps; ++i) {
    if (i == warmup) t0 = Clock::now();
    const auto& [x, y] = batches[i % kBatches];
    opt.zero_grad();
    loss_fn(model->forward(x), y).backward();
    opt.step();
  }
  return secs_since(t0) / steps * 1e3;
}

int driver_main(int argc, char** argv) {
  CLI::App app{"Pipeline step time and idle fraction, SimpleModel over 2 ranks"};
  int64_t batch = 512;
  int steps = 40, warmup = 5, reps = 3;
  double timeout_s = 300;
  app.add_option("--batch", batch, "samples per step (split into chunks micro-batches)");
  app.add_option("--steps", steps, "timed steps per job");
  app.add_option("--warmup", warmup, "untimed steps first");
  app.add_option("--reps", reps, "repetitions (the median is reported)");
  app.add_option("--timeout", timeout_s, "seconds per job");
  CLI11_PARSE(app, argc, argv);
  dtrain::reduce_allocator_churn();

  const std::vector<std::string> schedules = {"gpipe", "1f1b"};
  const std::vector<int64_t> chunk_list = {1, 2, 4, 8};
  std::map<std::string, std::vector<double>> ms, idle;
  std::vector<double> single;
  std::string balance;
  std::printf("bench_pipeline: SimpleModel over %d ranks, batch %lld, %d timed steps, %d reps, load %s\n", kWorld,
              static_cast<long long>(batch), steps, reps, load_average().c_str());
  for (int rep = 0; rep < reps; ++rep) {
    std::vector<std::pair<std::string, int64_t>> jobs;
    for (const auto& s : schedules)
      for (int64_t c : chunk_list) jobs.emplace_back(s, c);
    std::rotate(jobs.begin(), jobs.begin() + rep % jobs.size(), jobs.end());
    for (const auto& [s, c] : jobs) {
      const std::string out =
          run_job({self_exe(), "--worker", "--schedule", s, "--chunks", std::to_string(c), "--batch",
                   std::to_string(batch), "--steps", std::to_string(steps), "--warmup", std::to_string(warmup)},
                  kWorld, timeout_s, "bench_pipeline");
      const std::string key = s + "/" + std::to_string(c);
      ms[key].push_back(parse_value(out, "step_ms"));
      idle[key].push_back(parse_value(out, "idle"));
      balance = parse_line(out, "balance=").substr(0, parse_line(out, "balance=").find(' '));
    }
    single.push_back(single_process_ms(batch, steps, warmup));
  }
  std::printf("stages: %s (layers per rank, balanced by parameter count); unsplit model, 1 process: %.3f ms/step\n\n",
              balance.c_str(), median(single));
  std::printf(
      "| schedule | chunks | micro-batch | step ms (median) | all runs | idle measured | idle theory (p-1)/(m+p-1) "
      "|\n");
  std::printf("|---|---|---|---|---|---|---|\n");
  for (const auto& s : schedules)
    for (int64_t c : chunk_list) {
      const std::string key = s + "/" + std::to_string(c);
      std::string runs;
      for (double v : ms[key]) runs += (runs.empty() ? "" : " ") + std::to_string(v).substr(0, 6);
      const double theory = (kWorld - 1.0) / (c + kWorld - 1.0);
      std::printf("| %s | %lld | %lld | %.3f | %s | %.3f | %.3f |\n", s == "gpipe" ? "GPipe" : "1F1B",
                  static_cast<long long>(c), static_cast<long long>(batch / c), median(ms[key]), runs.c_str(),
                  median(idle[key]), theory);
    }
  auto m = [&](int64_t c) { return median(ms["1f1b/" + std::to_string(c)]); };
  auto i = [&](int64_t c) { return median(idle["1f1b/" + std::to_string(c)]); };
  std::printf(
      "\nRESULT chunks1_ms=%.3f chunks2_ms=%.3f chunks4_ms=%.3f chunks8_ms=%.3f idle1=%.3f idle2=%.3f "
      "idle4=%.3f idle8=%.3f single_ms=%.3f\n",
      m(1), m(2), m(4), m(8), i(1), i(2), i(4), i(8), median(single));
  return 0;
}

}  // namespace

int main(int argc, char** argv) { return bench::main_of("bench_pipeline", argc, argv, worker_main, driver_main); }
