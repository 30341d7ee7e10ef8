// bench_data_parallel: single-process DataParallel vs DistributedDataParallel vs one module, on this
// CPU, training the tutorial's models (Adam, cross-entropy, the tutorial's loop) — the measured side
// of the tutorial's advice "DataParallel is simple, DistributedDataParallel is preferred".
//
//   ./build/bin/bench_data_parallel [--reps 3] [--jobs single dp ddp single2] [--configs mlp32 mlp256 cnn32]
//
// Every variant processes the SAME GLOBAL BATCH per step (throughput = global batch x steps/s):
//   single   one module, one process, 1 intra-op thread (OMP_NUM_THREADS=1, set_num_threads(1))
//   dp       dtrain::DataParallel with 2 CPU replicas in one process: the batch is split in 2 and the
//            replicas run in 2 threads, each computing single-threaded (OMP_NUM_THREADS=1 and
//            set_num_threads(1)); the replicas' gradients are summed into the module on backward
//   ddp      dtrain::DistributedDataParallel on 2 processes (Gloo on loopback, 1 thread each), each
//            rank taking half of the global batch
//   single2  (reference) one module, one process, 2 intra-op threads: the other way to use 2 cores
//   dp_omp   (optional) dp without OMP_NUM_THREADS in the environment: see the Note on threads below
// Configs: mlp32 (SimpleModel, global batch 32), mlp256 (SimpleModel, 256: more work per replica),
// cnn32 (TrainModel on 3x32x32, 32).
//
// How: this binary is the driver and the worker. The driver starts every job as a child process
// (bench/spawn.h: 1 rank, or 2 for ddp, with RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT and
// OMP_NUM_THREADS=1), the variants interleaved (rep 1 of everything, then rep 2, ..., the order
// rotating), and reports the median of the reps. Each worker runs the warm-up steps, then (rank 0,
// after a barrier for ddp) times the timed steps on 4 pre-made global batches cycled and prints
// `steps_per_s=<x>`. A dp worker also prints the intra-op thread count a replica thread sees.
//
// Note [Intra-op threads in replica threads]: DataParallel's replicas run in new std::threads. With
// Debian's OpenMP LibTorch, omp_set_num_threads is per thread, but at::set_num_threads(n) also stores
// n globally and ATen applies it lazily in every thread on that thread's first parallel op; so
// set_num_threads(1) on the caller's thread does make the replica threads single-threaded, with or
// without OMP_NUM_THREADS (measured: the dp workers print replica_thread_num_threads=1, and dp_omp,
// dp without OMP_NUM_THREADS, runs at dp's speed). Without set_num_threads(1), every replica thread
// would use all cores (OpenMP's default) and the 2 replicas would oversubscribe them.
//
// Last line: RESULT mlp_dp_vs_single=.. mlp_ddp_vs_single=.. cnn_dp_vs_single=.. cnn_ddp_vs_single=..
//            mlp256_dp_vs_single=.. mlp256_ddp_vs_single=..   (throughput ratios; > 1: faster)
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <CLI/CLI.hpp>

#include "cli_checks.h"
#include <torch/nn/functional/loss.h>
#include <torch/optim/adam.h>

#include "dtrain/data_parallel.h"
#include "dtrain/ddp.h"
#include "dtrain/dtrain.h"
#include "spawn.h"
#include "tutorial_models.h"

namespace {

using namespace bench;
constexpr int kBatches = 4;

struct Config {
  std::string model;
  int64_t batch;
};
Config parse_config(const std::string& c) {
  if (c.rfind("mlp", 0) == 0) return {"mlp", std::stoll(c.substr(3))};
  if (c.rfind("cnn", 0) == 0) return {"cnn", std::stoll(c.substr(3))};
  throw std::runtime_error("bench_data_parallel: unknown config " + c + " (mlpN or cnnN)");
}

// ---------------------------------------------------------------------------------------------------
// Worker

template <typename Model>
int run_worker(const std::string& variant, const Config& cfg, int warmup, int steps) {
  const bool ddp_mode = variant == "ddp";
  const int rank = ddp_mode ? dtrain::rank() : 0, world = ddp_mode ? dtrain::world_size() : 1;
  const int64_t local = cfg.batch / world;  // ddp: each rank takes its half of the global batch
  const std::vector<int64_t> shape =
      cfg.model == "mlp" ? std::vector<int64_t>{cfg.batch, 128} : std::vector<int64_t>{cfg.batch, 3, 32, 32};
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1);
  std::vector<std::pair<at::Tensor, at::Tensor>> batches;
  for (int i = 0; i < kBatches; ++i) {
    at::Tensor x = at::randn(shape, gen), y = at::randint(0, 10, {cfg.batch}, gen);
    batches.emplace_back(x.narrow(0, rank * local, local).contiguous(), y.narrow(0, rank * local, local).contiguous());
  }

