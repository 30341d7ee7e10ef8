// bench_cp: the sequence dimension on one host. Causal attention over a long sequence (float32,
// batch 1, --heads heads of 64, --seq tokens), forward and backward of a sum against a fixed random
// gradient:
//   - context parallel: dtrain::ring_attention on 2 ranks of one thread each, each rank its head-tail
//     half of the sequence (dtrain::context_parallel_shard);
//   - one process: the attention a model computes without it, softmax(q k^T / sqrt(d) + causal
//     mask) v with the scores whole (LibTorch 1.13 has no fused CPU attention), 2 threads on the same
//     cores.
// Each round runs the 2-rank job and then the 1-process job, so the two alternate under the same
// load; each job prints its median step time and the peak bytes its forward and backward added over
// what was live before (bench/counting_allocator.h: what tensors hold), the 2-rank job the larger of
// its ranks'. The driver reports the median over rounds of each round's ratio.
// The 1-process job also times ring_attention on its world of one (the same blocks, the causal mask
// skipping the masked ones, no messages), and its step is the faster of the two.
//   RESULT cp_attention_memory_fraction=M (cp 2's peak per rank over the whole-score attention's;
//                                          goal <= 0.55)
//          cp_step_vs_one_process=R       (2-rank step over the faster 1-process step; goal <= 1.2)
//
//   ./build/bin/bench_cp [--seq 2048 --heads 4] [--steps 5] [--rounds 3]
//
// The all-to-all that Ulysses and expert parallelism ride on, 2 ranks over shared memory: each rank
// sends --a2a_mb MB in two halves (one to itself, one to the peer), against one thread's memcpy of
// the same bytes in the same job:
//   RESULT a2a_16m_fraction_of_memcpy=F  (memcpy time over all_to_all_single time; goal >= 0.8)
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <CLI/CLI.hpp>

#include "counting_allocator.h"
#include "dtrain/context_parallel.h"
#include "dtrain/process_group.h"
#include "spawn.h"

namespace {

using namespace bench;

constexpr int64_t kHeadDim = 64;

// softmax(q k^T * scale + causal mask) v with the whole score matrix: the model's attention without
// context parallelism.
at::Tensor whole_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  const int64_t s = q.size(2);
  at::Tensor scores = at::matmul(q, k.transpose(-2, -1)) / std::sqrt(static_cast<double>(q.size(3)));
  const at::Tensor future = at::ones({s, s}, at::kBool).triu(1);
  return at::matmul(at::softmax(scores.masked_fill(future, -INFINITY), -1), v);
}

struct CpResult {
  double step_ms = 0;
  int64_t peak_bytes = 0;  // the most a step's forward and backward added
};

// Forward and backward of attention over this rank's part of the sequence, `steps` timed after one
// warm-up (the world's ranks in lockstep through the ring).
// ring: dtrain::ring_attention (on a world of one: its blocks, the causal mask skipping the masked
// ones); else whole_attention.
CpResult time_attention(int64_t heads, int64_t seq, int steps, bool ring, CountingAllocator* counter) {
  const int64_t cp = dtrain::world_size();
  at::manual_seed(0);
  auto whole = [&] { return at::randn({1, heads, seq, kHeadDim}); };
  at::Tensor q = whole(), k = whole(), v = whole(), g = whole();
  if (cp > 1) {
    const dtrain::Group group;
    q = dtrain::context_parallel_shard(q, 2, group);
    k = dtrain::context_parallel_shard(k, 2, group);
    v = dtrain::context_parallel_shard(v, 2, group);
    g = dtrain::context_parallel_shard(g, 2, group);
  }
  for (at::Tensor* t : {&q, &k, &v}) t->requires_grad_(true);
  CpResult r;
  std::vector<double> secs;
  for (int i = 0; i <= steps; ++i) {
    for (at::Tensor* t : {&q, &k, &v}) t->mutable_grad() = at::Tensor();
    if (cp > 1) dtrain::barrier();
    const int64_t before = counter->live();
    counter->reset_peak();
    const auto t0 = Clock::now();
    const at::Tensor out =
        ring ? dtrain::ring_attention(q, k, v, dtrain::Group(), /*is_causal=*/true) : whole_attention(q, k, v);
    (out * g).sum().backward();
    if (i > 0) secs.push_back(secs_since(t0));
    r.peak_bytes = std::max(r.peak_bytes, counter->peak() - before);
  }
  r.step_ms = 1e3 * median(secs);
  if (cp > 1) {  // the larger rank's peak
    const auto all =
        dtrain::all_reduce_values(std::vector<double>{static_cast<double>(r.peak_bytes)}, dtrain::ReduceOp::MAX);
    r.peak_bytes = static_cast<int64_t>(all[0]);
  }
  return r;
}

