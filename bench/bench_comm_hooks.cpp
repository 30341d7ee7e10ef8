// bench_comm_hooks: bytes sent and step time of DDP's communication hooks on 2 ranks over Gloo alone
// (DTRAIN_SHM=0: loopback TCP, the path between hosts, where compression is meant to pay).
//
// Model: an MLP of 4 Linear(1024, 1024) layers (4.2 M parameters, 16.8 MB of float32 gradients),
// batch 32 per rank, SGD, 1 thread per rank. Variants, each its own model and DDP in the same
// processes, run interleaved in blocks of steps (so drift and load hit them alike):
//   allreduce         DDP without a hook (its own averaging all-reduce)
//   fp16, bf16        fp16_compress_hook, bf16_compress_hook
//   powersgd          powerSGD_hook, rank 2 (start_powerSGD_iter 2: compressed after the warm-up)
//   batched_powersgd  batched_powerSGD_hook, rank 1
//   local             a hook that communicates nothing (returns the bucket as it is): the step
//                     without communication, the floor any compression could reach
// Bytes: what this rank's process wrote to its sockets during a block (/proc/self/io wchar: the
// write/writev system calls Gloo's TCP transport makes; per process, so other jobs on the machine do
// not count), and as a cross-check the loopback interface's transmitted bytes (/proc/net/dev "lo"
// tx, both ranks together, divided by 2; other traffic of this network namespace counts there).
// ms/step is rank 0's wall time per step (forward, backward with communication, optimizer step).
// Ratios are per repetition (medians over blocks), reported as the median over repetitions.
//
//   build/bin/bench_comm_hooks [--reps 3] [--blocks 6] [--steps 5]
// Last line: RESULT bf16_bytes_ratio=... powersgd_bytes_ratio=... powersgd_step_vs_allreduce=...
//   (bytes and time of the hook divided by those of allreduce)
#include <cstdio>
#include <fstream>
#include <map>
#include <sstream>
#include <string>

#include <ATen/Parallel.h>
#include <CLI/CLI.hpp>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/container/functional.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>

#include "cli_checks.h"
#include "dtrain/comm_hooks.h"
#include "dtrain/ddp.h"
#include "dtrain/system.h"
#include "spawn.h"

