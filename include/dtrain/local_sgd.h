// LocalSGD and DiLoCo: replicas that train on their own for `sync_every` optimizer steps and then
// meet, as torchft's LocalSGD and DiLoCo (the algorithms, without torchft's quorum and recovery).
//
//   Python (torchft)                                  C++ (dtrain)
//   with LocalSGD(manager, model, opt, sync_every=5):  dtrain::LocalSGD local(model->parameters(), 5, replicas);
//       loss.backward(); opt.step()                    loss.backward(); opt.step(); local.step();
//
//   inner = AdamW(model.parameters(), lr=4e-4)         torch::optim::AdamW inner(model->parameters(), ...);
//   outer = SGD(model.parameters(), lr=0.7,            torch::optim::SGD outer(model->parameters(),
//               momentum=0.9, nesterov=True)               torch::optim::SGDOptions(0.7).momentum(0.9).nesterov(true));
//   with DiLoCo(manager, [model], inner, outer,        dtrain::DiLoCo diloco(model->parameters(), inner, outer, 5,
//   replicas);
//               sync_every=5):
//       loss.backward(); inner.step()                  loss.backward(); inner.step(); diloco.step();
//
// `replicas` is the cross-replica group (a dtrain::Group: the world, a new_group, or a DeviceMesh's
// "replicate" dimension); every member calls step() after each optimizer step, the same number of
// times. torchft runs these as optimizer post-step hooks; LibTorch optimizers have none, so step() is
// that hook, called right after the optimizer's step().
//
// LocalSGD: step() counts optimizer steps; at the sync_every-th it averages every parameter over the
// group (one all_reduce(SUM) of all of them as one flat tensor, then a division by the group's size,
// as torchft's manager does) and starts counting again. The optimizer's state stays each rank's own.
//
// DiLoCo: construction keeps a copy of the parameters (the "original", the last sync's). At every
// sync_every-th step():
//   1. pseudo-gradient = original - current, per parameter, packed into one flat tensor;
//   2. all_reduce(SUM) of it over the group, divided by the group's size;
//   3. the parameters are restored to the original;
//   4. each parameter's grad becomes its part of the averaged pseudo-gradient, the outer optimizer
//      steps (DiLoCo's paper: SGD, lr 0.7, momentum 0.9, Nesterov), and the grads are cleared (set
//      undefined, as torchft's outer zero_grad());
//   5. the new parameters become the original.
// The inner optimizer's state (AdamW's moments, its step count) is left as it is, as torchft does: it
// carries on into the next round. Bytes sent per sync: one all-reduce of P elements (all parameters).
//
// Streaming DiLoCo (fragments): DiLoCo(fragments, inner, outers, sync_every, group) with F fragments
// (lists of parameters, e.g. layers) and one outer optimizer per fragment syncs ONE fragment every
// sync_every / F steps, fragment (number of syncs so far) % F, so each fragment meets every
// sync_every steps and each all-reduce carries only its fragment. (torchft's fragment_sync_delay and
// fragment_update_alpha are not offered: the all-reduce is blocking, alpha is 0.)
//
// A failed sync: if the all-reduce throws (a peer left, the group is broken or timed out), DiLoCo
// restores the parameters of the synced fragment to the last sync's (the inner steps since are
// discarded, as torchft does when the manager refuses to commit), the outer optimizer does not step,
// the count restarts, and step() throws one line naming the rank and the operation:
//   "rank 1: DiLoCo sync (fragment 0, all_reduce of 1234 elements on group 'group2') failed; the
//    parameters are back to the last sync's: <the all-reduce's error>"
// LocalSGD's failed sync leaves each rank's parameters as they were (not averaged) and throws alike.
// The group itself stays broken (Note [Broken groups]): train on with a new one.
//
// Under per-step fault tolerance (dtrain/fault_tolerance.h), a sync is a step of the ft::Manager:
// pass an Average in place of the Group, which averages the flat tensor over the quorum and returns
// the vote (torchft's LocalSGD and DiLoCo call its manager the same way):
//
//   dtrain::DiLoCo diloco(model->parameters(), inner, outer, 20, [&](at::Tensor& flat) {
//     manager.start_quorum();              // may heal this replica: see save_parameters()
//     std::vector<at::Tensor> v{flat};
//     manager.allreduce(v);
//     return manager.should_commit();
//   });
//
// A sync whose Average returns false failed on every replica at once: DiLoCo puts the fragment back
// to the last sync's parameters (the inner steps since are discarded), LocalSGD keeps each rank's
// own, the outer optimizer does not step, the count restarts, and step() returns false without
// throwing; the next sync tries again. An Average that throws is reported as a failed all-reduce.
// A replica that heals receives its peer's state: the manager's state_dict must then hold DiLoCo's
// original_parameters() and the outer optimizer's state (not the inner steps' parameters), and the
// load_state_dict loads them into the model and calls save_parameters().
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/optim/optimizer.h>