// all_to_all_single of `bytes` per rank (halves to each of 2 ranks), median seconds of `reps`.
double time_all_to_all(size_t bytes, int reps) {
  at::Tensor in = at::ones({static_cast<int64_t>(bytes / 4)}), out = at::empty_like(in);
  std::vector<double> secs;
  for (int i = 0; i <= reps; ++i) {
    dtrain::barrier();
    const auto t0 = Clock::now();
    dtrain::all_to_all_single(out, in);
    if (i > 0) secs.push_back(secs_since(t0));
  }
  return dtrain::all_reduce_values(std::vector<double>{median(secs)}, dtrain::ReduceOp::MAX)[0];
}

int worker_main(int argc, char** argv) {
  CLI::App app{"bench_cp worker"};
  int steps = 5, threads = 1, reps = 20;
  int64_t heads = 4, seq = 2048, a2a_mb = 16;
  app.add_option("--steps", steps);
  app.add_option("--threads", threads);
  app.add_option("--heads", heads);
  app.add_option("--seq", seq);
  app.add_option("--a2a_mb", a2a_mb);
  app.add_option("--reps", reps);
  CLI11_PARSE(app, argc, argv);
  CountingAllocator* counter = install_counting_allocator();
  at::set_num_threads(threads);
  dtrain::init_process_group();
  const bool one = dtrain::world_size() == 1;
  const CpResult r = time_attention(heads, seq, steps, /*ring=*/!one, counter);
  // One process also runs the ring's blocked kernel alone: the faster of the two is its step.
  const CpResult blocked = one ? time_attention(heads, seq, steps, /*ring=*/true, counter) : r;
  double a2a_s = 0, memcpy_s = 0;
  if (dtrain::world_size() == 2 && a2a_mb > 0) {
    const size_t bytes = static_cast<size_t>(a2a_mb) << 20;
    a2a_s = time_all_to_all(bytes, reps);
    memcpy_s = static_cast<double>(bytes) / memcpy_bandwidth(bytes);
  }
  if (dtrain::rank() == 0)
    std::printf("step_ms=%.3f peak_bytes=%lld blocked_ms=%.3f blocked_peak_bytes=%lld a2a_s=%.6f memcpy_s=%.6f\n",
                r.step_ms, static_cast<long long>(r.peak_bytes), blocked.step_ms,
                static_cast<long long>(blocked.peak_bytes), a2a_s, memcpy_s);
  dtrain::destroy_process_group();
  return 0;
}

