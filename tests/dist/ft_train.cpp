// The C++ side of test_replica_ft.py: a float64 MLP trained by replicas under dtrain::ft::Manager,
// each replica one process of dtrain-run --ft (or started by hand with DTRAIN_FT_REPLICA_ID and the
// store's MASTER_ADDR/MASTER_PORT). No checkpoint at all: a relaunched replica can only heal from a peer.
//   ft_train --steps 30 [--batch 4] [--samples 240] [--step_ms 40] [--min_replicas 2] [--replica_ranks K]
//   (K > 1: each replica is a dtrain world of K ranks, dtrain-run --ft --ft_replica_ranks K, which
//   averages its ranks' gradients before the Manager averages over the replicas)
//            [--die_after_allreduce S [--die_replica R]]   replica R (default 2) SIGKILLs itself after
//                                        its all-reduce of step S (not after a relaunch, which heals)
//            [--join_when FILE]   start, then wait until FILE exists before the Manager joins: the
//                           test starts a replica that joins a running job without its start-up time
//            [--diloco H]   DiLoCo instead: H inner SGD steps on the replica's own data, then a sync
//                           whose average is the Manager's step (a step here is one sync)
// Prints one line per try of a step and per commit, for the test to parse:
//   begin <step> quorum <id> members <n> participants <p> healing <0|1> healed <0|1> hash <params>
//   commit <step> epoch <e> hash <params after the step> samples <i,j,...> pid <pid>
//   abort <step> <what failed>                (DiLoCo: abort <step> hash <params after it> <what failed>)
#include <signal.h>
#include <unistd.h>

#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>
#include <torch/utils.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <memory>
#include <string>
#include <thread>

#include "dtrain/fault_tolerance.h"
#include "dtrain/local_sgd.h"
#include "dtrain/process_group.h"

namespace {

struct FtArgs {
  int64_t steps = 30, batch = 4, samples = 240, step_ms = 40, die_after_allreduce = -1, die_replica = 2, diloco = 0;
  int min_replicas = 1, replica_ranks = 1;
  std::string join_when;  // a file: wait for it before joining (a replica that was never there)
};

FtArgs ft_parse(int argc, char** argv) {
  FtArgs a;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i];
    if (k == "--join_when") {
      a.join_when = argv[i + 1];
      continue;
    }
    const int64_t v = std::stoll(argv[i + 1]);
    if (k == "--steps")
      a.steps = v;
    else if (k == "--batch")
      a.batch = v;
    else if (k == "--samples")
      a.samples = v;
    else if (k == "--step_ms")
      a.step_ms = v;
    else if (k == "--min_replicas")
      a.min_replicas = static_cast<int>(v);
    else if (k == "--die_after_allreduce")
      a.die_after_allreduce = v;
    else if (k == "--die_replica")
      a.die_replica = v;
    else if (k == "--diloco")
      a.diloco = v;
    else if (k == "--replica_ranks")
      a.replica_ranks = static_cast<int>(v);
    else
      throw std::runtime_error("ft_train: unknown flag " + k);
  }
  return a;
}

// FNV-1a over every parameter's bytes: equal hashes are equal bits.
std::string ft_hash(const torch::nn::Sequential& model) {
  uint64_t h = 1469598103934665603ull;
  for (const at::Tensor& p : model->parameters()) {
    at::Tensor c = p.detach().contiguous();
    const auto* b = static_cast<const unsigned char*>(c.data_ptr());
    for (size_t i = 0; i < c.nbytes(); ++i) h = (h ^ b[i]) * 1099511628211ull;
  }
  char out[17];
  std::snprintf(out, sizeof out, "%016llx", static_cast<unsigned long long>(h));
  return out;
}

// Sample i: x = sin(0.1 i + 0.3 k), y = cos(0.07 i + 0.5 k).
void ft_batch(const std::vector<int64_t>& idx, at::Tensor& x, at::Tensor& y) {
  at::Tensor i = torch::tensor(idx, at::kLong).to(at::kDouble).unsqueeze(1);
  x = at::sin(0.1 * i + 0.3 * torch::arange(6, at::kDouble));
  y = at::cos(0.07 * i + 0.5 * torch::arange(4, at::kDouble));
}

std::string ft_join(const std::vector<int64_t>& v) {
  std::string s;
  for (size_t i = 0; i < v.size(); ++i) s += (i ? "," : "") + std::to_string(v[i]);
  return s.empty() ? "-" : s;
}

torch::nn::Sequential ft_model() {
  torch::nn::Sequential model(torch::nn::Linear(6, 16), torch::nn::Tanh(), torch::nn::Linear(16, 4));
  model->to(at::kDouble);
  return model;
}

