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
// sync_every steps and each all-reduce carries only its fragment.
//
// Overlapping the sync with training (DiLoCoOptions, torchft's fragment_sync_delay and
// fragment_update_alpha, Streaming DiLoCo's tau and alpha): with fragment_sync_delay = d, the
// fragment's pseudo-gradient is taken d inner steps before its sync point and its all-reduce starts
// then, asynchronously (async_op over the Group), while those d inner steps run; at the sync point
// step() waits for it and the outer step moves the fragment from its last sync's parameters along
// the average. The fragment's parameters then become (1 - alpha) x the outer step's result + alpha x
// what the d inner steps made of them: with alpha = 0 (the default, torchft's) those steps' changes
// to the fragment are discarded, with alpha = 1 the replica keeps its own while the next round starts
// from the global ones. d = 0 is the blocking sync above. Over an Average function the sync's
// average runs at the delayed point too, blocking (the function has no asynchronous form), so the
// arithmetic is the same and only the overlap is lost. reduce_dtype (e.g. at::kBFloat16, Streaming
// DiLoCo's low-precision sync; torchft quantizes on GPUs only) sends the pseudo-gradient in that
// dtype: half the bytes of a float32 model per sync.
//
//   dtrain::DiLoCo diloco(model->parameters(), inner, outer, 20, replicas,
//                         dtrain::DiLoCoOptions().fragment_sync_delay(5));
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
#include <optional>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/optim/optimizer.h>

#include "dtrain/detail/arg.h"
#include "dtrain/process_group.h"

namespace dtrain {

// Streaming DiLoCo's overlap (torchft's names and defaults): see the comment at the top.
struct DiLoCoOptions {
  // Inner steps between taking a fragment's pseudo-gradient (its all-reduce starts then) and its
  // outer step; 0 <= d < sync_every / number of fragments.
  DTRAIN_ARG(int64_t, fragment_sync_delay, 0)
  // The share of the fragment's own parameters kept at the outer step, in [0, 1].
  DTRAIN_ARG(double, fragment_update_alpha, 0.0)
  // The dtype the pseudo-gradient crosses the replicas in (fully_shard's name): at::kBFloat16 halves
  // a float32 model's sync traffic; it is summed in it, then divided in the parameters' dtype.
  // nullopt: the parameters' dtype.
  DTRAIN_ARG(std::optional<at::ScalarType>, reduce_dtype, std::nullopt)
};

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
         int64_t sync_every, Group group = Group(), DiLoCoOptions options = {});
  // Streaming DiLoCo: outers[i] holds fragments[i]; sync_every must be a multiple of the number of
  // fragments.
  DiLoCo(std::vector<std::vector<at::Tensor>> fragments, torch::optim::Optimizer& inner,
         std::vector<torch::optim::Optimizer*> outers, int64_t sync_every, Group group = Group(),
         DiLoCoOptions options = {});
  // Either of the above with the replicas' average given as a function (a fault-tolerant loop's).
  DiLoCo(std::vector<at::Tensor> params, torch::optim::Optimizer& inner, torch::optim::Optimizer& outer,
         int64_t sync_every, LocalSgdAverage average, DiLoCoOptions options = {});
  DiLoCo(std::vector<std::vector<at::Tensor>> fragments, torch::optim::Optimizer& inner,
         std::vector<torch::optim::Optimizer*> outers, int64_t sync_every, LocalSgdAverage average,
         DiLoCoOptions options = {});
  // A sync still in flight is waited for (its outcome dropped): the all-reduce must not outlive the
  // tensor it reduces.
  ~DiLoCo();
  DiLoCo(const DiLoCo&) = delete;
  DiLoCo& operator=(const DiLoCo&) = delete;

  // After each inner optimizer step: true when this call synced a fragment (then the parameters of
  // that fragment are the outer optimizer's new ones).
  bool step();
  // The current parameters become every fragment's last sync's (torchft's _save_parameters): after
  // loading a checkpoint, or a peer's state when healing. A sync in flight is waited for and dropped.
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
  // A fragment's sync between its start (the pseudo-gradient taken, the all-reduce started) and its
  // outer step.
  struct Pending {
    size_t index = 0;
    at::Tensor flat;     // the pseudo-gradient, averaged in place; undefined: none pending
    Work work;           // the Group's asynchronous all-reduce
    bool agreed = true;  // an Average function's answer
  };
  void make_fragments(std::vector<std::vector<at::Tensor>> fragments, torch::optim::Optimizer& inner,
                      std::vector<torch::optim::Optimizer*> outers, DiLoCoOptions options);
  void start_sync(size_t index);
  bool finish_sync();
  void drop_pending() noexcept;
  [[noreturn]] void sync_failed(size_t index, int64_t numel, const std::exception& e);
  void restore(const Fragment& f);

  std::vector<Fragment> fragments_;
  int64_t sync_every_;  // per fragment: the user's sync_every / F
  DiLoCoOptions options_;
  Pending pending_;
  Group group_;
  LocalSgdAverage average_;  // empty: all_reduce over group_
  int64_t local_step_ = 0;
  int64_t sync_count_ = 0;
};

}  // namespace dtrain
