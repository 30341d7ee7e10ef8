// all_reduce latency and bandwidth on 2 ranks of this host: shared memory (dtrain's default for
// ranks that share a host) vs Gloo over loopback TCP (DTRAIN_SHM=0), side by side in one run, in the
// style of nccl-tests. float32 SUM, in place.
//
//   build/bin/bench_allreduce [--reps 3] [--max_bytes 268435456]
//
// The driver starts one 2-rank job (bench/spawn.h). In it, each size is timed on both groups,
// alternating, `reps` rounds; the median time per op is reported. algbw = bytes / time; busbw =
// algbw * 2 (n-1) / n (nccl-tests' all_reduce convention; equal to algbw for 2 ranks). One thread's
// memcpy bandwidth at 64 MB is measured in the same process for the RESULT line:
//   RESULT small_speedup=X (Gloo time / shm time, geometric mean over sizes <= 1 MB)
//          large_fraction_of_memcpy=Y (shm busbw at 64 MB / memcpy bandwidth)
#include <ATen/ATen.h>
#include <CLI/CLI.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
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

int worker_main(int argc, char** argv) {
  int reps = 3;
  size_t max_bytes = size_t{256} << 20;
  CLI::App app{"bench_allreduce worker"};
  app.add_option("--reps", reps);
  app.add_option("--max_bytes", max_bytes);
  CLI11_PARSE(app, argc, argv);
  dtrain::init_process_group();
  const int rank = dtrain::rank(), world = dtrain::world_size();
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
  double shm_busbw_64 = std::nan("");
  for (size_t bytes = 4096; bytes <= max_bytes; bytes *= 2) {
    auto t = at::ones({static_cast<int64_t>(bytes / 4)}, at::kFloat);
    std::vector<double> shm_runs, gloo_runs;
    const double target = bytes >= (size_t{16} << 20) ? 0.5 : 0.15;
    for (int r = 0; r < reps; ++r) {
      shm_runs.push_back(time_allreduce(t, shm_group, target));
      gloo_runs.push_back(time_allreduce(t, gloo_group, target));
    }
    const double ts = median(shm_runs), tg = median(gloo_runs);
    if (bytes <= (size_t{1} << 20)) small_speedups.push_back(tg / ts);
    if (bytes == (size_t{64} << 20)) shm_busbw_64 = bytes / ts * bus;
    if (rank == 0)
      std::printf("%10s %12zu | %10.1f %10.2f %10.2f | %10.1f %10.2f %10.2f | %7.1fx\n", human_bytes(bytes).c_str(),
                  bytes / 4, ts * 1e6, bytes / ts / 1e9, bytes / ts * bus / 1e9, tg * 1e6, bytes / tg / 1e9,
                  bytes / tg * bus / 1e9, tg / ts);
    std::fflush(stdout);
  }
  double log_sum = 0;
  for (double s : small_speedups) log_sum += std::log(s);
  const double geo = std::exp(log_sum / small_speedups.size());
  const double mbw = memcpy_bandwidth(size_t{64} << 20);
  if (rank == 0) {
    std::printf("one thread's memcpy at 64 MB: %.2f GB/s; load average: %s\n", mbw / 1e9, load_average().c_str());
    std::printf("RESULT small_speedup=%.1f large_fraction_of_memcpy=%.2f\n", geo, shm_busbw_64 / mbw);
  }
  dtrain::destroy_process_group();
  return 0;
}

int driver_main(int argc, char** argv) {
  return transfer_driver("bench_allreduce", "all_reduce over shared memory vs Gloo, 2 ranks on this host", argc, argv,
                         3, size_t{256} << 20);
}

}  // namespace

int main(int argc, char** argv) { return bench::main_of("bench_allreduce", argc, argv, worker_main, driver_main); }
