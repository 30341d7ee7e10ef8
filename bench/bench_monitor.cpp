// bench_monitor: what monitoring and DTRAIN_DEBUG=DETAIL cost per training step of the tutorial's CNN
// (TrainModel, batch 32 per rank, Adam, DDP, 1 thread per rank).
//
// Each repetition starts a 1-rank job and a 2-rank job. Inside a job the variants run interleaved in
// blocks of steps on the same model (so drift and load hit them alike):
//   off      the plain DDP step (forward, loss, backward, step, loss.item())
//   on       the same step inside a dtrain::Monitor: phase scopes, end_step with loss/samples/lr, the
//            gradient norm, DDP's bucket events, progress lines, metrics.jsonl every block (one
//            all_gather per --steps steps), and the timeline of the first 100 steps
//   detail   the plain step with DTRAIN_DEBUG=DETAIL (a store check before every collective; 2 ranks)
//   mlp, mlp_unrecorded
//            a DDP step of a small MLP (784-256-10, batch 32: short, so a per-call cost shows most)
//            with the flight recorder on (the default) and paused (set_flight_recorder_enabled)
// ms/step is rank 0's wall time per step (median over repetitions). The overheads in the RESULT line
// are medians of paired-block ratios (each block against the "off" block next to it), which cancels
// the drift and the other jobs' load that dominate totals on a shared 2-core machine.
//
//   build/bin/bench_monitor [--reps 3] [--blocks 8] [--steps 5]
// Last line: RESULT monitor_overhead_1rank=... monitor_overhead_2rank=... detail_overhead=...
//            flight_overhead_1rank=... flight_overhead_2rank=... (the MLP step's, recorder on vs paused)
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <map>

#include <unistd.h>

#include <ATen/Parallel.h>
#include <CLI/CLI.hpp>

#include "cli_checks.h"
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adam.h>

#include "dtrain/ddp.h"
#include "dtrain/monitor.h"
#include "dtrain/system.h"
#include "spawn.h"
#include "tutorial_models.h"