int driver_main(int argc, char** argv) {
  CLI::App app{"Context parallel: causal attention on 2 ranks of one thread vs one process of 2 threads"};
  int steps = 5, rounds = 3;
  int64_t heads = 4, seq = 2048, a2a_mb = 16;
  double timeout_s = 600;
  app.add_option("--steps", steps, "timed steps per job (median)");
  app.add_option("--rounds", rounds, "rounds of (2-rank job, 1-process job)");
  app.add_option("--heads", heads, "attention heads (of 64)");
  app.add_option("--seq", seq, "sequence length (a multiple of 4)");
  app.add_option("--a2a_mb", a2a_mb, "MB each rank sends in the all-to-all (0: skip it)");
  app.add_option("--timeout", timeout_s, "seconds per job");
  CLI11_PARSE(app, argc, argv);
  std::printf("bench_cp: causal attention, batch 1, %lld heads of %lld, %lld tokens, float32; load %s\n\n",
              static_cast<long long>(heads), static_cast<long long>(kHeadDim), static_cast<long long>(seq),
              load_average().c_str());
  std::printf(
      "| round | cp 2 x 1 thread: step ms | peak per rank | 1 process x 2 threads: step ms (whole; blocked) | peak "
      "(whole; blocked) | step ratio | memory fraction | a2a %lld MB: memcpy / a2a "
      "|\n|---|---|---|---|---|---|---|---|\n",
      static_cast<long long>(a2a_mb));
  std::vector<double> ratios, fractions, a2a;
  auto args = [&](const char* threads) {
    return std::vector<std::string>{self_exe(),  "--worker",
                                    "--steps",   std::to_string(steps),
                                    "--threads", threads,
                                    "--heads",   std::to_string(heads),
                                    "--seq",     std::to_string(seq),
                                    "--a2a_mb",  std::to_string(a2a_mb)};
  };
  for (int r = 0; r < rounds; ++r) {
    const std::string cp = run_job(args("1"), 2, timeout_s, "bench_cp");
    const std::string one = run_job(args("2"), 1, timeout_s, "bench_cp");
    const double cp_ms = parse_value(cp, "step_ms"), whole_ms = parse_value(one, "step_ms");
    const double blocked_ms = parse_value(one, "blocked_ms"), one_ms = std::min(whole_ms, blocked_ms);
    const double cp_peak = parse_value(cp, "peak_bytes"), one_peak = parse_value(one, "peak_bytes");
    ratios.push_back(cp_ms / one_ms);
    fractions.push_back(cp_peak / one_peak);
    a2a.push_back(parse_value(cp, "memcpy_s") / parse_value(cp, "a2a_s"));
    std::printf("| %d | %.1f | %s | %.1f; %.1f | %s; %s | %.3f | %.3f | %.2f |\n", r, cp_ms,
                human_bytes(static_cast<size_t>(cp_peak)).c_str(), whole_ms, blocked_ms,
                human_bytes(static_cast<size_t>(one_peak)).c_str(),
                human_bytes(static_cast<size_t>(parse_value(one, "blocked_peak_bytes"))).c_str(), ratios.back(),
                fractions.back(), a2a.back());
  }
  auto spread = [](const std::vector<double>& v) {
    char buf[64];
    std::snprintf(buf, sizeof buf, "%.3f-%.3f", *std::min_element(v.begin(), v.end()),
                  *std::max_element(v.begin(), v.end()));
    return std::string(buf);
  };
  const double ratio = median(ratios), fraction = median(fractions), a2a_fraction = median(a2a);
  std::printf(
      "\nmemory fraction %.3f (goal <= 0.55: %s), step ratio %.3f (%s; goal <= 1.2: %s), all-to-all %.2f of memcpy "
      "(%s; goal >= 0.8: %s)\n",
      fraction, fraction <= 0.55 ? "met" : "missed", ratio, spread(ratios).c_str(), ratio <= 1.2 ? "met" : "missed",
      a2a_fraction, spread(a2a).c_str(), a2a_fraction >= 0.8 ? "met" : "missed");
  std::printf(
      "\nRESULT cp_attention_memory_fraction=%.3f cp_step_vs_one_process=%.3f a2a_16m_fraction_of_memcpy=%.2f\n",
      fraction, ratio, a2a_fraction);
  return 0;
}

}  // namespace

int main(int argc, char** argv) { return bench::main_of("bench_cp", argc, argv, worker_main, driver_main); }
