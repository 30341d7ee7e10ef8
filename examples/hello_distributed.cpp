// hello_distributed: the tutorial's monitor_training() in C++ (dtrain::monitor_training(): rank, world
// size, backend, device and memory of every rank) plus an all_reduce check.
//
//   ./build/bin/dtrain-run --standalone --nproc_per_node 2 ./build/bin/hello_distributed
//
// Python (the tutorial):                      C++ (dtrain):
//   dist.init_process_group("gloo")             dtrain::init_process_group(InitOptions().backend("gloo"))
//   dist.get_rank(), dist.get_world_size()      dtrain::rank(), dtrain::world_size()
//   dist.get_backend()                          dtrain::backend()
//   dist.all_reduce(t)                          dtrain::all_reduce(t)
#include <chrono>
#include <cstdio>
#include <iostream>
#include <thread>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <CLI/CLI.hpp>

#include "dtrain/dtrain.h"

namespace {

int64_t unix_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"hello_distributed: process-group status and an all_reduce check"};
  std::string backend = "gloo", init_method = "env://";
  double timeout_s = 0;
  int local_rank_arg = -1;
  bool report_times = false;
  double hold_s = 0;
  app.add_option("--backend", backend, "gloo or nccl");
  app.add_option("--init_method", init_method, "env://, tcp://host:port or file:///path");
  app.add_option("--timeout_s", timeout_s, "rendezvous and collective timeout in seconds (default 1800)");
  app.add_option("--local_rank,--local-rank", local_rank_arg, "passed by dtrain-run --use_local_rank_arg");
  app.add_flag("--report_times", report_times, "print when this rank passed its first barrier");
  app.add_option("--hold_s", hold_s, "stay in the process group this many seconds after the check (tests)");
  CLI11_PARSE(app, argc, argv);

  try {
    // doc:begin init
    dtrain::InitOptions opts;
    opts.backend(backend).init_method(init_method);
    if (timeout_s > 0) opts.timeout(std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000)));
    dtrain::init_process_group(opts);
    dtrain::barrier();
    // doc:end init
    if (report_times) std::printf("first_barrier_unix_ns=%lld\n", static_cast<long long>(unix_ns()));

    // doc:begin monitor
    dtrain::monitor_training();  // the tutorial's monitor_training(), one call (dtrain/monitor.h)
    dtrain::warn_if_slow_blas();
    // doc:end monitor

    // doc:begin all-reduce
    // Every rank contributes rank+1: the sum is n(n+1)/2 everywhere.
    const int n = dtrain::world_size();
    at::Tensor t = at::full({4}, dtrain::rank() + 1.0f);
    dtrain::all_reduce(t);
    // doc:end all-reduce
    const float expected = n * (n + 1) / 2.0f;
    if (!at::allclose(t, at::full({4}, expected))) {
      std::fprintf(stderr, "hello_distributed: rank %d: all_reduce gave %f, expected %f\n", dtrain::rank(),
                   t[0].item<float>(), expected);
      return 1;
    }
    std::printf("all_reduce check passed: sum of (rank+1) over %d ranks = %.0f\n", n, expected);
    if (hold_s > 0) {
      std::fflush(stdout);
      std::this_thread::sleep_for(std::chrono::milliseconds(static_cast<int64_t>(hold_s * 1000)));
    }
    dtrain::destroy_process_group();
    if (report_times) std::printf("peak_rss_kb=%lld\n", static_cast<long long>(dtrain::peak_rss_bytes() / 1024));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "hello_distributed: error: %s\n", e.what());
    return 1;
  }
  return 0;
}
