// bench_ddp: training steps per second of the tutorial's two models on 2 ranks (or --world N; Gloo, 1
// thread per rank), side by side in one run:
//   python  PyTorch's DistributedDataParallel (bench/python/ddp_reference.py), PyTorch 1.13 (/usr/bin/python3)
//   python2 the same script on PyTorch 2.x (.venv/bin/python, installed by scripts/setup.sh)
//   dtrain  dtrain::DistributedDataParallel (options at their defaults unless given, printed)
//   nocomm  the same C++ loop on the plain model, no DDP, no communication: the limit
// Models: SimpleModel (MLP 128-256-256-10) and TrainModel (CNN on 3x32x32), batch 32, Adam, the
// tutorial's loop (zero_grad, forward, cross-entropy, backward, step) on 4 pre-made batches cycled.
//
//   ./build/bin/bench_ddp [--reps 3] [--warmup 20] [--mlp_steps 300] [--cnn_steps 20] [--world 2]
//
// How: this binary is the driver and the worker. The driver starts every job itself (2 ranks; fork and
// exec of `bench_ddp --worker <job> <model> ...`, or of the Python script, with RANK, WORLD_SIZE,
// MASTER_ADDR, MASTER_PORT and OMP_NUM_THREADS=1 in the environment): per model and repetition one
// Python job and one "paired" C++ job, the order rotating each repetition (rep 1 of everything, then
// rep 2, ...) to spread machine noise. The paired job holds both C++ loops in the same 2 processes —
// the DDP-wrapped model and a plain one — and times them in alternating blocks (50 MLP / 5 CNN steps,
// each block after a barrier), so dtrain and its no-communication limit see the same machine load;
// the step-time ratio Z comes from the same job. (--jobs dtrain nocomm runs them as separate jobs.)
// Each worker calls set_num_threads(1), runs the warm-up steps, and rank 0 times the timed steps after
// a barrier and prints `<loop>_steps_per_s=<x>` (Python: `steps_per_s=<x>`), which the driver parses.
// --profile adds, per C++ loop, forward / backward / optimizer ms per step, the time from the first
// bucket launched to the last done, and a flat all-reduce of all gradients (the floor).
// It prints a table (median and every run) and, last, exactly:
//   RESULT mlp_vs_python=X cnn_vs_python=Y cnn_vs_nocomm=Z mlp_vs_python2=X2 cnn_vs_python2=Y2
//          mlp_step_vs_nocomm=ZM mlp20m_step_vs_nocomm=ZB
// X, Y: dtrain steps/s / PyTorch 1.13's steps/s; X2, Y2: the same against PyTorch 2.x; Z, ZM, ZB:
// dtrain's CNN / MLP / 21 M-parameter MLP (paired jobs only) step time over the no-comm one.
// Goals: X2 >= 3, Y2 >= 1.0, Z <= 1.05, ZM <= 1.05, ZB <= 1.05, on 2 ranks. --world N runs every job
// on N ranks instead, and then every key ends in _<N> (mlp_step_vs_nocomm_4): more ranks than this
// machine's cores measure its scheduler as much, so those are reported without goals.
#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>
#include <netinet/in.h>
#include <arpa/inet.h>
#include <sys/socket.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <CLI/CLI.hpp>

#include "cli_checks.h"
#include <torch/nn/functional/loss.h>
#include <torch/nn/functional/activation.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adam.h>

#include "dtrain/ddp.h"
#include "dtrain/dtrain.h"
#include "spawn.h"
#include "tutorial_models.h"

#ifndef DTRAIN_BENCH_PYTHON_DIR
#define DTRAIN_BENCH_PYTHON_DIR "bench/python"
#endif
#ifndef DTRAIN_BENCH_VENV_PYTHON
#define DTRAIN_BENCH_VENV_PYTHON ".venv/bin/python"
#endif

