// all_reduce latency and bandwidth on 2 ranks of this host (or --world N): shared memory (dtrain's
// default for ranks that share a host) vs Gloo over loopback TCP (DTRAIN_SHM=0), side by side in one
// run, in the style of nccl-tests. float32 SUM, in place.
//
//   build/bin/bench_allreduce [--reps 3] [--max_bytes 268435456] [--world 2]
//
// The driver starts one job of --world ranks (bench/spawn.h). In it, each size is timed on both groups,
// alternating, `reps` rounds; the median time per op is reported. algbw = bytes / time; busbw =
// algbw * 2 (n-1) / n (nccl-tests' all_reduce convention; equal to algbw for 2 ranks). At 1, 16 and
// 64 MB each round also times one thread's memcpy of the same bytes on rank 0 (the others wait),
// so that every fraction compares two measurements of the same minutes. A fraction of memcpy is the
// memcpy's time over the all_reduce's (busbw over memcpy bandwidth):
//   RESULT small_speedup=X (Gloo time / shm time, geometric mean over sizes <= 1 MB)
//          large_fraction_of_memcpy=Y (shm at 64 MB; the same value as allreduce_64m_fraction_of_memcpy)
//          allreduce_1m_fraction_of_memcpy, allreduce_16m_fraction_of_memcpy,
//          allreduce_64m_fraction_of_memcpy (shm at that size against a memcpy of that size)
//          allreduce_4k_us (shm time of a 4 KB all_reduce, microseconds: the median, as in the table)
//          allreduce_4k_best_us (the same in the fastest of 300 batches of 50: what it costs while
//          both ranks run, which on a busy machine the median does not show)
//          cacheline_handoff_us (the floor of any synchronization between two processes: one way of a
//          ping-pong on one shared cache line, rank 0 and a forked child, after the job's groups are
//          gone; the fastest of 200 batches of 1000 round trips)
// On another world than 2 every key ends in _<world> (allreduce_1m_fraction_of_memcpy_4): the goals
// are for 2 ranks, and more ranks than this machine's cores measure its scheduler as much.
#include <ATen/ATen.h>
#include <sched.h>
#include <CLI/CLI.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <string>
#include <thread>
#include <vector>

#include "dtrain/process_group.h"
#include "spawn.h"

using namespace bench;