#include "dtrain/process_group.h"

namespace dtrain {

// Averages `flat` over the replicas in place; returns whether every replica applies the average.
using LocalSgdAverage = std::function<bool(at::Tensor& flat)>;

class LocalSGD {
 public:
  // params: the model's parameters (one floating-point dtype and device); sync_every >= 1.
  LocalSGD(std::vector<at::Tensor> params, int64_t sync_every, Group group = Group());
  LocalSGD(std::vector<at::Tensor> params, int64_t sync_every, LocalSgdAverage average);

  // After each optimizer step: true when this call averaged the parameters.
  bool step();
  // Averages the parameters now (collective over the group) and restarts the count; false when the
  // Average refused it.
  bool sync();

  int64_t local_step() const { return local_step_; }
  int64_t sync_every() const { return sync_every_; }
  const Group& process_group() const { return group_; }

 private:
  std::vector<at::Tensor> params_;
  int64_t sync_every_;
  Group group_;
  LocalSgdAverage average_;  // empty: all_reduce over group_
  int64_t local_step_ = 0;
};

class DiLoCo {
 public:
  // One fragment: every parameter syncs every sync_every steps. inner and outer hold `params`;
  // the outer optimizer is kept by reference and must outlive the DiLoCo.
  DiLoCo(std::vector<at::Tensor> params, torch::optim::Optimizer& inner, torch::optim::Optimizer& outer,
         int64_t sync_every, Group group = Group());
  // Streaming DiLoCo: outers[i] holds fragments[i]; sync_every must be a multiple of the number of
  // fragments.
  DiLoCo(std::vector<std::vector<at::Tensor>> fragments, torch::optim::Optimizer& inner,
         std::vector<torch::optim::Optimizer*> outers, int64_t sync_every, Group group = Group());
  // Either of the above with the replicas' average given as a function (a fault-tolerant loop's).
  DiLoCo(std::vector<at::Tensor> params, torch::optim::Optimizer& inner, torch::optim::Optimizer& outer,
         int64_t sync_every, LocalSgdAverage average);
  DiLoCo(std::vector<std::vector<at::Tensor>> fragments, torch::optim::Optimizer& inner,
         std::vector<torch::optim::Optimizer*> outers, int64_t sync_every, LocalSgdAverage average);

  // After each inner optimizer step: true when this call synced a fragment (then the parameters of
  // that fragment are the outer optimizer's new ones).
  bool step();
  // The current parameters become every fragment's last sync's (torchft's _save_parameters): after
  // loading a checkpoint, or a peer's state when healing.
  void save_parameters();

  int64_t local_step() const { return local_step_; }
  // Successful syncs so far (torchft's manager step): the next fragment to sync is this % F.
  int64_t sync_count() const { return sync_count_; }
  // The parameters of the last sync of fragment i, in the order given.
  const std::vector<at::Tensor>& original_parameters(size_t fragment = 0) const;
  size_t num_fragments() const { return fragments_.size(); }

 private:
  struct Fragment {
    std::vector<at::Tensor> params, original;
    torch::optim::Optimizer* outer = nullptr;
    int64_t numel = 0;
  };
  void make_fragments(std::vector<std::vector<at::Tensor>> fragments, torch::optim::Optimizer& inner,
                      std::vector<torch::optim::Optimizer*> outers);
  bool sync_fragment(size_t index);
  void restore(const Fragment& f);

  std::vector<Fragment> fragments_;
  int64_t sync_every_;  // per fragment: the user's sync_every / F
  Group group_;
  LocalSgdAverage average_;  // empty: all_reduce over group_
  int64_t local_step_ = 0;
  int64_t sync_count_ = 0;
};

}  // namespace dtrain
