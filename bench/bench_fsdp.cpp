// bench_fsdp: what fully_shard saves and costs against DistributedDataParallel, on ranks of this host.
//
//   ./build/bin/bench_fsdp [--layers 72 --width 2048] [--steps 7] [--parts memory,step,collectives,fits]
//
// Memory: a Sequential of --layers x (Linear width-width, Tanh), about 302 M float32 parameters by
// default, trained one step with Adam under DDP (2 ranks) and under fully_shard (2 and 4 ranks, each
// Linear a unit). Every rank counts the bytes its CPU allocator holds (dtrain's counting allocator
// wraps LibTorch's: every tensor's storage, not RSS) after the step, when parameters, gradients and
// Adam's state are what is left, and the peak during the step:
//   RESULT fsdp_state_fraction_2=X fsdp_state_fraction_4=Y   (goal: <= 1/N + largest unit / DDP's state + 0.05)
// DDP's bytes per rank do not depend on N, so both fractions divide by the 2-rank DDP job's.
// Speed, on a model that fits both ways (8 x Linear 1024, batch 64), 2 ranks over shared memory: the
// median step (forward, backward, Adam) of fully_shard over DDP's, the two jobs alternated --reps
// times:  RESULT fsdp_step_vs_ddp=R   (goal <= 1.25); each step line also gives both jobs' page
// faults per step (fresh pages touched: buffers the allocator did not reuse) and CPU time per step
// (rank 0's process, user and system: what faults cost, less moved by other load than wall time).
// Traffic: the bytes each rank received through fully_shard's collectives in one step, over
// 3 * P * (N - 1) / N float32 (ZeRO-3) and 2 * P * (N - 1) / N (ZeRO-2, reshard_after_forward false):
//   RESULT fsdp_bytes_per_step_ratio=Z3 fsdp2_bytes_per_step_ratio=Z2   (goal: within 1%)
// Collectives: the shared-memory reduce_scatter_tensor and all_gather_into_tensor of 16 MB (output
// of the gather, input of the scatter) on 2 ranks, against one core's memcpy of 16 MB in the same
// job: memcpy's time over the collective's:
//   RESULT rs_16m_fraction_of_memcpy=A ag_16m_fraction_of_memcpy=B   (goal >= 0.8)
// and the all-gather in place, as FSDP2 calls it (the input this rank's slice of the output: the
// own part needs no copy, so a rank copies its part in and the others' out, memcpy's bytes):
//   RESULT ag_16m_in_place_fraction_of_memcpy=C
// A budget only sharding fits: each rank of a 2-rank job in a memory cgroup of its own (cgroup v1's
// memory.limit_in_bytes, or v2's memory.max; the kernel kills a rank that exceeds it) of
// 13 bytes per parameter + 400 MB, for --fit_layers x Linear 2048 with Adam (DDP: 20 bytes per
// parameter with its buckets, and the runtime; fully_shard on 2 ranks: 8, the whole model while it is
// built, and a unit whole). 20 steps each:
//   RESULT fits_only_sharded=1   (DDP exceeded the budget, fully_shard trained within it; 0 otherwise)
// Peak RSS, what the kernel (an out-of-memory killer, a cgroup limit) sees rather than the allocator's
// bytes: --rss_layers x Linear(--rss_width), 5 x 2048 (21 M parameters) by default, --rss_steps Adam
// steps under DDP and under fully_shard (each Linear a unit), on 2, 3 and 4 ranks (--rss_worlds),
// malloc as a program finds it; each rank's VmHWM from the first step on (reset through
// /proc/self/clear_refs once the model is wrapped). The largest fully_shard rank's over the largest
// DDP rank's of the same world size, over shared memory and over Gloo alone (DTRAIN_SHM=0, the path
// between hosts):
//   RESULT fsdp_peak_rss_fraction_2=S fsdp_peak_rss_fraction_2_gloo=G   (goal <= 0.65 each; the floor is
//   about half the state, one unit whole and the runtime over DDP's)
//          fsdp_peak_rss_fraction_3=, _3_gloo=, _4=, _4_gloo=   (reported: 4 ranks on 2 cores)
#include <malloc.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <CLI/CLI.hpp>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adam.h>

#include "dtrain/ddp.h"
#include "dtrain/fsdp.h"
#include "dtrain/process_group.h"
#include "counting_allocator.h"
#include "spawn.h"