// DiLoCo under the Manager: each sync is one Manager step. A healing replica receives the last
// sync's parameters (not a peer's inner steps) and the outer optimizer's momentum; the inner SGD has
// no state to carry.
int ft_diloco(const FtArgs& a) {
  torch::manual_seed(static_cast<uint64_t>(getpid()));
  auto model = ft_model();
  auto params = model->parameters();
  torch::optim::SGD inner(params, torch::optim::SGDOptions(0.05));
  torch::optim::SGD outer(params, torch::optim::SGDOptions(0.7).momentum(0.9).nesterov(true));
  std::unique_ptr<dtrain::DiLoCo> diloco;
  const auto last_sync_state = [&] {
    torch::NoGradGuard no_grad;
    std::vector<at::Tensor> now;
    for (size_t i = 0; i < params.size(); ++i) {
      now.push_back(params[i].detach().clone());
      params[i].copy_(diloco->original_parameters()[i]);
    }
    std::string state = dtrain::ft::save_state(*model, outer);
    for (size_t i = 0; i < params.size(); ++i) params[i].copy_(now[i]);
    return state;
  };
  dtrain::ft::Manager manager(
      last_sync_state,
      [&](const std::string& s) {
        dtrain::ft::load_state(*model, outer, s);
        diloco->save_parameters();
      },
      dtrain::ft::ManagerOptions().min_replicas(a.min_replicas).timeout(std::chrono::seconds(3)));
  bool died_once = manager.replica_id() != std::to_string(a.die_replica) || manager.incarnation() > 1;
  int64_t step = 0;  // the sync's, known once its quorum has healed this replica
  diloco = std::make_unique<dtrain::DiLoCo>(params, inner, outer, a.diloco, [&](at::Tensor& flat) {
    manager.start_quorum();
    step = manager.current_step();
    std::cout << "begin " << step << " quorum " << manager.quorum_id() << " members " << manager.num_members()
              << " participants " << manager.num_participants() << " healing " << manager.is_healing() << " healed "
              << manager.healed_this_step() << " hash " << ft_hash(model) << std::endl;
    std::vector<at::Tensor> v{flat};
    manager.allreduce(v);
    if (step == a.die_after_allreduce && !died_once) raise(SIGKILL);  // between the all-reduce and the vote
    died_once = died_once || step == a.die_after_allreduce;
    return manager.should_commit();
  });
  const int64_t me = std::stoll(manager.replica_id());
  for (int64_t i = 0; manager.current_step() < a.steps; ++i) {
    at::Tensor x, y;
    ft_batch({me * 100000 + i, me * 100000 + i + 50000}, x, y);  // the replica's own data
    inner.zero_grad();
    (model->forward(x) - y).pow(2).mean().backward();
    inner.step();
    if (diloco->local_step() + 1 < a.diloco) {
      diloco->step();
      continue;
    }
    if (diloco->step())
      std::cout << "commit " << step << " epoch 0 hash " << ft_hash(model) << " samples - pid " << getpid()
                << std::endl;
    else
      std::cout << "abort " << step << " hash " << ft_hash(model) << " " << manager.errored() << std::endl;
    std::this_thread::sleep_for(std::chrono::milliseconds(a.step_ms));
  }
  std::cout << "done " << manager.current_step() << " hash " << ft_hash(model) << std::endl;
  return 0;
}

}  // namespace

int main(int argc, char** argv) try {
  const FtArgs a = ft_parse(argc, argv);
  if (a.diloco > 0) return ft_diloco(a);
  const int k = a.replica_ranks;
  if (k > 1) dtrain::init_process_group();
  // Each process starts from its own parameters: init_sync must make them one replica's.
  torch::manual_seed(static_cast<uint64_t>(getpid()));
  auto model = ft_model();
  if (k > 1)  // the replica's ranks start alike, as DDP's construction makes them
    for (at::Tensor p : model->parameters()) {
      at::Tensor d = p.detach();
      dtrain::broadcast(d, 0);
    }
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  dtrain::ft::ReplicaSampler sampler(a.samples, /*seed=*/7);
  while (!a.join_when.empty() && access(a.join_when.c_str(), F_OK) != 0)
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  dtrain::ft::Manager manager(
      [&] { return dtrain::ft::save_state(*model, opt, sampler.state()); },
      [&](const std::string& s) { sampler.load_state(dtrain::ft::load_state(*model, opt, s)); },
      dtrain::ft::ManagerOptions().min_replicas(a.min_replicas).timeout(std::chrono::seconds(3)));
  bool died_once = manager.replica_id() != std::to_string(a.die_replica) || manager.incarnation() > 1;
  while (manager.current_step() < a.steps) {
    manager.start_quorum();
    const int64_t step = manager.current_step();
    std::cout << "begin " << step << " quorum " << manager.quorum_id() << " members " << manager.num_members()
              << " participants " << manager.num_participants() << " healing " << manager.is_healing() << " healed "
              << manager.healed_this_step() << " hash " << ft_hash(model) << std::endl;
    const auto idx = manager.is_healing()
                         ? std::vector<int64_t>{}
                         : sampler.indices(manager.participant_rank() * k + (k > 1 ? dtrain::rank() : 0),
                                           manager.num_participants() * k, a.batch);
    opt.zero_grad();
    if (!idx.empty()) {
      at::Tensor x, y;
      ft_batch(idx, x, y);
      (model->forward(x) - y).pow(2).mean().backward();
    }
    std::vector<at::Tensor> grads;
    for (const at::Tensor& p : model->parameters()) grads.push_back(p.grad().defined() ? p.grad() : at::zeros_like(p));
    if (k > 1) dtrain::all_reduce_divided(grads, k);  // the replica's own data parallelism
    manager.allreduce(grads);
    if (step == a.die_after_allreduce && !died_once) raise(SIGKILL);  // between the all-reduce and the vote
    if (manager.should_commit()) {
      auto params = model->parameters();
      for (size_t i = 0; i < params.size(); ++i) params[i].mutable_grad() = grads[i];
      opt.step();
      const int64_t epoch = sampler.epoch();
      sampler.advance(manager.num_participants() * k, a.batch);
      std::cout << "commit " << step << " epoch " << epoch << " hash " << ft_hash(model) << " samples " << ft_join(idx)
                << " pid " << getpid() << std::endl;
    } else {
      std::cout << "abort " << step << " " << manager.errored() << std::endl;
    }
    died_once = died_once || step == a.die_after_allreduce;
    std::this_thread::sleep_for(std::chrono::milliseconds(a.step_ms));
  }
  std::cout << "done " << manager.current_step() << " hash " << ft_hash(model) << std::endl;
  return 0;
} catch (const std::exception& e) {
  std::cerr << "ft_train: " << e.what() << std::endl;
  return 1;
}
