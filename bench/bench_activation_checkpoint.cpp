// bench_activation_checkpoint: what activation checkpointing saves and costs, in one process.
//
//   ./build/bin/bench_activation_checkpoint [--blocks 16 --width 128 --batch 12800] [--reps 7] [--threads 1]
//
// The model: --blocks residual MLP blocks as a transformer's, x + W2(gelu(W1(layer_norm(x)))), W1
// width -> 4 * width, float32, whose activations dominate its bytes (about 40 * batch * width bytes a
// block kept for backward: 1 GB at the defaults, against 8 MB of parameters). A step is forward, a
// mean-square loss, backward and an SGD step. Two modes share the very parameters: "none" runs the
// blocks as they are; "full" runs each block through dtrain::checkpoint_wrapper (PyTorch's
// checkpoint_wrapper on every block: only each block's input is kept, the block runs again in
// backward). The modes alternate step by step, --reps steps each after one warm-up step each.
//
// Memory is counted by the allocator (bench/counting_allocator.h wraps LibTorch's CPU allocator): a
// step's peak bytes minus the bytes live just before its forward (parameters, the batch), i.e. what
// forward and backward added at most.
//   RESULT ac_activation_fraction=F   (full's peak over none's; goal <= 0.25)
//   RESULT ac_step_ratio=R            (the median of full's step time over none's; goal <= 1.4)
// Both on one line, with the spread (min-max over the repetitions) of the step ratio, each pair of
// neighbouring steps giving one ratio.
#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <CLI/CLI.hpp>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/optim/sgd.h>

#include "counting_allocator.h"
#include "dtrain/activation_checkpoint.h"
#include "spawn.h"

namespace {

using namespace bench;

struct AcBlockImpl : torch::nn::Module {
  AcBlockImpl(int64_t width)
      : norm(register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({width})))),
        w1(register_module("w1", torch::nn::Linear(width, 4 * width))),
        w2(register_module("w2", torch::nn::Linear(4 * width, width))) {}
  at::Tensor forward(at::Tensor x) { return x + w2(torch::gelu(w1(norm(x)))); }
  torch::nn::LayerNorm norm;
  torch::nn::Linear w1, w2;
};
TORCH_MODULE(AcBlock);

// One step's time and the bytes its forward and backward added at most.
struct AcStep {
  double seconds;
  int64_t peak_bytes;
};

AcStep ac_step(torch::nn::Sequential& net, torch::optim::SGD& opt, const at::Tensor& x, CountingAllocator* counter) {
  opt.zero_grad();  // gradients to none (set_to_none), as PyTorch's default: not counted as live
  for (auto& p : net->parameters()) p.mutable_grad() = at::Tensor();
  const auto t0 = Clock::now();
  const int64_t before = counter->live();
  counter->reset_peak();
  net->forward(x).pow(2).mean().backward();
  const int64_t peak = counter->peak() - before;
  opt.step();
  return {secs_since(t0), peak};
}

int ac_main(int argc, char** argv) {
  CLI::App app{"activation checkpointing: peak activation bytes and step time, every block checkpointed or none"};
  int blocks = 16, reps = 7, threads = 1;
  int64_t width = 128, batch = 12800;
  app.add_option("--blocks", blocks, "residual MLP blocks");
  app.add_option("--width", width, "their width (the hidden layer is 4x)");
  app.add_option("--batch", batch, "rows per step");
  app.add_option("--reps", reps, "timed steps per mode, the modes alternating");
  app.add_option("--threads", threads, "intra-op threads");
  CLI11_PARSE(app, argc, argv);
  CountingAllocator* counter = install_counting_allocator();
  at::set_num_threads(threads);
  torch::manual_seed(0);

  // Both Sequentials hold the same blocks: "full" wraps each in a CheckpointWrapper.
  torch::nn::Sequential none, full;
  for (int i = 0; i < blocks; ++i) {
    AcBlock block(width);
    none->push_back(block);
    full->push_back(
        dtrain::checkpoint_wrapper(block.ptr(), dtrain::ActivationCheckpointOptions().preserve_rng_state(false)));
  }
  torch::optim::SGD opt(none->parameters(), torch::optim::SGDOptions(1e-4));
  const at::Tensor x = torch::randn({batch, width});
  int64_t params = 0;
  for (const auto& p : none->parameters()) params += p.numel() * 4;
  std::printf(
      "bench_activation_checkpoint: load %s; %d blocks x (LayerNorm, Linear %lld -> %lld, GELU, back), batch %lld, "
      "%d thread(s); parameters %s, batch %s\n\n",
      load_average().c_str(), blocks, static_cast<long long>(width), static_cast<long long>(4 * width),
      static_cast<long long>(batch), threads, human_bytes(static_cast<size_t>(params)).c_str(),
      human_bytes(static_cast<size_t>(x.numel() * 4)).c_str());

  ac_step(none, opt, x, counter);  // warm-up: first touches of the pages, oneDNN's primitives
  ac_step(full, opt, x, counter);
  std::vector<double> t_none, t_full, ratios;
  int64_t peak_none = 0, peak_full = 0;
  std::printf(
      "| rep | none: step s | peak added | full: step s | peak added | full / none |\n|---|---|---|---|---|---|\n");
  for (int r = 0; r < reps; ++r) {
    // Alternate which mode goes first, so that a trend in the load favours neither.
    AcStep a{}, b{};
    if (r % 2 == 0) {
      a = ac_step(none, opt, x, counter);
      b = ac_step(full, opt, x, counter);
    } else {
      b = ac_step(full, opt, x, counter);
      a = ac_step(none, opt, x, counter);
    }
    t_none.push_back(a.seconds);
    t_full.push_back(b.seconds);
    ratios.push_back(b.seconds / a.seconds);
    peak_none = std::max(peak_none, a.peak_bytes);
    peak_full = std::max(peak_full, b.peak_bytes);
    std::printf("| %d | %.3f | %s | %.3f | %s | %.3f |\n", r, a.seconds,
                human_bytes(static_cast<size_t>(a.peak_bytes)).c_str(), b.seconds,
                human_bytes(static_cast<size_t>(b.peak_bytes)).c_str(), ratios.back());
  }
  const double fraction = static_cast<double>(peak_full) / static_cast<double>(peak_none);
  const double ratio = median(ratios);
  std::printf("\nmedian step: none %.3f s, full %.3f s; step ratio median %.3f (min %.3f, max %.3f)\n", median(t_none),
              median(t_full), ratio, *std::min_element(ratios.begin(), ratios.end()),
              *std::max_element(ratios.begin(), ratios.end()));
  std::printf(
      "peak bytes added by forward + backward: none %s, full %s: %.3f (goal <= 0.25: %s); step ratio goal <= 1.4: %s\n",
      human_bytes(static_cast<size_t>(peak_none)).c_str(), human_bytes(static_cast<size_t>(peak_full)).c_str(),
      fraction, fraction <= 0.25 ? "met" : "missed", ratio <= 1.4 ? "met" : "missed");
  std::printf(
      "\nRESULT ac_activation_fraction=%.3f ac_step_ratio=%.3f ac_step_ratio_min=%.3f ac_step_ratio_max=%.3f "
      "ac_peak_none_bytes=%lld ac_peak_full_bytes=%lld\n",
      fraction, ratio, *std::min_element(ratios.begin(), ratios.end()), *std::max_element(ratios.begin(), ratios.end()),
      static_cast<long long>(peak_none), static_cast<long long>(peak_full));
  return 0;
}

}  // namespace

int main(int argc, char** argv) { return bench::main_of("bench_activation_checkpoint", argc, argv, ac_main, ac_main); }