namespace {

using namespace bench;

torch::nn::Sequential make_model(int layers, int64_t width) {
  torch::manual_seed(0);
  torch::nn::Sequential net;
  for (int i = 0; i < layers; ++i) {
    net->push_back(torch::nn::Linear(width, width));
    net->push_back(torch::nn::Tanh());
  }
  return net;
}

dtrain::FSDPModule<torch::nn::SequentialImpl> shard(torch::nn::Sequential& net, bool zero3) {
  auto options = dtrain::FullyShardOptions().reshard_after_forward(zero3);
  for (auto& layer : *net)
    if (!layer.ptr()->parameters().empty()) dtrain::fully_shard(layer, options);
  return dtrain::fully_shard(net.ptr(), options);
}

// --job memory: one Adam step, then this rank's allocator bytes.
void memory_job(const std::string& mode, int layers, int64_t width, CountingAllocator* counter) {
  auto net = make_model(layers, width);
  int64_t params = 0;
  for (const auto& p : net->parameters()) params += p.numel();
  const at::Tensor x = at::randn({4, width});
  counter->reset_peak();
  if (mode == "ddp") {
    dtrain::DistributedDataParallel ddp(net);
    torch::optim::Adam opt(ddp.parameters(), torch::optim::AdamOptions(1e-3));
    ddp(x).pow(2).mean().backward();
    opt.step();
    std::printf("params=%lld live=%lld peak=%lld\n", static_cast<long long>(params),
                static_cast<long long>(counter->live()), static_cast<long long>(counter->peak()));
  } else {
    auto fsdp = shard(net, true);
    torch::optim::Adam opt(net->parameters(), torch::optim::AdamOptions(1e-3));
    fsdp(x).pow(2).mean().backward();
    opt.step();
    std::printf("params=%lld live=%lld peak=%lld unit=%lld\n", static_cast<long long>(params),
                static_cast<long long>(counter->live()), static_cast<long long>(counter->peak()),
                static_cast<long long>((width * width + width) * 4));
  }
}

// Moves this process into a new memory cgroup limited to `bytes` (v1 or v2): what the kernel
// enforces, whoever allocates (LibTorch, the transport, the runtime). Throws when neither is writable.
void enter_memory_budget(int64_t bytes) {
  namespace fs = std::filesystem;
  const std::string name = "dtrain_bench_fsdp_" + std::to_string(::getpid());
  auto write = [](const fs::path& file, const std::string& value) {
    std::ofstream f(file);
    f << value;
    f.close();
    if (!f) throw std::runtime_error("cannot write " + value + " to " + file.string());
  };
  fs::path dir;
  std::vector<std::pair<std::string, std::string>> limits;
  if (fs::exists("/sys/fs/cgroup/memory/memory.limit_in_bytes")) {  // v1
    dir = fs::path("/sys/fs/cgroup/memory") / name;
    limits = {{"memory.limit_in_bytes", std::to_string(bytes)}};
    if (fs::exists("/sys/fs/cgroup/memory/memory.memsw.limit_in_bytes"))
      limits.emplace_back("memory.memsw.limit_in_bytes", std::to_string(bytes));  // no escape into swap
  } else {                                                                        // v2
    dir = fs::path("/sys/fs/cgroup") / name;
    limits = {{"memory.max", std::to_string(bytes)}, {"memory.swap.max", "0"}};
  }
  std::error_code ec;
  fs::create_directory(dir, ec);
  if (ec) throw std::runtime_error("cannot create the memory cgroup " + dir.string() + ": " + ec.message());
  for (const auto& [file, value] : limits)
    if (fs::exists(dir / file)) write(dir / file, value);
  write(dir / "cgroup.procs", std::to_string(::getpid()));
  std::printf("budget=%lld cgroup=%s\n", static_cast<long long>(bytes), dir.c_str());
}

// This process's /proc/self/status field, kB (-1 when absent).
int64_t status_kb(const char* field) {
  std::ifstream status("/proc/self/status");
  const std::string prefix = std::string(field) + ":";
  for (std::string line; std::getline(status, line);)
    if (line.rfind(prefix, 0) == 0) return std::atoll(line.substr(prefix.size()).c_str());
  return -1;
}

// --job fits: 20 Adam steps of the --fit_layers model inside a per-rank memory budget.
void fits_job(const std::string& mode, int layers, int64_t budget) {
  // Blocks of 1 MB and more from mmap, returned at free: a heap that keeps every freed unit's
  // whole parameters would count against the budget (both jobs alike).
  mallopt(M_MMAP_THRESHOLD, 1 << 20);
  enter_memory_budget(budget);
  auto net = make_model(layers, 2048);
  const at::Tensor x = at::randn({4, 2048});
  auto train = [&](auto& model, std::vector<at::Tensor> params) {
    torch::optim::Adam opt(params, torch::optim::AdamOptions(1e-4));
    for (int i = 0; i < 20; ++i) {
      opt.zero_grad();
      model(x).pow(2).mean().backward();
      opt.step();
    }
  };
  if (mode == "ddp") {
    dtrain::DistributedDataParallel ddp(net);
    train(ddp, ddp.parameters());
  } else {
    auto fsdp = shard(net, true);
    train(fsdp, net->parameters());
  }
  std::printf("peak_rss_kb=%lld\n", static_cast<long long>(status_kb("VmHWM")));
  std::printf("steps_done=20\n");
}

// --job rss: --steps Adam steps of --layers x Linear(--width), the allocator left as a program finds
// it (no mallopt), then the peak RSS of the steps: the high-water mark is reset (/proc/self/clear_refs
// "5") once the model is wrapped and before the first step, so it counts what training holds (freed
// buffers kept resident included), not the whole model as it is built. Rank 0 prints every rank's.
void rss_job(const std::string& mode, int layers, int64_t width, int steps, CountingAllocator* counter) {
  auto net = make_model(layers, width);
  const at::Tensor x = at::randn({8, width});
  auto train = [&](auto& model, std::vector<at::Tensor> params) {
    torch::optim::Adam opt(params, torch::optim::AdamOptions(1e-4));
    {
      std::ofstream clear("/proc/self/clear_refs");
      clear << "5";
    }
    const int64_t start_kb = status_kb("VmRSS");
    counter->reset_peak();
    for (int i = 0; i < steps; ++i) {
      opt.zero_grad();
      model(x).pow(2).mean().backward();
      opt.step();
    }
    // Read before the gather below adds anything, the model and its optimizer still alive.
    return at::tensor({status_kb("VmHWM"), start_kb, status_kb("VmRSS"), status_kb("RssShmem"), counter->live() >> 10,
                       counter->peak() >> 10},
                      at::kLong);
  };
  at::Tensor mine;
  if (mode == "ddp") {
    dtrain::DistributedDataParallel ddp(net);
    mine = train(ddp, ddp.parameters());
  } else {
    auto fsdp = shard(net, true);
    mine = train(fsdp, net->parameters());
  }
  at::Tensor all = at::empty({dtrain::world_size() * mine.numel()}, at::kLong);
  dtrain::all_gather_into_tensor(all, mine);
  const auto* v = all.data_ptr<int64_t>();
  for (int r = 0; r < dtrain::world_size(); ++r, v += mine.numel())
    std::printf(
        "rank%d_peak_rss_kb=%lld rank%d_start_rss_kb=%lld rank%d_end_rss_kb=%lld rank%d_shmem_kb=%lld "
        "rank%d_live_kb=%lld rank%d_alloc_peak_kb=%lld\n",
        r, static_cast<long long>(v[0]), r, static_cast<long long>(v[1]), r, static_cast<long long>(v[2]), r,
        static_cast<long long>(v[3]), r, static_cast<long long>(v[4]), r, static_cast<long long>(v[5]));
}

// Page faults this process took so far (first touches of fresh pages: allocations the heap did not reuse).
int64_t minor_faults() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return u.ru_minflt;
}