  torch::manual_seed(0);
  Model model;
  std::optional<dtrain::DataParallel<typename Model::ContainedType>> dp;
  std::optional<dtrain::DistributedDataParallel<typename Model::ContainedType>> ddp;
  if (variant == "dp" || variant == "dp_omp") {
    dp.emplace(model, dtrain::DataParallelOptions({at::kCPU, at::kCPU}), [] { return Model().ptr(); });
    int seen = 0;
    std::thread([&] { seen = at::get_num_threads(); }).join();  // what a replica thread gets
    std::printf("main_thread_num_threads=%d replica_thread_num_threads=%d\n", at::get_num_threads(), seen);
  }
  if (ddp_mode) ddp.emplace(model);
  torch::optim::Adam opt(model->parameters(), torch::optim::AdamOptions(1e-3));

  auto step = [&](int i) {
    const auto& [x, y] = batches[i % kBatches];
    opt.zero_grad();
    at::Tensor out = dp ? (*dp)(x) : ddp ? (*ddp)(x) : model->forward(x);  // (B, 10)
    torch::nn::functional::cross_entropy(out, y).backward();
    opt.step();
  };
  for (int i = 0; i < warmup; ++i) step(i);
  if (ddp_mode) dtrain::barrier();
  const auto t0 = Clock::now();
  for (int i = 0; i < steps; ++i) step(i);
  const double secs = secs_since(t0);
  if (rank == 0) std::printf("steps_per_s=%.3f\n", steps / secs);
  std::fflush(stdout);
  return 0;
}

int worker_main(int argc, char** argv) {
  dtrain::reduce_allocator_churn();  // as the trainer does: Note [malloc churn]
  CLI::App app{"bench_data_parallel worker"};
  std::string variant, config;
  int warmup = 10, steps = 100, threads = 1;
  app.add_option("variant", variant)->required();
  app.add_option("config", config)->required();
  app.add_option("--warmup", warmup);
  app.add_option("--steps", steps);
  app.add_option("--threads", threads);
  CLI11_PARSE(app, argc, argv);
  try {
    at::set_num_threads(threads);
    const Config cfg = parse_config(config);
    const bool ddp_mode = variant == "ddp";
    if (ddp_mode) dtrain::init_process_group();
    const int rc = cfg.model == "mlp" ? run_worker<tutorial::SimpleModel>(variant, cfg, warmup, steps)
                                      : run_worker<tutorial::TrainModel>(variant, cfg, warmup, steps);
    if (ddp_mode) dtrain::destroy_process_group();
    return rc;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_data_parallel worker %s %s: error: %s\n", variant.c_str(), config.c_str(), e.what());
    return 1;
  }
}

// ---------------------------------------------------------------------------------------------------
// Driver