namespace {

constexpr int kBatches = 4;  // distinct pre-made batches, cycled (as ddp_reference.py)

using namespace bench;

// The large model: an MLP of 21 M parameters (1024 -> 4096 -> 4096 -> 10), whose step is dominated
// by its matmuls and Adam over 84 MB of float32, and whose all-reduce (84 MB) cannot hide behind the
// backward of a model whose last layer is most of it.
struct Mlp20MImpl : torch::nn::Module {
  torch::nn::Linear fc1{register_module("fc1", torch::nn::Linear(1024, 4096))};
  torch::nn::Linear fc2{register_module("fc2", torch::nn::Linear(4096, 4096))};
  torch::nn::Linear fc3{register_module("fc3", torch::nn::Linear(4096, 10))};
  at::Tensor forward(const at::Tensor& x) { return fc3(torch::relu(fc2(torch::relu(fc1(x))))); }
};
TORCH_MODULE(Mlp20M);

// ---------------------------------------------------------------------------------------------------
// Worker: one rank of one job.

struct WorkerArgs {
  std::string variant, model;
  int warmup = 20, steps = 100, block = 0, batch_size = 32;
  double bucket_cap_mb = dtrain::kDefaultBucketCapMB;
  double first_bucket_cap_mb = dtrain::kDefaultFirstBucketCapMB;
  bool grad_as_view = false;
  bool profile = false;
};

// One training loop: its own model and Adam, with or without DDP around the model.
template <typename Model>
struct Loop {
  std::string name;
  Model model;
  std::optional<dtrain::DistributedDataParallel<typename Model::ContainedType>> ddp;
  std::unique_ptr<torch::optim::Adam> opt;
  double secs = 0;  // timed steps (rank 0)
  int steps = 0;
  std::string timeline;
  double t_fwd = 0, t_bwd = 0, t_opt = 0, t_comm = 0, t_pre = 0, t_post = 0;  // --profile sums

  Loop(std::string n, const WorkerArgs& a) : name(std::move(n)) {
    if (name == "dtrain")
      ddp.emplace(model, dtrain::DDPOptions()
                             .bucket_cap_mb(a.bucket_cap_mb)
                             .first_bucket_cap_mb(a.first_bucket_cap_mb)
                             .gradient_as_bucket_view(a.grad_as_view));
    opt = std::make_unique<torch::optim::Adam>(model->parameters(), torch::optim::AdamOptions(1e-3));
  }

  void step(const at::Tensor& x, const at::Tensor& y, bool prof) {
    const auto t0 = Clock::now();
    opt->zero_grad();
    at::Tensor out = ddp ? (*ddp)(x) : model->forward(x);  // (B, 10)
    at::Tensor loss = torch::nn::functional::cross_entropy(out, y);
    const auto t1 = Clock::now();
    loss.backward();  // with DDP: gradients averaged over the ranks when this returns
    const auto t2 = Clock::now();
    opt->step();
    if (!prof) return;
    t_fwd += std::chrono::duration<double>(t1 - t0).count();
    t_bwd += std::chrono::duration<double>(t2 - t1).count();
    t_opt += secs_since(t2);
    if (ddp) {
      // From the first bucket launched to the last one done: communication not hidden by backward,
      // including the wait for the other rank.
      int64_t launch = -1, done = -1;
      for (const auto& e : ddp->last_backward_events()) {
        if (e.kind == dtrain::DDPEvent::Kind::kBucketLaunched && launch < 0) launch = e.time_ns;
        if (e.kind == dtrain::DDPEvent::Kind::kBucketDone) done = e.time_ns;
      }
      auto ns = [](Clock::time_point t) {
        return std::chrono::duration_cast<std::chrono::nanoseconds>(t.time_since_epoch()).count();
      };
      if (launch >= 0 && done >= launch) {
        t_pre += (launch - ns(t1)) * 1e-9;  // backward compute + hooks up to the (last) launch
        t_comm += (done - launch) * 1e-9;
        t_post += (ns(t2) - done) * 1e-9;  // writing the averages back, end of backward
      }
      timeline.clear();  // the last profiled step's events, microseconds after backward started
      for (const auto& e : ddp->last_backward_events())
        if (e.kind == dtrain::DDPEvent::Kind::kGradReady || e.kind == dtrain::DDPEvent::Kind::kBucketLaunched ||
            e.kind == dtrain::DDPEvent::Kind::kBucketDone)
          timeline += (e.kind == dtrain::DDPEvent::Kind::kGradReady        ? " g"
                       : e.kind == dtrain::DDPEvent::Kind::kBucketLaunched ? " L"
                                                                           : " D") +
                      std::to_string(e.index) + "@" + std::to_string((e.time_ns - ns(t1)) / 1000);
      timeline += " end@" + std::to_string((ns(t2) - ns(t1)) / 1000);
    }
  }
};

// variant: dtrain (DDP), nocomm (plain model), or paired (both in these same 2 processes, timed in
// alternating blocks of a.block steps, each after a barrier: the two see the same machine noise).
template <typename Model>
int run_worker(const WorkerArgs& a) {
  const int rank = dtrain::rank();
  std::vector<std::unique_ptr<Loop<Model>>> loops;
  if (a.variant != "nocomm") loops.push_back(std::make_unique<Loop<Model>>("dtrain", a));
  if (a.variant != "dtrain") loops.push_back(std::make_unique<Loop<Model>>("nocomm", a));

  const std::vector<int64_t> shape = a.model == "mlp"      ? std::vector<int64_t>{a.batch_size, 128}
                                     : a.model == "mlp20m" ? std::vector<int64_t>{a.batch_size, 1024}
                                                           : std::vector<int64_t>{a.batch_size, 3, 32, 32};
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1 + rank);
  std::vector<std::pair<at::Tensor, at::Tensor>> batches;
  for (int i = 0; i < kBatches; ++i)
    batches.emplace_back(at::randn(shape, gen), at::randint(0, 10, {a.batch_size}, gen));