// CPU time (user and system) this process used so far, in ms: a step's cost less sensitive to other
// processes on the machine than its wall time.
double cpu_ms() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return 1e3 * (u.ru_utime.tv_sec + u.ru_stime.tv_sec) + 1e-3 * (u.ru_utime.tv_usec + u.ru_stime.tv_usec);
}

// --job step / traffic: timed steps on the small model.
void step_job(const std::string& mode, int steps, bool zero3) {
  auto net = make_model(8, 1024);
  int64_t params = 0;
  for (const auto& p : net->parameters()) params += p.numel();
  const at::Tensor x = at::randn({64 / dtrain::world_size(), 1024});
  std::vector<double> step_s;
  int64_t faults = 0;
  double cpu0 = 0;
  auto run = [&](auto& model) {
    torch::optim::Adam opt(net->parameters(), torch::optim::AdamOptions(1e-3));
    for (int i = 0; i <= steps; ++i) {
      if (i == 1) {
        faults = minor_faults();
        cpu0 = cpu_ms();
      }
      const auto t0 = Clock::now();
      opt.zero_grad();
      model(x).pow(2).mean().backward();
      opt.step();
      if (i > 0) step_s.push_back(secs_since(t0));  // the first builds buckets, accumulators, state
    }
  };
  if (mode == "ddp") {
    dtrain::DistributedDataParallel ddp(net);
    run(ddp);
  } else {
    auto fsdp = shard(net, zero3);
    const int64_t before = fsdp.received_bytes();
    run(fsdp);
    std::printf("received_per_step=%.1f\n", static_cast<double>(fsdp.received_bytes() - before) / (steps + 1));
  }
  std::printf("params=%lld step_ms=%.3f faults_per_step=%.0f cpu_ms_per_step=%.2f\n", static_cast<long long>(params),
              1e3 * median(step_s), static_cast<double>(minor_faults() - faults) / steps, (cpu_ms() - cpu0) / steps);
}