namespace {

// Seconds per all_reduce of t on g: enough iterations for ~target_s (at least 3) after 2 warm-ups.
double time_allreduce(at::Tensor& t, const dtrain::Group& g, double target_s) {
  for (int i = 0; i < 2; ++i) dtrain::all_reduce(t, dtrain::ReduceOp::SUM, g);
  // Agree on the iteration count (rank 0's estimate) so that both ranks run the same number.
  dtrain::barrier(g);
  auto t0 = Clock::now();
  dtrain::all_reduce(t, dtrain::ReduceOp::SUM, g);
  double one = std::max(secs_since(t0), 1e-6);
  auto iters = at::full({1}, std::max(3.0, std::min(2000.0, target_s / one)), at::kDouble);
  dtrain::broadcast(iters, 0, g);
  const int n = static_cast<int>(iters.item<double>());
  dtrain::barrier(g);
  t0 = Clock::now();
  for (int i = 0; i < n; ++i) dtrain::all_reduce(t, dtrain::ReduceOp::SUM, g);
  double per = secs_since(t0) / n;
  // Report the slower rank's time.
  auto x = at::full({1}, per, at::kDouble);
  dtrain::all_reduce(x, dtrain::ReduceOp::MAX, g);
  return x.item<double>();
}

// Microseconds per all_reduce of t on g in the fastest of `batches` batches of `per_batch` (rank 0's
// clock; every all_reduce waits for both ranks). On a busy machine the medians include time that
// either rank spent descheduled; the best batch is what the operation costs while both run.
double best_batch_us(at::Tensor& t, const dtrain::Group& g, int batches, int per_batch) {
  double best = INFINITY;
  dtrain::barrier(g);
  for (int b = 0; b < batches; ++b) {
    const auto t0 = Clock::now();
    for (int i = 0; i < per_batch; ++i) dtrain::all_reduce(t, dtrain::ReduceOp::SUM, g);
    best = std::min(best, secs_since(t0) / per_batch);
  }
  return best * 1e6;
}

// BENCH_PIN_RANKS=1: rank r runs on CPU r only. On a machine busier than it has cores, two unpinned
// ranks at times share one core, and then every wait for the peer spins out its whole spin phase
// before the peer can run: the times measure the scheduler, not the transport.
void pin_to_cpu(int rank) {
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(rank % static_cast<int>(std::thread::hardware_concurrency()), &set);
  if (sched_setaffinity(0, sizeof(set), &set) != 0) std::perror("bench_allreduce: sched_setaffinity");
}

int worker_main(int argc, char** argv) {
  int reps = 3;
  size_t max_bytes = size_t{256} << 20;
  CLI::App app{"bench_allreduce worker"};
  app.add_option("--reps", reps);
  app.add_option("--max_bytes", max_bytes);
  CLI11_PARSE(app, argc, argv);
  dtrain::init_process_group();
  const int rank = dtrain::rank(), world = dtrain::world_size();
  if (const char* pin = std::getenv("BENCH_PIN_RANKS"); pin && std::string(pin) == "1") pin_to_cpu(rank);
  dtrain::Group shm_group = dtrain::new_group({});
  setenv("DTRAIN_SHM", "0", 1);
  dtrain::Group gloo_group = dtrain::new_group({});
  unsetenv("DTRAIN_SHM");
  if (!shm_group.uses_shared_memory() || gloo_group.uses_shared_memory()) {
    std::fprintf(stderr, "bench_allreduce: expected one shared-memory group and one Gloo group\n");
    return 1;
  }
  if (rank == 0) {
    std::printf("bench_allreduce: %d ranks, float32 SUM in place, median of %d rounds (alternating)\n", world, reps);
    std::printf("%10s %12s | %10s %10s %10s | %10s %10s %10s | %8s\n", "size", "count", "shm us", "algbw GB/s",
                "busbw GB/s", "gloo us", "algbw GB/s", "busbw GB/s", "speedup");
  }
  const double bus = 2.0 * (world - 1) / world;
  std::vector<double> small_speedups;
  // fractions[i]: shm busbw over memcpy bandwidth at kFractionBytes[i].
  const size_t kFractionBytes[] = {size_t{1} << 20, size_t{16} << 20, size_t{64} << 20};
  double fractions[] = {std::nan(""), std::nan(""), std::nan("")};
  std::vector<double> memcpy_at;
  double us_4k = std::nan("");
  for (size_t bytes = 4096; bytes <= max_bytes; bytes *= 2) {
    auto t = at::ones({static_cast<int64_t>(bytes / 4)}, at::kFloat);
    std::vector<double> shm_runs, gloo_runs, memcpy_runs;
    const double target = bytes >= (size_t{16} << 20) ? 0.5 : 0.15;
    const auto fraction_at = std::find(std::begin(kFractionBytes), std::end(kFractionBytes), bytes);
    for (int r = 0; r < reps; ++r) {
      shm_runs.push_back(time_allreduce(t, shm_group, target));
      gloo_runs.push_back(time_allreduce(t, gloo_group, target));
      if (fraction_at != std::end(kFractionBytes)) {
        // Enough copies that the small one is not one timer tick: ~0.1 s of memcpy either way.
        if (rank == 0) memcpy_runs.push_back(memcpy_bandwidth(bytes, bytes >= (size_t{16} << 20) ? 9 : 101));
        dtrain::barrier(shm_group);
      }
    }
    const double ts = median(shm_runs), tg = median(gloo_runs);
    if (bytes <= (size_t{1} << 20)) small_speedups.push_back(tg / ts);
    if (bytes == 4096) us_4k = ts * 1e6;
    if (fraction_at != std::end(kFractionBytes) && rank == 0) {
      memcpy_at.push_back(median(memcpy_runs));
      fractions[fraction_at - std::begin(kFractionBytes)] = bytes / ts * bus / memcpy_at.back();
    }
    if (rank == 0)
      std::printf("%10s %12zu | %10.1f %10.2f %10.2f | %10.1f %10.2f %10.2f | %7.1fx\n", human_bytes(bytes).c_str(),
                  bytes / 4, ts * 1e6, bytes / ts / 1e9, bytes / ts * bus / 1e9, tg * 1e6, bytes / tg / 1e9,
                  bytes / tg * bus / 1e9, tg / ts);
    std::fflush(stdout);
  }
  auto small = at::ones({1024}, at::kFloat);
  const double best_4k = best_batch_us(small, shm_group, 300, 50);
  double log_sum = 0;
  for (double s : small_speedups) log_sum += std::log(s);
  const double geo = std::exp(log_sum / small_speedups.size());
  dtrain::destroy_process_group();
  if (rank == 0) {
    const double handoff = cache_line_handoff();
    const std::string w = world_suffix(world);
    const char* s = w.c_str();
    std::printf("one thread's memcpy GB/s at 1, 16, 64 MB (median of the rounds):");
    for (double m : memcpy_at) std::printf(" %.2f", m / 1e9);
    std::printf("; load average: %s\n", load_average().c_str());
    std::printf(
        "RESULT small_speedup%s=%.1f large_fraction_of_memcpy%s=%.2f allreduce_1m_fraction_of_memcpy%s=%.2f "
        "allreduce_16m_fraction_of_memcpy%s=%.2f allreduce_64m_fraction_of_memcpy%s=%.2f allreduce_4k_us%s=%.2f "
        "allreduce_4k_best_us%s=%.2f cacheline_handoff_us%s=%.3f\n",
        s, geo, s, fractions[2], s, fractions[0], s, fractions[1], s, fractions[2], s, us_4k, s, best_4k, s,
        handoff * 1e6);
  }
  return 0;
}

int driver_main(int argc, char** argv) {
  return transfer_driver("bench_allreduce", "all_reduce over shared memory vs Gloo, ranks on this host", argc, argv, 3,
                         size_t{256} << 20, /*any_world=*/true);
}

}  // namespace

int main(int argc, char** argv) { return bench::main_of("bench_allreduce", argc, argv, worker_main, driver_main); }