namespace {

using Clock = std::chrono::steady_clock;

int worker_main(int argc, char** argv) {
  dtrain::reduce_allocator_churn();  // as the trainer does: Note [malloc churn]
  CLI::App app{"bench_monitor worker"};
  int blocks = 4, steps = 10, warmup = 3;
  app.add_option("--blocks", blocks);
  app.add_option("--steps", steps);
  app.add_option("--warmup", warmup);
  CLI11_PARSE(app, argc, argv);
  try {
    at::set_num_threads(1);
    dtrain::init_process_group();
    const int rank = dtrain::rank(), world = dtrain::world_size();
    torch::manual_seed(0);
    tutorial::TrainModel model;
    dtrain::DistributedDataParallel ddp(model);
    torch::optim::Adam opt(ddp.parameters(), 1e-3);
    at::Tensor x = at::randn({32, 3, 32, 32}), y = at::randint(0, 10, {32});

    auto plain = [&] {
      opt.zero_grad();
      at::Tensor loss = torch::nn::functional::cross_entropy(ddp(x), y);
      loss.backward();
      opt.step();
      return loss.item<double>();
    };
    const std::string dir =
        (std::filesystem::temp_directory_path() / ("bench_monitor_" + std::to_string(::getpid()))).string();
    std::FILE* devnull = std::fopen("/dev/null", "w");
    dtrain::Monitor mon(dtrain::MonitorOptions()
                            .output_dir(dir)
                            .log_every(steps)  // one aggregation in every block (default --steps 5: twice
                                               // as often as MonitorOptions' default of 10)
                            .trace_steps(100)
                            .total_steps(static_cast<int64_t>(blocks) * steps)
                            .progress_out(devnull)
                            .progress_terminal(false));
    mon.watch(ddp);
    auto monitored = [&] {
      at::Tensor loss;
      {
        auto p = mon.phase(dtrain::Phase::kForward);
        loss = torch::nn::functional::cross_entropy(ddp(x), y);
      }
      {
        auto p = mon.phase(dtrain::Phase::kBackward);
        opt.zero_grad();
        loss.backward();
      }
      {
        auto p = mon.phase(dtrain::Phase::kOptimizer);
        opt.step();
      }
      const double l = loss.item<double>();
      mon.end_step(dtrain::StepInfo().loss(l).samples(32).lr(1e-3));
      return l;
    };
    torch::manual_seed(0);
    torch::nn::Sequential mlp_model(torch::nn::Linear(784, 256), torch::nn::ReLU(), torch::nn::Linear(256, 10));
    dtrain::DistributedDataParallel mlp_ddp(mlp_model);
    torch::optim::Adam mlp_opt(mlp_ddp.parameters(), 1e-3);
    const at::Tensor mx = at::randn({32, 784});
    auto mlp = [&] {
      mlp_opt.zero_grad();
      at::Tensor loss = torch::nn::functional::cross_entropy(mlp_ddp(mx), y);
      loss.backward();
      mlp_opt.step();
      return loss.item<double>();
    };
    auto mlp_unrecorded = [&] {
      dtrain::set_flight_recorder_enabled(false);
      const double l = mlp();
      dtrain::set_flight_recorder_enabled(true);
      return l;
    };
    // The recorder's cost per call, without a model around it: 200 all_reduces of 4 floats.
    at::Tensor tiny = at::zeros({4});
    auto calls = [&] {
      for (int i = 0; i < 200; ++i) dtrain::all_reduce(tiny);
      return 0.0;
    };
    auto calls_unrecorded = [&] {
      dtrain::set_flight_recorder_enabled(false);
      calls();
      dtrain::set_flight_recorder_enabled(true);
      return 0.0;
    };
    auto detail = [&] {
      dtrain::set_debug_level(dtrain::DebugLevel::DETAIL);
      const double l = plain();
      dtrain::set_debug_level(dtrain::DebugLevel::OFF);
      return l;
    };

    for (int i = 0; i < warmup; ++i) plain(), detail(), mlp(), mlp_unrecorded(), calls(), calls_unrecorded();
    std::map<std::string, double> total_s;
    std::map<std::string, std::vector<double>> block_s;  // per block: paired with "off" of the same block
    for (int b = 0; b < blocks; ++b) {
      // The MLP pair swaps places every block: the first of two neighbours runs on colder caches.
      const bool swap = b % 2 == 1;
      for (const char* v : {"off", "on", "detail", swap ? "mlp_unrecorded" : "mlp", swap ? "mlp" : "mlp_unrecorded",
                            swap ? "calls_unrecorded" : "calls", swap ? "calls" : "calls_unrecorded"}) {
        const std::string variant = v;
        if (variant == "detail" && world < 2) continue;  // one rank: no check to make
        dtrain::barrier();
        if (variant == "on") mon.begin_step();
        const bool short_steps = variant.rfind("mlp", 0) == 0 || variant.rfind("calls", 0) == 0;
        const int n = short_steps ? 10 * steps : steps;  // short steps: more of them
        const auto t0 = Clock::now();
        for (int s = 0; s < n; ++s)
          variant == "off"                ? plain()
          : variant == "on"               ? monitored()
          : variant == "detail"           ? detail()
          : variant == "mlp"              ? mlp()
          : variant == "calls"            ? calls()
          : variant == "calls_unrecorded" ? calls_unrecorded()
                                          : mlp_unrecorded();
        const double dt = std::chrono::duration<double>(Clock::now() - t0).count();
        total_s[variant] += dt;
        block_s[variant].push_back(dt);
      }
    }
    mon.close();
    std::fclose(devnull);
    dtrain::barrier();
    if (rank == 0) {
      std::filesystem::remove_all(dir);
      const double n = static_cast<double>(blocks) * steps;
      // Ratios of neighbouring blocks (the median over blocks): drift and other jobs' load affect both
      // sides of a pair alike, unlike the totals.
      auto ratio = [&](const std::string& v, const std::string& base = "off") {
        std::vector<double> r;
        for (size_t b = 0; b < block_s[v].size(); ++b) r.push_back(block_s[v][b] / block_s[base][b]);
        return bench::median(r);
      };
      std::printf("off_ms=%.3f on_ms=%.3f on_ratio=%.4f", 1e3 * total_s["off"] / n, 1e3 * total_s["on"] / n,
                  ratio("on"));
      if (world > 1) std::printf(" detail_ms=%.3f detail_ratio=%.4f", 1e3 * total_s["detail"] / n, ratio("detail"));
      // calls: `blocks` blocks of 10 * steps loops of 200 calls each; the recorder's cost per call is
      // the paired-block ratio's excess times a paused call's time (robust to drift, unlike totals).
      const double paused_us = 1e6 * total_s["calls_unrecorded"] / (10 * n * 200);
      std::printf(" flight_call_us=%.3f call_us=%.3f", (ratio("calls", "calls_unrecorded") - 1) * paused_us, paused_us);
      std::printf(" mlp_ms=%.3f mlp_unrecorded_ms=%.3f flight_ratio=%.4f", 1e3 * total_s["mlp"] / (10 * n),
                  1e3 * total_s["mlp_unrecorded"] / (10 * n), ratio("mlp", "mlp_unrecorded"));
      std::printf("\n");
    }
    dtrain::destroy_process_group();
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_monitor worker: error: %s\n", e.what());
    return 1;
  }
}

int driver_main(int argc, char** argv) {
  CLI::App app{"bench_monitor: step-time cost of dtrain::Monitor and DTRAIN_DEBUG=DETAIL on the tutorial's CNN"};
  int reps = 3, blocks = 8, steps = 5;
  double timeout_s = 600;
  app.add_option("--reps", reps, "repetitions (median reported)")->check(dtrain_cli::positive());
  app.add_option("--blocks", blocks, "interleaved blocks per variant and job")->check(dtrain_cli::positive());
  app.add_option("--steps", steps, "steps per block")->check(dtrain_cli::positive());
  app.add_option("--timeout_s", timeout_s, "limit per job");
  CLI11_PARSE(app, argc, argv);

  std::map<std::string, std::vector<double>> ms;     // "<ranks>/<variant>" -> per repetition
  std::map<std::string, std::vector<double>> ratio;  // "<ranks>/<variant>" -> per repetition (paired blocks)
  for (int r = 0; r < reps; ++r)
    for (int world : {1, 2}) {
      const std::string out = bench::run_job(
          {bench::self_exe(), "--worker", "--blocks", std::to_string(blocks), "--steps", std::to_string(steps)}, world,
          timeout_s, "bench_monitor");
      for (const char* v : {"off", "on", "detail", "mlp", "mlp_unrecorded", "flight"}) {
        const double x = bench::parse_value(out, std::string(v) + "_ms");
        if (x == x) ms[std::to_string(world) + "/" + v].push_back(x);
        const double us = bench::parse_value(out, std::string(v) + "_call_us");
        if (us == us) ms[std::to_string(world) + "/" + v + "_call"].push_back(us);
        const double q = bench::parse_value(out, std::string(v) + "_ratio");
        if (q == q) ratio[std::to_string(world) + "/" + v].push_back(q);
      }
    }

  std::printf(
      "TrainModel (CNN 3x32x32), batch 32 per rank, Adam, DDP, 1 thread per rank, %d blocks x %d steps "
      "per variant, %d reps, load %s\n",
      blocks, steps, reps, bench::load_average().c_str());
  std::printf("%-6s %-15s %12s %10s   runs (ms/step) | paired-block ratio per run\n", "ranks", "variant", "median ms",
              "vs base");
  auto med = [&](const std::string& k) { return ms[k].empty() ? 0.0 : bench::median(ms[k]); };
  auto medr = [&](const std::string& k) { return ratio[k].empty() ? 1.0 : bench::median(ratio[k]); };
  for (int world : {1, 2})
    for (const char* v : {"off", "on", "detail", "mlp", "mlp_unrecorded"}) {
      const std::string k = std::to_string(world) + "/" + v;
      if (ms[k].empty()) continue;
      const std::string base = std::string(v).rfind("mlp", 0) == 0 ? "/mlp_unrecorded" : "/off";
      std::printf("%-6d %-15s %12.3f %+9.2f%%  ", world, v, med(k),
                  100 * (med(k) / med(std::to_string(world) + base) - 1));
      for (double x : ms[k]) std::printf(" %.2f", x);
      std::printf(" |");
      for (double x : ratio[k]) std::printf(" %.3f", x);
      std::printf("\n");
    }
  for (int world : {1, 2}) {
    std::printf("%d rank(s): the recorder's cost per all_reduce (us), per run:", world);
    for (double x : ms[std::to_string(world) + "/flight_call"]) std::printf(" %.3f", x);
    std::printf("\n");
    std::printf("%d rank(s): MLP step with the flight recorder / paused, paired blocks, per run:", world);
    for (double x : ratio[std::to_string(world) + "/flight"]) std::printf(" %.3f", x);
    std::printf("\n");
  }
  // The overheads: median over repetitions of each run's median paired-block ratio, minus 1.
  std::printf(
      "RESULT monitor_overhead_1rank=%.4f monitor_overhead_2rank=%.4f detail_overhead=%.4f flight_overhead_1rank=%.4f "
      "flight_overhead_2rank=%.4f flight_call_us_2rank=%.3f\n",
      medr("1/on") - 1, medr("2/on") - 1, medr("2/detail") - 1, medr("1/flight") - 1, medr("2/flight") - 1,
      med("2/flight_call"));
  return 0;
}

}  // namespace

int main(int argc, char** argv) { return bench::main_of("bench_monitor", argc, argv, worker_main, driver_main); }