// --job collectives: 16 MB shared-memory reduce-scatter and all-gather against memcpy, each repetition
// timing a memcpy of 16 MB on every rank at once right before the three collectives, so that a ratio
// compares times of the same moment (this machine's memory bandwidth changes from minute to minute).
void collectives_job(int reps) {
  const int n = dtrain::world_size();
  const int64_t bytes = 16 << 20, elems = bytes / 4;
  at::Tensor whole = at::randn({elems}), part = at::empty({elems / n});
  // In place, as FSDP2 calls it: the input is this rank's slice of the output, which needs no copy.
  at::Tensor own = whole.narrow(0, dtrain::rank() * (elems / n), elems / n);
  std::vector<char> from(static_cast<size_t>(bytes), 1), to(static_cast<size_t>(bytes), 2);
  std::vector<double> rs, ag, ag_in_place, copy;
  auto timed = [](std::vector<double>& into, bool keep, const std::function<void()>& fn) {
    dtrain::barrier();
    const auto t0 = Clock::now();
    fn();
    if (keep) into.push_back(secs_since(t0));
  };
  for (int i = 0; i <= reps; ++i) {
    timed(copy, i > 0, [&] { std::memcpy(to.data(), from.data(), from.size()); });
    timed(rs, i > 0, [&] { dtrain::reduce_scatter_tensor(part, whole, dtrain::ReduceOp::SUM); });
    timed(ag, i > 0, [&] { dtrain::all_gather_into_tensor(whole, part); });
    timed(ag_in_place, i > 0, [&] { dtrain::all_gather_into_tensor(whole, own); });
  }
  auto fraction = [&](const std::vector<double>& t) {
    std::vector<double> r;
    for (size_t i = 0; i < t.size(); ++i) r.push_back(copy[i] / t[i]);
    return median(r);
  };
  // Also memcpy back to back, the same buffers again and again (partly in the 32 MB cache of this
  // machine: faster than a copy of bytes the collectives just pushed out of it), for the page.
  const double back_to_back = static_cast<double>(bytes) / memcpy_bandwidth(static_cast<size_t>(bytes));
  std::printf(
      "rs_fraction=%.3f ag_fraction=%.3f ag_in_place_fraction=%.3f rs_ms=%.3f ag_ms=%.3f ag_in_place_ms=%.3f "
      "memcpy_ms=%.3f memcpy_back_to_back_ms=%.3f\n",
      fraction(rs), fraction(ag), fraction(ag_in_place), 1e3 * median(rs), 1e3 * median(ag), 1e3 * median(ag_in_place),
      1e3 * median(copy), 1e3 * back_to_back);
}

