// bench_checkpoint: what saving costs the training loop, side by side in one run.
//
//   ./build/bin/bench_checkpoint [--mib 1024] [--reps 3] [--parts async,epoch,per_rank] [--dir /tmp]
//
// Async: a state of --mib MiB (a Sequential of Linear 2048 with Adam: parameters, exp_avg and
// exp_avg_sq, a third each) saved by one process with CheckpointManager::save() and with save_async(),
// alternated --reps times (every save waits for the last write first, outside the timing), and one
// core's memcpy of the same bytes in the same run. The time save_async() blocks the caller, over
// save()'s whole time and over the memcpy's:
//   RESULT async_blocking_vs_sync=A async_blocking_vs_memcpy=M   (goals: A <= 0.1, M <= 1.5)
// Epoch: the main job (train_fashion_mnist, 2 ranks, --subset 12000) without checkpoints and with
// --checkpoint_every 100 --async_checkpoint, alternated --reps times; the median epoch time with saves
// over without:
//   RESULT epoch_with_saves_vs_without=E   (goal <= 1.05)
// Per rank: dtrain::dcp::save of a state sharded over 3 ranks (each its third, --mib / 3 MiB) against
// one rank saving the whole: the bytes written per second of the three over the one's:
//   RESULT per_rank_write_speedup_3=S
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <sstream>

#include <CLI/CLI.hpp>
#include <torch/torch.h>

#include "dtrain/checkpoint.h"
#include "dtrain/dcp.h"
#include "dtrain/process_group.h"
#include "spawn.h"