int driver_main(int argc, char** argv) {
  CLI::App app{"bench_data_parallel: DataParallel vs DDP vs one module on the tutorial's models (CPU)"};
  int reps = 3, mlp_steps = 400, cnn_steps = 20, warmup = 10;
  std::vector<std::string> jobs{"single", "dp", "ddp", "single2"};
  std::vector<std::string> configs{"mlp32", "mlp256", "cnn32"};
  double timeout_s = 180;
  app.add_option("--reps", reps, "repetitions (median reported; default 3)")->check(dtrain_cli::positive());
  app.add_option("--warmup", warmup, "warm-up steps (default 10)");
  app.add_option("--mlp_steps", mlp_steps, "timed steps at global batch 32, MLP (scaled down by batch/32; default 400)")
      ->check(dtrain_cli::positive());
  app.add_option("--cnn_steps", cnn_steps, "timed steps, CNN (default 20)")->check(dtrain_cli::positive());
  app.add_option("--jobs", jobs, "variants: single dp ddp single2 dp_omp (default: single dp ddp single2)");
  app.add_option("--configs", configs, "mlpN / cnnN, N the global batch (default: mlp32 mlp256 cnn32)");
  app.add_option("--timeout_s", timeout_s, "limit per job in seconds (default 180)");
  CLI11_PARSE(app, argc, argv);

  const std::string exe = self_exe();
  const auto t_all = Clock::now();
  std::printf(
      "bench_data_parallel: the same global batch per step for every variant; Adam; warm-up %d steps; "
      "%d reps, interleaved, median reported\n"
      "  single: 1 process, 1 thread | dp: DataParallel, 2 CPU replicas (threads), 1 intra-op thread "
      "each | ddp: 2 processes, Gloo, batch/2 each, 1 thread each | single2: 1 process, 2 intra-op threads\n",
      warmup, reps);
  std::printf("load average at start: %s (%u cores)\n", load_average().c_str(), std::thread::hardware_concurrency());
  std::fflush(stdout);

  std::map<std::pair<std::string, std::string>, std::vector<double>> runs;  // (config, variant) -> steps/s
  std::map<std::string, std::string> notes;
  for (int rep = 0; rep < reps; ++rep)
    for (const auto& c : configs) {
      const Config cfg = parse_config(c);
      const int steps = cfg.model == "mlp" ? std::max<int>(20, mlp_steps * 32 / cfg.batch) : cnn_steps;
      for (size_t k = 0; k < jobs.size(); ++k) {
        const std::string& job = jobs[(k + rep) % jobs.size()];
        const int threads = job == "single2" ? 2 : 1;
        std::vector<std::pair<std::string, std::string>> env;
        if (job == "single2") env.emplace_back("OMP_NUM_THREADS", "2");
        if (job == "dp_omp") env.emplace_back("OMP_NUM_THREADS", "");  // unset: see the Note above
        const std::vector<std::string> cmd{exe,         "--worker",
                                           job,         c,
                                           "--warmup",  std::to_string(warmup),
                                           "--steps",   std::to_string(steps),
                                           "--threads", std::to_string(threads)};
        const std::string out = run_job(cmd, job == "ddp" ? 2 : 1, timeout_s, "bench_data_parallel", env);
        const double sps = parse_value(out, "steps_per_s");
        if (!(sps > 0))
          throw std::runtime_error("bench_data_parallel: no steps_per_s from " + job + " " + c + ":\n" + out);
        runs[{c, job}].push_back(sps);
        const std::string th = parse_line(out, "main_thread_num_threads=");
        if (!th.empty()) notes[c + " " + job] = th;
      }
    }

  std::printf("\n%-7s %-8s %10s %10s %12s %9s   %s\n", "config", "variant", "steps/s", "ms/step", "samples/s",
              "vs single", "runs (steps/s)");
  std::map<std::pair<std::string, std::string>, double> med;
  for (const auto& c : configs) {
    const Config cfg = parse_config(c);
    for (const std::string v : {"single", "dp", "ddp", "single2", "dp_omp"}) {
      if (!runs.count({c, v})) continue;
      const double m = median(runs[{c, v}]);
      med[{c, v}] = m;
      const double base = runs.count({c, "single"}) ? median(runs[{c, "single"}]) : std::nan("");
      std::printf("%-7s %-8s %10.2f %10.3f %12.0f %8.2fx  ", c.c_str(), v.c_str(), m, 1e3 / m, m * cfg.batch, m / base);
      for (double x : runs[{c, v}]) std::printf(" %.2f", x);
      auto it = notes.find(c + " " + v);
      if (it != notes.end()) std::printf("   (%s)", it->second.c_str());
      std::printf("\n");
    }
  }
  auto ratio = [&](const std::string& c, const std::string& v) {
    auto a = med.find({c, v}), b = med.find({c, "single"});
    return a == med.end() || b == med.end() ? std::nan("") : a->second / b->second;
  };
  std::printf("load average at end: %s; bench took %.0f s\n", load_average().c_str(), secs_since(t_all));
  std::printf(
      "RESULT mlp_dp_vs_single=%.2f mlp_ddp_vs_single=%.2f cnn_dp_vs_single=%.2f cnn_ddp_vs_single=%.2f "
      "mlp256_dp_vs_single=%.2f mlp256_ddp_vs_single=%.2f\n",
      ratio("mlp32", "dp"), ratio("mlp32", "ddp"), ratio("cnn32", "dp"), ratio("cnn32", "ddp"), ratio("mlp256", "dp"),
      ratio("mlp256", "ddp"));
  return 0;
}

}  // namespace

int main(int argc, char** argv) { return bench::main_of("bench_data_parallel", argc, argv, worker_main, driver_main); }