int worker_main(int argc, char** argv) {
  CLI::App app{"bench_fsdp worker"};
  std::string job, mode = "fsdp";
  int steps = 7, layers = 72;
  int64_t width = 2048, budget = 0;
  bool zero3 = true;
  app.add_option("--budget", budget);
  app.add_option("--job", job)->required();
  app.add_option("--mode", mode);
  app.add_option("--steps", steps);
  app.add_option("--layers", layers);
  app.add_option("--width", width);
  app.add_option("--zero3", zero3);
  CLI11_PARSE(app, argc, argv);
  CountingAllocator* counter = install_counting_allocator();
  at::set_num_threads(1);
  dtrain::init_process_group();
  if (job == "memory")
    memory_job(mode, layers, width, counter);
  else if (job == "fits")
    fits_job(mode, layers, budget);
  else if (job == "rss")
    rss_job(mode, layers, width, steps, counter);
  else if (job == "step")
    step_job(mode, steps, zero3);
  else
    collectives_job(steps);
  dtrain::destroy_process_group();
  return 0;
}

// The peak RSS of DDP and fully_shard on n ranks, over shared memory and over Gloo alone
// (DTRAIN_SHM=0, the path between hosts): each rank's, and the largest fully_shard rank's over the
// largest DDP rank's into fraction[0] (shared memory) and fraction[1] (Gloo).
template <typename Job>
void rss_table(Job& job, int n, int layers, int64_t width, int steps, double* fraction) {
  const std::vector<std::string> args = {"--job",    "rss",
                                         "--layers", std::to_string(layers),
                                         "--width",  std::to_string(width),
                                         "--steps",  std::to_string(steps)};
  const double params = layers * static_cast<double>(width * width + width);
  std::printf(
      "\npeak RSS: %d x Linear %lld (%.1f M parameters), Adam, %d steps, %d ranks (kernel's VmHWM from "
      "the first step on; ranks 0 and 1 shown, the largest of all counted)\n\n",
      layers, static_cast<long long>(width), params / 1e6, steps, n);
  std::printf(
      "| transport | job | peak RSS rank 0, 1 | RSS before the steps | after them (of it shared memory) | "
      "allocator peak | over DDP's |\n|---|---|---|---|---|---|---|\n");
  const char* names[2] = {"shared memory", "Gloo (DTRAIN_SHM=0)"};
  for (int t = 0; t < 2; ++t) {
    const std::vector<std::pair<std::string, std::string>> env = {{"DTRAIN_SHM", t == 0 ? "" : "0"}};
    double ddp_peak = 0;
    for (const char* mode : {"ddp", "fsdp"}) {
      std::vector<std::string> a = args;
      a.insert(a.end(), {"--mode", mode});
      const std::string out = job(a, n, env);
      auto kb = [&](int r, const char* key) { return parse_value(out, "rank" + std::to_string(r) + "_" + key); };
      double peak = 0;
      for (int r = 0; r < n; ++r) peak = std::max(peak, kb(r, "peak_rss_kb"));
      if (std::string(mode) == "ddp") ddp_peak = peak;
      if (std::string(mode) == "fsdp") fraction[t] = peak / ddp_peak;
      std::printf(
          "| %s | %s | %.0f, %.0f MiB | %.0f, %.0f MiB | %.0f (%.0f), %.0f (%.0f) MiB | %.0f, %.0f MiB | %.3f |\n",
          names[t], std::string(mode) == "ddp" ? "DDP" : "fully_shard", kb(0, "peak_rss_kb") / 1024,
          kb(1, "peak_rss_kb") / 1024, kb(0, "start_rss_kb") / 1024, kb(1, "start_rss_kb") / 1024,
          kb(0, "end_rss_kb") / 1024, kb(0, "shmem_kb") / 1024, kb(1, "end_rss_kb") / 1024, kb(1, "shmem_kb") / 1024,
          kb(0, "alloc_peak_kb") / 1024, kb(1, "alloc_peak_kb") / 1024, peak / ddp_peak);
    }
  }
  std::printf("\n");
}