namespace {

using namespace bench;
namespace fs = std::filesystem;

constexpr int64_t kWidth = 2048;

// Layers of Linear kWidth whose parameters and Adam state come to about `mib` MiB.
torch::nn::Sequential make_model(int64_t mib) {
  const int64_t layer_bytes = (kWidth * kWidth + kWidth) * 4 * 3;
  torch::nn::Sequential m;
  for (int64_t i = 0, n = std::max<int64_t>(1, (mib << 20) / layer_bytes); i < n; ++i)
    m->push_back(torch::nn::Linear(kWidth, kWidth));
  return m;
}

int64_t state_bytes(torch::nn::Sequential& m) {
  int64_t b = 0;
  for (const auto& p : m->parameters()) b += p.numel() * 4 * 3;
  return b;
}

void adam_step(torch::nn::Sequential& m, torch::optim::Adam& opt) {
  opt.zero_grad();
  m->forward(at::randn({2, kWidth})).sum().backward();
  opt.step();
}

// async: save() and save_async() alternated, memcpy of the same bytes beside them.
void bench_async(int64_t mib, int reps, const std::string& dir) {
  at::set_num_threads(1);
  auto model = make_model(mib);
  torch::optim::Adam opt(model->parameters());
  adam_step(model, opt);
  const int64_t bytes = state_bytes(model);
  dtrain::TrainingState st;
  st.model = model.ptr().get();
  st.optimizer = &opt;
  st.rng = false;
  const std::string folder = dir + "/bench_checkpoint_async_" + std::to_string(getpid());
  dtrain::CheckpointManager mgr(folder, dtrain::CheckpointOptions().keep(1));
  std::vector<double> sync_s, async_s, copy_s;
  std::vector<char> a(static_cast<size_t>(bytes), 1), b(static_cast<size_t>(bytes), 2);
  for (int r = 0; r < reps; ++r) {
    st.step = 2 * r;
    auto t0 = Clock::now();
    mgr.save(st);
    sync_s.push_back(secs_since(t0));
    st.step = 2 * r + 1;
    t0 = Clock::now();
    mgr.save_async(st);
    async_s.push_back(secs_since(t0));
    mgr.wait();  // outside the timing: the next save would wait for it anyway
    t0 = Clock::now();
    std::memcpy(b.data(), a.data(), a.size());
    copy_s.push_back(secs_since(t0));
  }
  fs::remove_all(folder);
  std::printf("async: state %s; save %.2f s, save_async blocks %.3f s, memcpy %.3f s (medians of %d)\n",
              human_bytes(static_cast<size_t>(bytes)).c_str(), median(sync_s), median(async_s), median(copy_s), reps);
  std::printf("RESULT async_blocking_vs_sync=%.3f async_blocking_vs_memcpy=%.2f\n", median(async_s) / median(sync_s),
              median(async_s) / median(copy_s));
}

// epoch: the main job's epoch time without checkpoints and with a background save every 100 steps.
void bench_epoch(int reps, const std::string& dir) {
  const std::string trainer = fs::path(self_exe()).parent_path() / "train_fashion_mnist";
  const std::string folder = dir + "/bench_checkpoint_epoch_" + std::to_string(getpid());
  auto epoch_s = [&](bool saves) {
    fs::remove_all(folder);
    std::vector<std::string> argv{trainer, "--epochs", "1", "--subset", "12000", "--test_subset", "500"};
    if (saves) argv.insert(argv.end(), {"--checkpoint_dir", folder, "--checkpoint_every", "100", "--async_checkpoint"});
    const std::string out = run_job(argv, 2, 600, "bench_checkpoint");
    const std::string line = parse_line(out, "Epoch 1/1:");
    const size_t at = line.find("| train ");
    return at == std::string::npos ? NAN : std::stod(line.substr(at + 8));
  };
  std::vector<double> with, without;
  for (int r = 0; r < reps; ++r) {
    without.push_back(epoch_s(false));
    with.push_back(epoch_s(true));
    std::printf("epoch: without %.1f s, with saves every 100 steps %.1f s\n", without.back(), with.back());
  }
  fs::remove_all(folder);
  std::printf("RESULT epoch_with_saves_vs_without=%.3f\n", median(with) / median(without));
}

// per_rank worker: this rank's third of the state (or all of it alone), saved with dcp::save.
int worker_main(int argc, char** argv) {
  CLI::App app{"bench_checkpoint worker"};
  int64_t mib = 1024;
  std::string folder;
  app.add_option("--mib", mib);
  app.add_option("--folder", folder);
  CLI11_PARSE(app, argc, argv);
  dtrain::init_process_group();
  const int n = dtrain::world_size(), r = dtrain::rank();
  const int64_t rows = (mib << 20) / (4 * kWidth);
  const at::Tensor mine = at::randn({rows / n, kWidth});
  dtrain::dcp::StateDict sd{dtrain::dcp::Entry::chunk({"model", "weight"}, mine, {rows / n * n, kWidth}, {rows / n * r, 0})};
  dtrain::barrier();
  const auto t0 = Clock::now();
  dtrain::dcp::save(sd, folder);
  const double s = secs_since(t0);
  if (r == 0) std::printf("save_s=%.3f bytes=%lld\n", s, static_cast<long long>(rows / n * n * kWidth * 4));
  dtrain::destroy_process_group();
  return 0;
}

void bench_per_rank(int64_t mib, int reps, const std::string& dir) {
  const std::string folder = dir + "/bench_checkpoint_dcp_" + std::to_string(getpid());
  std::vector<double> speedup;
  for (int r = 0; r < reps; ++r) {
    double s[4] = {0, 0, 0, 0};
    for (int n : {1, 3}) {
      fs::remove_all(folder);
      const std::string out = run_job({self_exe(), "--worker", "--mib", std::to_string(mib), "--folder", folder}, n,
                                      600, "bench_checkpoint");
      s[n] = parse_value(out, "save_s");
    }
    speedup.push_back(s[1] / s[3]);
    std::printf("per_rank: %s written by 1 rank in %.2f s, by 3 ranks in %.2f s\n",
                human_bytes(static_cast<size_t>(mib) << 20).c_str(), s[1], s[3]);
  }
  fs::remove_all(folder);
  std::printf("RESULT per_rank_write_speedup_3=%.2f\n", median(speedup));
}

int driver_main(int argc, char** argv) {
  CLI::App app{"What saving a checkpoint costs the training loop"};
  int64_t mib = 1024;
  int reps = 3;
  std::string parts = "async,epoch,per_rank", dir = "/tmp";
  app.add_option("--mib", mib, "state size for async and per_rank");
  app.add_option("--reps", reps, "alternated repetitions (medians reported)");
  app.add_option("--parts", parts, "async, epoch, per_rank");
  app.add_option("--dir", dir, "where the checkpoints are written");
  CLI11_PARSE(app, argc, argv);
  std::printf("bench_checkpoint: load %s\n", load_average().c_str());
  if (parts.find("async") != std::string::npos) bench_async(mib, reps, dir);
  if (parts.find("epoch") != std::string::npos) bench_epoch(reps, dir);
  if (parts.find("per_rank") != std::string::npos) bench_per_rank(mib, reps, dir);
  return 0;
}

}  // namespace

int main(int argc, char** argv) { return bench::main_of("bench_checkpoint", argc, argv, worker_main, driver_main); }
