// Expert parallelism: a mixture-of-experts layer whose experts are spread over the ranks of an `ep`
// group, tokens sent to their experts' ranks and back with all-to-alls of uneven splits (torchtitan's
// MoE with ExpertParallel: a token-choice top-k router and grouped SwiGLU experts).
//
//   auto mesh = dtrain::init_device_mesh({2}, {"ep"});
//   dtrain::MoE moe(dtrain::MoEOptions(/*dim=*/64, /*hidden_dim=*/128, /*num_experts=*/8)
//                       .top_k(2).ep_group(mesh.get_group("ep")));    // this rank: experts 4 r .. 4 r + 3
//   at::Tensor y = moe(x);                                   // x: [..., 64], this rank's own tokens
//   at::Tensor loss = task_loss(y) + 0.01 * moe->aux_loss();
//   loss.backward();                                         // through the same exchanges, reversed
//   // router parameters: average over the data-parallel ranks (DDP, fully_shard, or by hand);
//   // expert parameters: their gradients are complete here (see "Gradients" below)
//
// Beside data parallelism, on a 2-D mesh (4 ranks: ep groups {0, 1} and {2, 3}, dp groups {0, 2}
// and {1, 3}; each ep group holds every expert, each dp group one expert slice twice):
//   auto mesh = dtrain::init_device_mesh({2, 2}, {"dp", "ep"});
//   Net net(mesh.get_group("ep"));                           // a model holding an MoE over ep
//   dtrain::DistributedDataParallel ddp(net, dtrain::DDPOptions().ignored_params({net->moe->w1,
//       net->moe->w2, net->moe->w3}));                     // the rest averaged over all 4 ranks
//   loss = task_loss(ddp(x)) + 0.01 * net->moe->aux_loss();  // aux loss over the ep group's tokens
//   loss.backward();                                         // experts: divided by the ep size
//   for (auto& w : {net->moe->w1, net->moe->w2, net->moe->w3}) {
//     at::Tensor g = w.grad();
//     dtrain::all_reduce(g, dtrain::ReduceOp::AVG, mesh.get_group("dp"));  // then the dp mean
//   }
//   opt.step();
//
// Contract:
//   - Routing (torchtitan's TokenChoiceTopKRouter with softmax scores): scores = softmax(router(x))
//     over the experts, router a Linear(dim, num_experts) without bias; each token picks the top_k
//     experts of highest score, and its output is the sum over its picks of score * expert(x). The
//     top-k scores are NOT renormalized to sum to 1 (torchtitan's default, GShard's top-2 without
//     its normalization); route_norm(true) divides them by their sum (Mixtral's).
//   - Experts: SwiGLU MLPs, expert(x) = (silu(x w1[e]) * (x w3[e])) w2[e], stored batched as
//     w1 [E, dim, hidden], w3 [E, dim, hidden], w2 [E, hidden, dim] (torchtitan's GroupedExperts),
//     initialised on every rank from the same generator state as N(0, init_std^2) of the whole [E, ...]
//     (seed every rank alike), of which each rank then keeps its rows.
//   - Expert parallelism: with ep_group of size n (num_experts divisible by n; refused in one line
//     otherwise), group rank r holds experts [r E / n, (r + 1) E / n): dim 0 of w1, w2, w3, published
//     as their ShardSpec (a cut of dim 0 over ep_group), so dcp, CheckpointManager, full_state_dict
//     and clip_grad_norm_ see them as sharded and load them on another ep size. Each forward sends
//     every expert's count of this rank's tokens first (an all-to-all of E integers), then the tokens
//     to their experts' ranks (all_to_all_single of uneven splits), computes, and returns the outputs
//     by the reverse exchange; backward runs through the same two exchanges (functional collectives).
//     Collective over ep_group: every member calls forward and backward alike. No ep_group: every
//     expert is local and nothing is communicated.
//   - Auxiliary load-balancing loss (Switch Transformer, GShard): aux_loss() of the last forward is
//     E * sum_e f_e P_e, f_e the fraction of the routing choices (tokens times top_k, before any
//     drop) that picked expert e and P_e the mean router score of e, both over the tokens of every
//     rank of ep_group (their sums all-reduced, differentiably), so it is the same value on every rank
//     and equals one process's on the concatenated batch. It is 1 when the load is balanced.
//   - Capacity (optional, capacity_factor c > 0): each expert takes at most ceil(c * T * top_k / E)
//     choices of a rank's T tokens; the others are dropped (they add nothing to the token's output).
//     Which ones, deterministically: first choices before second choices (GShard's priority), and
//     within one choice rank earlier tokens first. Each rank decides over its own tokens only.
//   - Gradients: expert parameters get the gradient of the mean over the ep ranks of each rank's loss,
//     the same average that DDP or fully_shard gives the replicated (router) parameters: their
//     gradient, a sum over every rank's tokens, is divided by expert_grad_divisor (default ep_group's
//     size; 1 keeps the sum). Expert parameters must not be averaged over ep_group again: leave them
//     out of DDP or fully_shard (DDPOptions::ignored_params, FullyShardOptions::ignored_params); a
//     data-parallel dimension beside ep, where experts are replicated, averages them over that
//     dimension's group: with the default divisor (the ep size) an all_reduce AVG over dp (or
//     expert_grad_divisor(ep * dp) and a SUM over dp) gives the mean over all ep * dp ranks' losses,
//     the router's under DDP or fully_shard over the world.
//   - With dp > 1 the aux loss is over each ep group's tokens (torchtitan's), not the whole batch's:
//     the ranks' mean loss is the task loss of the whole batch plus the mean over ep groups of
//     their aux losses. A dcp checkpoint stores each expert chunk once (one dp replica writes it)
//     and loads on any ep size.
//   - last_dispatch() tells what the last forward sent: per expert and per rank of ep_group.
// Design: docs/design.md, "Expert parallelism".
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/nn/cloneable.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>