int driver_main(int argc, char** argv) {
  CLI::App app{"fully_shard against DDP: bytes per rank, step time, traffic, collectives"};
  double timeout_s = 600;
  int steps = 7, reps = 3, layers = 72, fit_layers = 24;
  int64_t width = 2048;
  app.add_option("--fit_layers", fit_layers, "Linear 2048 layers of the model only sharding fits (0: skip)");
  app.add_option("--timeout", timeout_s, "seconds per job");
  app.add_option("--steps", steps, "timed steps per job");
  app.add_option("--reps", reps, "alternations of the DDP and fully_shard step jobs");
  app.add_option("--layers", layers, "Linear layers of the memory model");
  app.add_option("--width", width, "their width");
  int rss_layers = 5, rss_steps = 10;
  int64_t rss_width = 2048;
  app.add_option("--rss_layers", rss_layers, "Linear layers of the peak-RSS model");
  app.add_option("--rss_width", rss_width, "their width");
  app.add_option("--rss_steps", rss_steps, "Adam steps of the peak-RSS jobs");
  std::vector<int> rss_worlds{2, 3, 4};
  app.add_option("--rss_worlds", rss_worlds, "world sizes of the peak-RSS jobs (default 2 3 4)")
      ->check(CLI::Range(2, 64));
  std::string parts = "memory,step,collectives,fits,rss";
  app.add_option("--parts", parts, "which measures to run, comma-separated (memory, step, collectives, fits, rss)");
  CLI11_PARSE(app, argc, argv);
  auto part = [&](const char* name) {
    return ("," + parts + ",").find(std::string(",") + name + ",") != std::string::npos;
  };
  if (!part("fits")) fit_layers = 0;
  std::printf("bench_fsdp: load %s\n\n", load_average().c_str());
  const std::vector<std::string> self = {self_exe(), "--worker"};
  auto job = [&](std::vector<std::string> args, int n,
                 const std::vector<std::pair<std::string, std::string>>& env = {}) {
    std::vector<std::string> argv = self;
    argv.insert(argv.end(), args.begin(), args.end());
    return run_job(argv, n, timeout_s, "bench_fsdp", env);
  };
  const std::vector<std::string> model = {"--layers", std::to_string(layers), "--width", std::to_string(width)};
  auto with_model = [&](std::vector<std::string> a) {
    a.insert(a.end(), model.begin(), model.end());
    return a;
  };
  double fraction[5] = {0, 0, 0, 0, 0};
  if (part("memory")) {
    const std::string ddp = job(with_model({"--job", "memory", "--mode", "ddp"}), 2);
    const double ddp_live = parse_value(ddp, "live"), params = parse_value(ddp, "params");
    std::printf("memory: %d x Linear %lld (%.0f M parameters), Adam, bytes held after one step\n\n", layers,
                static_cast<long long>(width), params / 1e6);
    std::printf("| job | bytes per rank (allocator) | peak in the step | over DDP's | goal |\n|---|---|---|---|---|\n");
    std::printf("| DDP, 2 ranks | %s | %s | 1 | - |\n", human_bytes(static_cast<size_t>(ddp_live)).c_str(),
                human_bytes(static_cast<size_t>(parse_value(ddp, "peak"))).c_str());
    for (int n : {2, 4}) {
      const std::string out = job(with_model({"--job", "memory", "--mode", "fsdp"}), n);
      fraction[n] = parse_value(out, "live") / ddp_live;
      const double goal = 1.0 / n + parse_value(out, "unit") / ddp_live + 0.05;
      std::printf("| fully_shard, %d ranks | %s | %s | %.3f | <= %.3f: %s |\n", n,
                  human_bytes(static_cast<size_t>(parse_value(out, "live"))).c_str(),
                  human_bytes(static_cast<size_t>(parse_value(out, "peak"))).c_str(), fraction[n], goal,
                  fraction[n] <= goal ? "met" : "missed");
    }
  }
  std::vector<double> ratios;
  double z3 = 0, z2 = 0;
  for (int r = 0; part("step") && r < reps; ++r) {
    const std::string d = job({"--job", "step", "--mode", "ddp", "--steps", std::to_string(steps)}, 2);
    const std::string f = job({"--job", "step", "--mode", "fsdp", "--steps", std::to_string(steps)}, 2);
    ratios.push_back(parse_value(f, "step_ms") / parse_value(d, "step_ms"));
    const double p = parse_value(f, "params");
    z3 = parse_value(f, "received_per_step") / (3 * p * 4 / 2);
    std::printf(
        "step: DDP %.2f ms, fully_shard %.2f ms: %.3f (page faults per step: %.0f, %.0f; CPU ms per step: %.1f, "
        "%.1f)\n",
        parse_value(d, "step_ms"), parse_value(f, "step_ms"), ratios.back(), parse_value(d, "faults_per_step"),
        parse_value(f, "faults_per_step"), parse_value(d, "cpu_ms_per_step"), parse_value(f, "cpu_ms_per_step"));
  }
  if (part("step")) {
    const std::string f2 =
        job({"--job", "step", "--mode", "fsdp", "--zero3", "false", "--steps", std::to_string(steps)}, 2);
    z2 = parse_value(f2, "received_per_step") / (2 * parse_value(f2, "params") * 4 / 2);
  }
  const std::string c = part("collectives") ? job({"--job", "collectives", "--steps", "15"}, 2)
                                            : "rs_fraction=0 ag_fraction=0 ag_in_place_fraction=0";
  // A budget DDP exceeds and fully_shard keeps (the kernel's cgroup limit: a rank over it is killed).
  int fits = 0;
  if (fit_layers > 0) {
    const double p = fit_layers * (2048.0 * 2048 + 2048);
    const auto budget = static_cast<int64_t>(13 * p + 400e6);
    const std::vector<std::string> fit = {
        "--job", "fits", "--layers", std::to_string(fit_layers), "--budget", std::to_string(budget)};
    auto outcome = [&](const char* mode) {
      std::vector<std::string> a = fit;
      a.insert(a.end(), {"--mode", mode});
      try {
        return parse_value(job(a, 2), "steps_done") == 20 ? std::string("trained 20 steps") : std::string("?");
      } catch (const std::exception& e) {
        const std::string m = e.what();
        // A rank the kernel killed (wait status 9, SIGKILL) and no worker's own error line.
        return m.find("(status 9)") != std::string::npos && m.find("worker: error:") == std::string::npos
                   ? std::string("killed over the budget")
                   : "failed: " + m.substr(0, 300);
      }
    };
    const std::string d = outcome("ddp"), f = outcome("fsdp");
    for (const char* parent : {"/sys/fs/cgroup/memory", "/sys/fs/cgroup"}) {  // the empty cgroups left
      std::error_code ec;
      for (std::filesystem::directory_iterator it(parent, ec), end; !ec && it != end; it.increment(ec))
        if (it->path().filename().string().rfind("dtrain_bench_fsdp_", 0) == 0) {
          std::error_code rm;
          std::filesystem::remove(it->path(), rm);
        }
    }
    fits = d == "killed over the budget" && f == "trained 20 steps";
    std::printf("budget %s per rank (%.0f M parameters, Adam, 2 ranks): DDP %s; fully_shard %s\n",
                human_bytes(static_cast<size_t>(budget)).c_str(), p / 1e6, d.c_str(), f.c_str());
  }
  double rss_fraction[2] = {0, 0};  // 2 ranks: shared memory, Gloo
  std::string rss_more;             // the other world sizes' keys
  for (int n : rss_worlds) {
    if (!part("rss")) break;
    double f[2] = {0, 0};
    rss_table(job, n, rss_layers, rss_width, rss_steps, f);
    if (n == 2) {
      rss_fraction[0] = f[0];
      rss_fraction[1] = f[1];
    } else {
      const std::string w = world_suffix(n);
      char keys[160];
      std::snprintf(keys, sizeof keys, " fsdp_peak_rss_fraction%s=%.3f fsdp_peak_rss_fraction%s_gloo=%.3f", w.c_str(),
                    f[0], w.c_str(), f[1]);
      rss_more += keys;
    }
  }
  std::printf("collectives at 16 MB, 2 ranks: %s\n", parse_line(c, "rs_fraction").c_str());
  std::printf(
      "\nRESULT fsdp_state_fraction_2=%.3f fsdp_state_fraction_4=%.3f fsdp_step_vs_ddp=%.3f "
      "fsdp_bytes_per_step_ratio=%.4f fsdp2_bytes_per_step_ratio=%.4f rs_16m_fraction_of_memcpy=%.3f "
      "ag_16m_fraction_of_memcpy=%.3f ag_16m_in_place_fraction_of_memcpy=%.3f fits_only_sharded=%d "
      "fsdp_peak_rss_fraction_2=%.3f fsdp_peak_rss_fraction_2_gloo=%.3f%s\n",
      fraction[2], fraction[4], ratios.empty() ? 0.0 : median(ratios), z3, z2, parse_value(c, "rs_fraction"),
      parse_value(c, "ag_fraction"), parse_value(c, "ag_in_place_fraction"), fits, rss_fraction[0], rss_fraction[1],
      rss_more.c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) { return bench::main_of("bench_fsdp", argc, argv, worker_main, driver_main); }