namespace {

using Clock = std::chrono::steady_clock;
const char* const kVariants[] = {"allreduce", "fp16", "bf16", "powersgd", "batched_powersgd", "local"};

// Bytes this process has written with write-like system calls (sockets included).
double written_bytes() {
  std::ifstream f("/proc/self/io");
  std::string key;
  double v = 0;
  while (f >> key >> v)
    if (key == "wchar:") return v;
  return 0;
}

// Bytes transmitted by the loopback interface of this network namespace.
double loopback_tx_bytes() {
  std::ifstream f("/proc/net/dev");
  std::string line;
  while (std::getline(f, line)) {
    auto colon = line.find(':');
    if (colon == std::string::npos) continue;
    std::string name = line.substr(0, colon);
    name.erase(0, name.find_first_not_of(' '));
    if (name != "lo") continue;
    std::istringstream in(line.substr(colon + 1));
    double fields[9] = {};
    for (double& x : fields) in >> x;
    return fields[8];  // rx: bytes packets errs drop fifo frame compressed multicast; then tx bytes
  }
  return 0;
}

torch::nn::Sequential make_mlp() {
  torch::manual_seed(0);
  torch::nn::Sequential m;
  for (int i = 0; i < 4; ++i) {
    m->push_back(torch::nn::Linear(1024, 1024));
    if (i < 3) m->push_back(torch::nn::Functional(torch::relu));
  }
  return m;
}

struct Variant {
  std::string name;
  torch::nn::Sequential model = make_mlp();
  std::unique_ptr<dtrain::DistributedDataParallel<torch::nn::SequentialImpl>> ddp;
  std::unique_ptr<torch::optim::SGD> opt;
  std::vector<double> block_s, block_bytes, block_lo;
};

int worker_main(int argc, char** argv) {
  dtrain::reduce_allocator_churn();  // as the trainer does: Note [malloc churn]
  CLI::App app{"bench_comm_hooks worker"};
  int blocks = 6, steps = 5;
  app.add_option("--blocks", blocks);
  app.add_option("--steps", steps);
  CLI11_PARSE(app, argc, argv);
  try {
    at::set_num_threads(1);
    dtrain::init_process_group();
    const int rank = dtrain::rank();
    std::vector<std::unique_ptr<Variant>> variants;
    for (const char* name : kVariants) {
      auto v = std::make_unique<Variant>();
      v->name = name;
      v->ddp = std::make_unique<dtrain::DistributedDataParallel<torch::nn::SequentialImpl>>(v->model.ptr());
      if (v->name == "fp16") v->ddp->register_comm_hook(dtrain::Group(), dtrain::fp16_compress_hook);
      if (v->name == "bf16") v->ddp->register_comm_hook(dtrain::Group(), dtrain::bf16_compress_hook);
      if (v->name == "powersgd")
        v->ddp->register_comm_hook(
            dtrain::PowerSGDState(dtrain::PowerSGDOptions().matrix_approximation_rank(2).start_powerSGD_iter(2)),
            dtrain::powerSGD_hook);
      if (v->name == "batched_powersgd")
        v->ddp->register_comm_hook(
            dtrain::PowerSGDState(dtrain::PowerSGDOptions().matrix_approximation_rank(1).start_powerSGD_iter(2)),
            dtrain::batched_powerSGD_hook);
      if (v->name == "local")
        v->ddp->register_comm_hook([](dtrain::GradBucket& b) { return dtrain::Future(b.buffer()); });
      v->opt = std::make_unique<torch::optim::SGD>(v->ddp->parameters(), 0.01);
      variants.push_back(std::move(v));
    }
    at::Tensor x = at::randn({32, 1024}), y = at::randn({32, 1024});
    auto step = [&](Variant& v) {
      v.opt->zero_grad();
      torch::nn::functional::mse_loss(v.ddp->forward(x), y).backward();
      v.opt->step();
    };
    for (auto& v : variants)
      for (int i = 0; i < 3; ++i) step(*v);  // PowerSGD's warm-up and first random Q are behind us
    for (int b = 0; b < blocks; ++b)
      for (auto& v : variants) {
        dtrain::barrier();
        const double w0 = written_bytes(), l0 = loopback_tx_bytes();
        const auto t0 = Clock::now();
        for (int s = 0; s < steps; ++s) step(*v);
        v->block_s.push_back(std::chrono::duration<double>(Clock::now() - t0).count() / steps);
        v->block_bytes.push_back((written_bytes() - w0) / steps);
        v->block_lo.push_back((loopback_tx_bytes() - l0) / steps / 2);
      }
    if (rank == 0)
      for (auto& v : variants)
        std::printf("%s_ms=%.3f %s_bytes=%.0f %s_lo_bytes=%.0f\n", v->name.c_str(), 1e3 * bench::median(v->block_s),
                    v->name.c_str(), bench::median(v->block_bytes), v->name.c_str(), bench::median(v->block_lo));
    dtrain::barrier();
    dtrain::destroy_process_group();
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_comm_hooks worker: error: %s\n", e.what());
    return 1;
  }
}

int driver_main(int argc, char** argv) {
  CLI::App app{"bench_comm_hooks: bytes and step time of DDP communication hooks over Gloo (DTRAIN_SHM=0)"};
  int reps = 3, blocks = 6, steps = 5;
  double timeout_s = 900;
  app.add_option("--reps", reps, "repetitions (jobs; medians reported)")->check(dtrain_cli::positive());
  app.add_option("--blocks", blocks, "interleaved blocks per variant and job")->check(dtrain_cli::positive());
  app.add_option("--steps", steps, "steps per block")->check(dtrain_cli::positive());
  app.add_option("--timeout_s", timeout_s, "limit per job");
  CLI11_PARSE(app, argc, argv);

  std::map<std::string, std::vector<double>> ms, bytes, lo;
  for (int r = 0; r < reps; ++r) {
    const std::string out = bench::run_job(
        {bench::self_exe(), "--worker", "--blocks", std::to_string(blocks), "--steps", std::to_string(steps)}, 2,
        timeout_s, "bench_comm_hooks", {{"DTRAIN_SHM", "0"}});
    for (const char* v : kVariants) {
      ms[v].push_back(bench::parse_value(out, std::string(v) + "_ms"));
      bytes[v].push_back(bench::parse_value(out, std::string(v) + "_bytes"));
      lo[v].push_back(bench::parse_value(out, std::string(v) + "_lo_bytes"));
    }
  }
  std::printf(
      "MLP 4 x Linear(1024, 1024) (16.8 MB of float32 gradients), batch 32 per rank, SGD, 2 ranks x 1 thread, "
      "Gloo over loopback (DTRAIN_SHM=0), %d blocks x %d steps per variant, %d reps, load %s\n",
      blocks, steps, reps, bench::load_average().c_str());
  std::printf("%-17s %10s %12s %14s %12s   runs: ms/step | bytes/step\n", "hook", "ms/step", "vs allreduce",
              "bytes/step", "vs allreduce");
  auto med = [](const std::vector<double>& v) { return bench::median(v); };
  for (const char* v : kVariants) {
    std::printf("%-17s %10.2f %12.3f %14.0f %12.4f  ", v, med(ms[v]), med(ms[v]) / med(ms["allreduce"]), med(bytes[v]),
                med(bytes[v]) / med(bytes["allreduce"]));
    for (double x : ms[v]) std::printf(" %.2f", x);
    std::printf(" |");
    for (double x : bytes[v]) std::printf(" %.0f", x);
    std::printf(" | lo/2:");
    for (double x : lo[v]) std::printf(" %.0f", x);
    std::printf("\n");
  }
  // Per repetition ratios, then their median (a slow repetition affects both sides of its ratio).
  auto ratio = [&](std::map<std::string, std::vector<double>>& m, const char* v) {
    std::vector<double> r;
    for (size_t i = 0; i < m[v].size(); ++i) r.push_back(m[v][i] / m["allreduce"][i]);
    return bench::median(r);
  };
  std::printf(
      "RESULT bf16_bytes_ratio=%.4f powersgd_bytes_ratio=%.4f powersgd_step_vs_allreduce=%.3f "
      "bf16_step_vs_allreduce=%.3f\n",
      ratio(bytes, "bf16"), ratio(bytes, "powersgd"), ratio(ms, "powersgd"), ratio(ms, "bf16"));
  return 0;
}

}  // namespace

int main(int argc, char** argv) { return bench::main_of("bench_comm_hooks", argc, argv, worker_main, driver_main); }
