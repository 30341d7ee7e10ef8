// The worker of bench/ft_goodput.py and bench/diloco_slow_link.py: the main job's model (the
// FashionCNN of examples/train_fashion_mnist.cpp: conv 32, conv 64, fc 3136-128, fc 128-10; 421,642
// float32 parameters) on synthetic 28 x 28 batches, SGD with momentum, in one of four loops:
//
//   --mode ft        per-step replica fault tolerance (dtrain::ft::Manager; dtrain-run --ft): runs
//                    until killed; one line per committed step
//   --mode ckpt      one dtrain world (dtrain-run --max_restarts): all_reduce of the gradients, a
//                    CheckpointManager save every --ckpt_every steps into --ckpt_dir, resumed from
//                    the latest on start; runs until killed; one line per step
//   --mode ddp       DistributedDataParallel on the world, --steps timed steps after --warmup
//   --mode diloco    DiLoCo (inner SGD, outer Nesterov SGD) over the world, sync every --sync_every,
//                    its all-reduce started --sync_delay steps early (fragment_sync_delay; mixing
//                    back --update_alpha of the replica's own parameters)
//
//   ft, ckpt:     commit <step> members <replicas in the step> quorum <id> pid <pid> t_ms <wall clock, ms>
//   ddp, diloco:  rank 0: steps_per_s=R params=P link_tx_per_step=B (bytes --link sent, /sys/class/net)
//                 sync_s_per_step=S (DiLoCo: seconds in its syncs per step; DDP: 0, its traffic overlaps)
#include <unistd.h>

#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>
#include <torch/utils.h>

#include <CLI/CLI.hpp>
#include <chrono>
#include <fstream>
#include <iostream>
#include <memory>
#include <string>

#include "dtrain/checkpoint.h"
#include "dtrain/ddp.h"
#include "dtrain/fault_tolerance.h"
#include "dtrain/local_sgd.h"
#include "dtrain/process_group.h"

namespace {

struct BenchCNNImpl : torch::nn::Module {
  BenchCNNImpl() {
    using namespace torch::nn;
    conv1 = register_module("conv1", Conv2d(Conv2dOptions(1, 32, 3).padding(1)));
    conv2 = register_module("conv2", Conv2d(Conv2dOptions(32, 64, 3).padding(1)));
    fc1 = register_module("fc1", Linear(64 * 7 * 7, 128));
    fc2 = register_module("fc2", Linear(128, 10));
  }
  at::Tensor forward(at::Tensor x) {
    x = torch::max_pool2d(torch::relu(conv1->forward(x)), 2);
    x = torch::max_pool2d(torch::relu(conv2->forward(x)), 2);
    return fc2->forward(torch::relu(fc1->forward(x.flatten(1))));
  }
  torch::nn::Conv2d conv1{nullptr}, conv2{nullptr};
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(BenchCNN);

struct BenchFtArgs {
  std::string mode = "ft", ckpt_dir, link;
  int64_t batch = 32, steps = 60, warmup = 20, sync_every = 20, ckpt_every = 50, sync_delay = 0;
  double update_alpha = 0.0;
};

int64_t bench_now_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// A batch that depends on the step and the data-parallel rank only: equal work in every mode.
at::Tensor bench_loss(BenchCNN& model, int64_t step, int64_t rank, int64_t batch) {
  at::Tensor x =
      at::sin(at::arange(batch * 28 * 28, at::kFloat).mul(0.001).add(0.37 * step + rank)).view({batch, 1, 28, 28});
  at::Tensor y = at::remainder(at::arange(batch, at::kLong).add(step + rank), 10);
  return torch::nn::functional::cross_entropy(model->forward(x), y);
}

void bench_commit(int64_t step, int members, int64_t quorum) {
  std::cout << "commit " << step << " members " << members << " quorum " << quorum << " pid " << getpid() << " t_ms "
            << bench_now_ms() << std::endl;
}

int bench_ft_loop(const BenchFtArgs& a) {
  torch::manual_seed(static_cast<uint64_t>(getpid()));
  BenchCNN model;
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9));
  dtrain::ft::Manager manager([&] { return dtrain::ft::save_state(*model, opt); },
                              [&](const std::string& s) { dtrain::ft::load_state(*model, opt, s); },
                              dtrain::ft::ManagerOptions().min_replicas(1));
  for (;;) {
    manager.start_quorum();
    const int64_t step = manager.current_step();
    opt.zero_grad();
    if (!manager.is_healing()) bench_loss(model, step, manager.participant_rank(), a.batch).backward();
    std::vector<at::Tensor> grads;
    for (const at::Tensor& p : model->parameters()) grads.push_back(p.grad().defined() ? p.grad() : at::zeros_like(p));
    manager.allreduce(grads);
    if (manager.should_commit()) {
      auto params = model->parameters();
      for (size_t i = 0; i < params.size(); ++i) params[i].mutable_grad() = grads[i];
      opt.step();
      bench_commit(step, manager.num_members(), manager.quorum_id());
    }
  }
}