  for (auto& l : loops)
    for (int i = 0; i < a.warmup; ++i) l->step(batches[i % kBatches].first, batches[i % kBatches].second, false);

  const int block = a.block > 0 ? std::min(a.block, a.steps) : a.steps;
  for (int done = 0, b = 0; done < a.steps; done += block, ++b) {
    const int n = std::min(block, a.steps - done);
    for (size_t k = 0; k < loops.size(); ++k) {
      auto& l = *loops[(k + b) % loops.size()];  // alternate which loop goes first
      dtrain::barrier();
      const auto t0 = Clock::now();
      for (int i = done; i < done + n; ++i)
        l.step(batches[i % kBatches].first, batches[i % kBatches].second, a.profile);
      l.secs += secs_since(t0);
      l.steps += n;
    }
  }
  if (rank == 0) {
    for (auto& l : loops) {
      std::printf("%s_steps_per_s=%.3f\n", l->name.c_str(), l->steps / l->secs);
      if (l->ddp) std::printf("buckets=%zu\n", l->ddp->bucket_param_indices().size());
    }
  }
  if (a.profile) {
    // The floor: one all-reduce of all gradients in one flat tensor, as DDP's single bucket does.
    int64_t numel = 0;
    for (const auto& p : loops[0]->model->parameters()) numel += p.numel();
    at::Tensor flat = at::ones({numel});
    std::vector<double> ms;
    dtrain::barrier();
    for (int i = 0; i < 50; ++i) {
      const auto t = Clock::now();
      dtrain::all_reduce(flat, dtrain::ReduceOp::SUM);
      ms.push_back(1e3 * secs_since(t));
    }
    std::sort(ms.begin(), ms.end());
    if (rank == 0)
      for (auto& l : loops) {
        if (!l->timeline.empty()) std::printf("timeline_%s (us):%s\n", l->name.c_str(), l->timeline.c_str());
        std::printf(
            "profile_%s fwd_ms=%.3f bwd_ms=%.3f (to launch %.3f, launch->done %.3f, after %.3f) opt_ms=%.3f "
            "flat_allreduce_%lldKB_ms=%.3f\n",
            l->name.c_str(), 1e3 * l->t_fwd / l->steps, 1e3 * l->t_bwd / l->steps, 1e3 * l->t_pre / l->steps,
            1e3 * l->t_comm / l->steps, 1e3 * l->t_post / l->steps, 1e3 * l->t_opt / l->steps,
            static_cast<long long>(numel * 4 / 1024), ms[ms.size() / 2]);
      }
  }
  std::fflush(stdout);
  return 0;
}