#include "dtrain/detail/arg.h"
#include "dtrain/process_group.h"

namespace dtrain {

struct MoEOptions {
  MoEOptions(int64_t dim, int64_t hidden_dim, int64_t num_experts)
      : dim_(dim), hidden_dim_(hidden_dim), num_experts_(num_experts) {}
  DTRAIN_ARG(int64_t, dim, 0)
  DTRAIN_ARG(int64_t, hidden_dim, 0)
  DTRAIN_ARG(int64_t, num_experts, 0)
  // Experts each token is sent to (1 <= top_k <= num_experts).
  DTRAIN_ARG(int64_t, top_k, 2)
  // Divide the top-k scores by their sum (torchtitan's route_norm).
  DTRAIN_ARG(bool, route_norm, false)
  // Unset: no expert drops a token.
  DTRAIN_ARG(std::optional<double>, capacity_factor, std::nullopt)
  // Unset: every expert local.
  DTRAIN_ARG(std::optional<Group>, ep_group, std::nullopt)
  // Unset: ep_group's size (the data-parallel mean over ep); 1: the sum over the ep ranks' losses.
  DTRAIN_ARG(std::optional<int64_t>, expert_grad_divisor, std::nullopt)
  // Standard deviation of the experts' initial weights.
  DTRAIN_ARG(double, init_std, 0.02)
};

// What one forward sent. Counts are routing choices (a token sent to two experts counts twice).
struct MoEDispatch {
  std::vector<int64_t> tokens_per_expert;  // [E]: this rank's choices kept, per expert (global index)
  std::vector<int64_t> send_counts;        // [n]: rows sent to each rank of ep_group
  std::vector<int64_t> recv_counts;        // [n]: rows received from each rank of ep_group
  int64_t dropped = 0;                     // this rank's choices over capacity
};

class MoEImpl : public torch::nn::Cloneable<MoEImpl> {
 public:
  explicit MoEImpl(const MoEOptions& options);
  void reset() override;
  // x: [..., dim], this rank's tokens; returns [..., dim].
  at::Tensor forward(const at::Tensor& x);
  // The last forward's load-balancing loss (0-dim, differentiable); undefined before a forward.
  const at::Tensor& aux_loss() const { return aux_loss_; }
  const MoEDispatch& last_dispatch() const { return dispatch_; }
  // The experts this rank holds: [first, first + count).
  int64_t first_expert() const;
  int64_t local_experts() const;

  MoEOptions options;
  torch::nn::Linear router{nullptr};
  at::Tensor w1, w2, w3;  // this rank's experts: [E / n, dim, hidden], [E / n, hidden, dim], [E / n, dim, hidden]

 private:
  at::Tensor aux_loss_;
  MoEDispatch dispatch_;
};
TORCH_MODULE(MoE);

}  // namespace dtrain