int bench_ckpt_loop(const BenchFtArgs& a) {
  dtrain::init_process_group();
  torch::manual_seed(0);
  BenchCNN model;
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9));
  dtrain::CheckpointManager ckpt(a.ckpt_dir);
  dtrain::TrainingState state;
  state.model = model.get();
  state.optimizer = &opt;
  ckpt.load_latest(state);
  for (int64_t step = state.step;; ++step) {
    opt.zero_grad();
    bench_loss(model, step, dtrain::rank(), a.batch).backward();
    std::vector<at::Tensor> grads;
    for (const at::Tensor& p : model->parameters()) grads.push_back(p.grad());
    dtrain::all_reduce_divided(grads, dtrain::world_size());
    opt.step();
    if (dtrain::rank() == 0) bench_commit(step, dtrain::world_size(), 0);
    if ((step + 1) % a.ckpt_every == 0) {
      state.step = step + 1;
      ckpt.save(state);
    }
  }
}

int64_t bench_link_tx(const std::string& link) {
  if (link.empty()) return 0;
  std::ifstream in("/sys/class/net/" + link + "/statistics/tx_bytes");
  int64_t v = 0;
  in >> v;
  return v;
}

// DDP or DiLoCo: --warmup steps, then --steps timed ones (multiples of sync_every for DiLoCo).
int bench_timed_loop(const BenchFtArgs& a) {
  dtrain::init_process_group();
  torch::manual_seed(0);
  BenchCNN model;
  int64_t P = 0;
  for (const auto& p : model->parameters()) P += p.numel();
  torch::optim::SGD inner(model->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9));
  torch::optim::SGD outer(model->parameters(), torch::optim::SGDOptions(0.7).momentum(0.9).nesterov(true));
  std::unique_ptr<dtrain::DistributedDataParallel<BenchCNNImpl>> ddp;
  std::unique_ptr<dtrain::DiLoCo> diloco;
  if (a.mode == "ddp")
    ddp = std::make_unique<dtrain::DistributedDataParallel<BenchCNNImpl>>(model);
  else
    diloco = std::make_unique<dtrain::DiLoCo>(
        model->parameters(), inner, outer, a.sync_every, dtrain::Group(),
        dtrain::DiLoCoOptions().fragment_sync_delay(a.sync_delay).fragment_update_alpha(a.update_alpha));
  double sync_s = 0;  // in DiLoCo's step(): its syncs, the only traffic
  const auto step = [&](int64_t s) {
    inner.zero_grad();
    at::Tensor x = at::sin(at::arange(a.batch * 28 * 28, at::kFloat).mul(0.001).add(0.37 * s + dtrain::rank()));
    at::Tensor y = at::remainder(at::arange(a.batch, at::kLong).add(s), 10);
    const at::Tensor xb = x.view({a.batch, 1, 28, 28});
    at::Tensor out = ddp ? ddp->forward(xb) : model->forward(xb);
    torch::nn::functional::cross_entropy(out, y).backward();
    inner.step();
    if (!diloco) return;
    const auto t = std::chrono::steady_clock::now();
    diloco->step();
    sync_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
  };
  for (int64_t s = 0; s < a.warmup; ++s) step(s);
  dtrain::barrier();
  sync_s = 0;
  const int64_t tx0 = bench_link_tx(a.link);
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t s = a.warmup; s < a.warmup + a.steps; ++s) step(s);
  dtrain::barrier();
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const int64_t tx = bench_link_tx(a.link) - tx0;
  if (dtrain::rank() == 0)
    std::cout << "steps_per_s=" << static_cast<double>(a.steps) / secs << " params=" << P
              << " link_tx_per_step=" << static_cast<double>(tx) / static_cast<double>(a.steps)
              << " sync_s_per_step=" << sync_s / static_cast<double>(a.steps) << std::endl;
  dtrain::destroy_process_group();
  return 0;
}

}  // namespace

int main(int argc, char** argv) try {
  BenchFtArgs a;
  CLI::App app{"bench_ft: the worker of bench/ft_goodput.py and bench/diloco_slow_link.py"};
  app.add_option("--mode", a.mode)->check(CLI::IsMember({"ft", "ckpt", "ddp", "diloco"}));
  app.add_option("--batch", a.batch)->check(CLI::PositiveNumber);
  app.add_option("--steps", a.steps)->check(CLI::PositiveNumber);
  app.add_option("--warmup", a.warmup)->check(CLI::NonNegativeNumber);
  app.add_option("--sync_every", a.sync_every)->check(CLI::PositiveNumber);
  app.add_option("--ckpt_every", a.ckpt_every)->check(CLI::PositiveNumber);
  app.add_option("--sync_delay", a.sync_delay,
                 "DiLoCo's fragment_sync_delay: the sync's all-reduce in flight "
                 "over this many inner steps")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--update_alpha", a.update_alpha, "DiLoCo's fragment_update_alpha")->check(CLI::Range(0.0, 1.0));
  app.add_option("--ckpt_dir", a.ckpt_dir);
  app.add_option("--link", a.link, "a network interface whose sent bytes to count");
  CLI11_PARSE(app, argc, argv);
  if (a.mode == "ft") return bench_ft_loop(a);
  if (a.mode == "ckpt") {
    if (a.ckpt_dir.empty()) throw std::runtime_error("--mode ckpt needs --ckpt_dir DIR (where the checkpoints go)");
    return bench_ckpt_loop(a);
  }
  return bench_timed_loop(a);
} catch (const std::exception& e) {
  std::cerr << "bench_ft: " << e.what() << std::endl;
  return 1;
}