int worker_main(int argc, char** argv) {
  dtrain::reduce_allocator_churn();  // as the trainer does: Note [malloc churn]
  CLI::App app{"bench_ddp worker"};
  WorkerArgs a;
  app.add_option("variant", a.variant)->required()->check(CLI::IsMember({"dtrain", "nocomm", "paired"}));
  app.add_option("model", a.model)->required()->check(CLI::IsMember({"mlp", "cnn", "mlp20m"}));
  app.add_option("--warmup", a.warmup);
  app.add_option("--steps", a.steps);
  app.add_option("--block", a.block);
  app.add_option("--batch_size", a.batch_size);
  app.add_option("--bucket_cap_mb", a.bucket_cap_mb);
  app.add_option("--first_bucket_cap_mb", a.first_bucket_cap_mb);
  app.add_option("--grad_as_view", a.grad_as_view);
  app.add_flag("--profile", a.profile);
  CLI11_PARSE(app, argc, argv);
  try {
    at::set_num_threads(1);
    dtrain::init_process_group();
    const int rc = a.model == "mlp"      ? run_worker<tutorial::SimpleModel>(a)
                   : a.model == "mlp20m" ? run_worker<Mlp20M>(a)
                                         : run_worker<tutorial::TrainModel>(a);
    dtrain::destroy_process_group();
    return rc;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_ddp worker %s %s: error: %s\n", a.variant.c_str(), a.model.c_str(), e.what());
    return 1;
  }
}

// ---------------------------------------------------------------------------------------------------
// Driver: starts the jobs and reports.

