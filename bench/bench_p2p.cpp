// send/recv latency and bandwidth between 2 ranks of this host: shared memory (dtrain's default for
// ranks that share a host) vs Gloo over loopback TCP (DTRAIN_SHM=0), side by side in one run.
//
//   build/bin/bench_p2p [--reps 5] [--max_bytes 67108864]
//
// The driver starts one 2-rank job (bench/spawn.h). Each size is timed as a ping-pong (rank 0
// sends, rank 1 sends it back): one-way time = round trip / 2, bandwidth = bytes / one-way time.
// Both groups alternate, `reps` rounds each; the median is reported. One thread's memcpy bandwidth
// at 4 MB is measured in the same process for the RESULT line:
//   RESULT p2p_4k_us=X (shared memory, one-way time of a 4 KB message)
//          p2p_4m_fraction_of_memcpy=Y (shared-memory bandwidth at 4 MB / memcpy bandwidth at 4 MB)
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

// One-way seconds of a message of t's size on g: ping-pongs for ~target_s (at least 5) after warm-ups.
double time_one_way(at::Tensor& t, const dtrain::Group& g, double target_s) {
  const int rank = dtrain::rank();
  auto ping_pong = [&] {
    if (rank == 0) {
      dtrain::send(t, 1, g);
      dtrain::recv(t, 1, g);
    } else {
      dtrain::recv(t, 0, g);
      dtrain::send(t, 0, g);
    }
  };
  for (int i = 0; i < 3; ++i) ping_pong();
  dtrain::barrier(g);
  auto t0 = Clock::now();
  ping_pong();
  const double one = std::max(secs_since(t0), 1e-7);
  auto iters = at::full({1}, std::max(5.0, std::min(20000.0, target_s / one)), at::kDouble);
  dtrain::broadcast(iters, 0, g);  // both ranks run rank 0's count
  const int n = static_cast<int>(iters.item<double>());
  dtrain::barrier(g);
  t0 = Clock::now();
  for (int i = 0; i < n; ++i) ping_pong();
  auto x = at::full({1}, secs_since(t0) / n / 2, at::kDouble);
  dtrain::all_reduce(x, dtrain::ReduceOp::MAX, g);
  return x.item<double>();
}

int worker_main(int argc, char** argv) {
  int reps = 5;
  size_t max_bytes = size_t{64} << 20;
  CLI::App app{"bench_p2p worker"};
  app.add_option("--reps", reps);
  app.add_option("--max_bytes", max_bytes);
  CLI11_PARSE(app, argc, argv);
  dtrain::init_process_group();
  const int rank = dtrain::rank();
  dtrain::Group shm_group = dtrain::new_group({});
  setenv("DTRAIN_SHM", "0", 1);
  dtrain::Group gloo_group = dtrain::new_group({});
  unsetenv("DTRAIN_SHM");
  if (!shm_group.uses_shared_memory() || gloo_group.uses_shared_memory()) {
    std::fprintf(stderr, "bench_p2p: expected one shared-memory group and one Gloo group\n");
    return 1;
  }
  if (rank == 0) {
    std::printf("bench_p2p: 2 ranks, ping-pong, one-way time = round trip / 2, median of %d rounds (alternating)\n",
                reps);
    std::printf("%10s | %10s %10s | %10s %10s | %8s\n", "size", "shm us", "GB/s", "gloo us", "GB/s", "speedup");
  }
  double shm_4k = std::nan(""), shm_4m = std::nan("");
  for (size_t bytes = 4096; bytes <= max_bytes; bytes *= 4) {
    auto t = at::ones({static_cast<int64_t>(bytes)}, at::kByte);
    std::vector<double> shm_runs, gloo_runs;
    const double target = bytes >= (size_t{16} << 20) ? 0.4 : 0.15;
    for (int r = 0; r < reps; ++r) {
      shm_runs.push_back(time_one_way(t, shm_group, target));
      gloo_runs.push_back(time_one_way(t, gloo_group, target));
    }
    const double ts = median(shm_runs), tg = median(gloo_runs);
    if (bytes == 4096) shm_4k = ts;
    if (bytes == (size_t{4} << 20)) shm_4m = ts;
    if (rank == 0)
      std::printf("%10s | %10.1f %10.2f | %10.1f %10.2f | %7.1fx  (shm spread %.1f-%.1f us)\n",
                  human_bytes(bytes).c_str(), ts * 1e6, bytes / ts / 1e9, tg * 1e6, bytes / tg / 1e9, tg / ts,
                  *std::min_element(shm_runs.begin(), shm_runs.end()) * 1e6,
                  *std::max_element(shm_runs.begin(), shm_runs.end()) * 1e6);
    std::fflush(stdout);
  }
  const double mbw = memcpy_bandwidth(size_t{4} << 20, 21);
  if (rank == 0) {
    std::printf("one thread's memcpy at 4 MB: %.2f GB/s; load average: %s\n", mbw / 1e9, load_average().c_str());
    std::printf("RESULT p2p_4k_us=%.2f p2p_4m_fraction_of_memcpy=%.2f\n", shm_4k * 1e6,
                (size_t{4} << 20) / shm_4m / mbw);
  }
  dtrain::destroy_process_group();
  return 0;
}

int driver_main(int argc, char** argv) {
  return transfer_driver("bench_p2p", "send/recv over shared memory vs Gloo, 2 ranks on this host", argc, argv, 5,
                         size_t{64} << 20);
}

}  // namespace

int main(int argc, char** argv) { return bench::main_of("bench_p2p", argc, argv, worker_main, driver_main); }
