// Token-choice top-k routing, the capacity's drops and the auxiliary load-balancing loss.
#include "ep/route.h"

#include <ATen/ATen.h>

#include <cmath>

#include "dtrain/functional_collectives.h"

namespace dtrain::ep {

namespace {

// Which choices fit their expert's capacity: each expert takes the first `capacity` of the choices
// that picked it, in the order first choices of every token (in token order), then second choices,
// and so on (GShard's priority: a token's best expert goes before anyone's second best).
at::Tensor ep_within_capacity(const at::Tensor& experts, int64_t num_experts, int64_t capacity) {
  const int64_t t = experts.size(0), k = experts.size(1);
  at::Tensor slot_major = experts.t().reshape({-1});  // [k * T]
  at::Tensor seen = at::one_hot(slot_major, num_experts).cumsum(0);
  at::Tensor position = seen.gather(1, slot_major.unsqueeze(1)).squeeze(1) - 1;  // among its expert's choices
  return (position < capacity).view({k, t}).t();
}

}  // namespace

Routing route(const at::Tensor& logits, const MoEOptions& options) {
  Routing r;
  r.scores = at::softmax(logits, -1);
  std::tie(r.weights, r.experts) = at::topk(r.scores, options.top_k(), -1, /*largest=*/true, /*sorted=*/true);
  if (options.route_norm()) r.weights = r.weights / r.weights.sum(-1, /*keepdim=*/true);
  if (options.capacity_factor()) {
    const double tokens = static_cast<double>(logits.size(0) * options.top_k());
    const auto capacity = static_cast<int64_t>(
        std::ceil(*options.capacity_factor() * tokens / static_cast<double>(options.num_experts())));
    r.keep = ep_within_capacity(r.experts, options.num_experts(), capacity);
  } else {
    r.keep = at::ones(r.experts.sizes(), r.experts.options().dtype(at::kBool));
  }
  return r;
}

at::Tensor load_balancing_loss(const Routing& r, int64_t top_k, const std::optional<Group>& group) {
  const int64_t e = r.scores.size(1);
  // One all-reduce of [sum of scores per expert | choices per expert | tokens]: the means are then
  // over every rank's tokens, whatever each rank's count. Only the first part carries a gradient.
  at::Tensor choices = at::bincount(r.experts.reshape({-1}), {}, e).to(r.scores.scalar_type());
  at::Tensor tokens = at::full({1}, static_cast<double>(r.scores.size(0)), r.scores.options());
  at::Tensor sums = at::cat({r.scores.sum(0), choices, tokens});
  if (group && group->size() > 1) sums = functional::all_reduce(sums, ReduceOp::SUM, *group);
  at::Tensor total = sums.narrow(0, 2 * e, 1).clamp_min(1.0);  // no token anywhere: a loss of 0, not NaN
  at::Tensor mean_score = sums.narrow(0, 0, e) / total;
  at::Tensor fraction = sums.narrow(0, e, e) / (total * static_cast<double>(top_k));
  return (fraction * mean_score).sum() * static_cast<double>(e);
}

}  // namespace dtrain::ep