int driver_main(int argc, char** argv) {
  CLI::App app{"bench_ddp: DDP steps/s on the tutorial's models, dtrain vs PyTorch Python vs no communication"};
  int reps = 3, warmup = 20, mlp_steps = 300, cnn_steps = 20, mlp_block = 50, cnn_block = 5;
  int big_steps = 20, big_block = 5, big_warmup = 3;
  std::string python = "/usr/bin/python3";
  std::string python2 = DTRAIN_BENCH_VENV_PYTHON;
  std::string script = std::string(DTRAIN_BENCH_PYTHON_DIR) + "/ddp_reference.py";
  std::vector<std::string> jobs{"python", "python2", "paired"};
  std::vector<std::string> models{"mlp", "cnn", "mlp20m"};
  double bucket_cap_mb = dtrain::kDefaultBucketCapMB, first_bucket_cap_mb = dtrain::kDefaultFirstBucketCapMB;
  bool grad_as_view = false, profile = false;
  double timeout_s = 180;
  int world = 2;
  app.add_option("--reps", reps, "repetitions per variant (median reported; default 3)")->check(dtrain_cli::positive());
  app.add_option("--warmup", warmup, "warm-up steps before timing (default 20)");
  app.add_option("--mlp_steps", mlp_steps, "timed steps, MLP (default 300)")->check(dtrain_cli::positive());
  app.add_option("--cnn_steps", cnn_steps, "timed steps, CNN (default 20)")->check(dtrain_cli::positive());
  app.add_option("--python", python, "Python with torch 1.13 (default /usr/bin/python3)");
  app.add_option("--python2", python2, "Python with torch 2.x (default .venv/bin/python)");
  app.add_option("--script", script, "the reference script (default bench/python/ddp_reference.py)");
  app.add_option("--mlp_block", mlp_block,
                 "paired jobs alternate dtrain and nocomm every this many steps (MLP, default 50)");
  app.add_option("--cnn_block", cnn_block, "the same for the CNN (default 5)");
  app.add_option("--jobs", jobs,
                 "job kinds per model and rep (default: python python2 paired): python (1.13), python2 (2.x), "
                 "paired (dtrain and nocomm in the "
                 "same 2 processes, alternating blocks), dtrain, nocomm (each alone)");
  app.add_option("--models", models,
                 "subset of: mlp cnn mlp20m (a 21 M-parameter MLP, 1024-4096-4096-10: paired jobs only)");
  app.add_option("--big_steps", big_steps, "timed steps, mlp20m (default 20, in blocks of 5 after 3 warm-up)")
      ->check(dtrain_cli::positive());
  app.add_option("--bucket_cap_mb", bucket_cap_mb, "dtrain DDPOptions.bucket_cap_mb");
  app.add_option("--first_bucket_cap_mb", first_bucket_cap_mb, "dtrain DDPOptions.first_bucket_cap_mb");
  app.add_option("--grad_as_view", grad_as_view, "dtrain DDPOptions.gradient_as_bucket_view (0/1)");
  app.add_flag("--profile", profile, "C++ workers also report forward / backward / optimizer ms per step");
  app.add_option("--timeout_s", timeout_s, "limit per job in seconds (default 180)");
  app.add_option("--world", world, "ranks of every job (default 2; keys get a _<world> suffix otherwise)")
      ->check(CLI::Range(2, 64));
  CLI11_PARSE(app, argc, argv);

  const std::string exe = self_exe();
  const auto t_all = Clock::now();
  std::printf(
      "bench_ddp: %d ranks, Gloo on loopback, OMP_NUM_THREADS=1 + set_num_threads(1) per rank, batch 32, "
      "Adam; warm-up %d steps, timed %d (mlp) / %d (cnn); %d reps, interleaved; dtrain and nocomm "
      "alternate in blocks of %d (mlp) / %d (cnn) steps inside the same processes\n",
      world, warmup, mlp_steps, cnn_steps, reps, mlp_block, cnn_block);
  std::printf(
      "dtrain DDPOptions: bucket_cap_mb=%g first_bucket_cap_mb=%g gradient_as_bucket_view=%d "
      "broadcast_buffers=1 find_unused_parameters=0 static_graph=0%s\n",
      bucket_cap_mb, first_bucket_cap_mb, grad_as_view ? 1 : 0,
      (bucket_cap_mb == dtrain::kDefaultBucketCapMB && first_bucket_cap_mb == dtrain::kDefaultFirstBucketCapMB &&
       !grad_as_view)
          ? " (defaults)"
          : "");
  std::printf("python DDP: torch.nn.parallel.DistributedDataParallel defaults (%s %s; python2: %s)\n", python.c_str(),
              script.c_str(), python2.c_str());
  std::printf("load average at start: %s (%u cores)\n", load_average().c_str(), std::thread::hardware_concurrency());
  std::fflush(stdout);

  std::map<std::pair<std::string, std::string>, std::vector<double>> runs;  // (model, variant) -> steps/s
  std::map<std::string, std::string> notes;
  for (int rep = 0; rep < reps; ++rep) {
    for (const auto& model : models) {
      const bool big = model == "mlp20m";
      const int steps = model == "mlp" ? mlp_steps : big ? big_steps : cnn_steps;
      const int block = model == "mlp" ? mlp_block : big ? big_block : cnn_block;
      for (size_t k = 0; k < jobs.size(); ++k) {
        const std::string& job = jobs[(k + rep) % jobs.size()];  // rotate the order
        // The Python references know the tutorial's two models only.
        if (big && (job == "python" || job == "python2")) continue;
        std::vector<std::string> cmd;
        if (job == "python" || job == "python2") {
          cmd = {job == "python" ? python : python2,
                 script,
                 "--model",
                 model,
                 "--warmup",
                 std::to_string(warmup),
                 "--steps",
                 std::to_string(steps)};
        } else {
          cmd = {exe,
                 "--worker",
                 job,
                 model,
                 "--warmup",
                 std::to_string(big ? big_warmup : warmup),
                 "--steps",
                 std::to_string(steps),
                 "--block",
                 std::to_string(block),
                 "--bucket_cap_mb",
                 std::to_string(bucket_cap_mb),
                 "--first_bucket_cap_mb",
                 std::to_string(first_bucket_cap_mb),
                 "--grad_as_view",
                 grad_as_view ? "1" : "0"};
          if (profile) cmd.push_back("--profile");
        }
        const std::string out = run_job(cmd, world, timeout_s, "bench_ddp");
        const std::vector<std::string> names = job == "python" || job == "python2" ? std::vector<std::string>{job}
                                               : job == "paired" ? std::vector<std::string>{"dtrain", "nocomm"}
                                                                 : std::vector<std::string>{job};
        for (const auto& name : names) {
          const double sps = parse_value(out, name.rfind("python", 0) == 0 ? "steps_per_s" : name + "_steps_per_s");
          if (!(sps > 0))
            throw std::runtime_error("bench_ddp: no steps_per_s for " + name + " in the output of " + job + " " +
                                     model + ":\n" + out);
          runs[{model, name}].push_back(sps);
          const std::string prof = parse_line(out, "profile_" + name + " ");
          const std::string tl = parse_line(out, "timeline_" + name + " ");
          if (!tl.empty()) std::printf("  %s\n", tl.c_str());
          if (!prof.empty())
            std::printf("  rep %d %-4s %-7s %9.2f steps/s  %s\n", rep + 1, model.c_str(), name.c_str(), sps,
                        prof.c_str());
        }
        if (!parse_line(out, "buckets=").empty()) notes[model + " dtrain"] = parse_line(out, "buckets=");
        std::fflush(stdout);
      }
    }
  }

  std::printf("\n%-5s %-8s %12s %12s   %s\n", "model", "variant", "steps/s", "ms/step", "runs (steps/s)");
  std::map<std::pair<std::string, std::string>, double> med;
  for (const auto& model : models)
    for (const std::string variant : {"python", "python2", "dtrain", "nocomm"}) {
      if (!runs.count({model, variant})) continue;
      const auto& v = runs[{model, variant}];
      const double m = median(v);
      med[{model, variant}] = m;
      std::printf("%-5s %-8s %12.2f %12.3f  ", model.c_str(), variant.c_str(), m, 1e3 / m);
      for (double x : v) std::printf(" %.2f", x);
      auto it = notes.find(model + " " + variant);
      if (it != notes.end()) std::printf("   (%s)", it->second.c_str());
      std::printf("\n");
    }
  auto get = [&](const std::string& m, const std::string& v) {
    auto it = med.find({m, v});
    return it == med.end() ? std::nan("") : it->second;
  };
  const double x = get("mlp", "dtrain") / get("mlp", "python");
  const double y = get("cnn", "dtrain") / get("cnn", "python");
  const double z = get("cnn", "nocomm") / get("cnn", "dtrain");  // step-time ratio
  const double zm = get("mlp", "nocomm") / get("mlp", "dtrain");
  const double zb = get("mlp20m", "nocomm") / get("mlp20m", "dtrain");
  const double x2 = get("mlp", "dtrain") / get("mlp", "python2");
  const double y2 = get("cnn", "dtrain") / get("cnn", "python2");
  std::printf(
      "\nmlp: dtrain/python 1.13 = %.2fx   dtrain/python 2.x = %.2fx (goal >= 3)   dtrain step time / nocomm = %.2fx "
      "(goal <= 1.05)\n",
      x, x2, zm);
  std::printf(
      "cnn: dtrain/python 1.13 = %.2fx   dtrain/python 2.x = %.2fx (goal >= 1.0)   dtrain step time / nocomm = "
      "%.2fx (goal <= 1.05)\n",
      y, y2, z);
  std::printf("mlp20m: dtrain step time / nocomm = %.2fx (goal <= 1.05)\n", zb);
  std::printf("load average at end: %s; bench took %.0f s\n", load_average().c_str(), secs_since(t_all));
  const std::string w = world_suffix(world);
  const char* s = w.c_str();
  std::printf(
      "RESULT mlp_vs_python%s=%.2f cnn_vs_python%s=%.2f cnn_vs_nocomm%s=%.2f mlp_vs_python2%s=%.2f "
      "cnn_vs_python2%s=%.2f mlp_step_vs_nocomm%s=%.2f mlp20m_step_vs_nocomm%s=%.2f\n",
      s, x, s, y, s, z, s, x2, s, y2, s, zm, s, zb);
  return 0;
}

}  // namespace

int main(int argc, char** argv) { return bench::main_of("bench_ddp", argc, argv, worker_main, driver_main); }
