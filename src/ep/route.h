// The router's decisions of the mixture-of-experts layer, before any token moves: the top-k experts
// of each token, the choices kept under the capacity, the load-balancing loss.
#pragma once

#include <cstdint>
#include <optional>

#include <ATen/core/Tensor.h>

#include "dtrain/expert_parallel.h"

namespace dtrain::ep {

struct Routing {
  at::Tensor scores;   // [T, E] softmax of the router's logits
  at::Tensor weights;  // [T, k] the top-k scores (renormalized under route_norm)
  at::Tensor experts;  // [T, k] int64, their experts, highest score first
  at::Tensor keep;     // [T, k] bool: the choice is within its expert's capacity
};

Routing route(const at::Tensor& logits, const MoEOptions& options);
// E * sum_e f_e P_e over the tokens of every rank of `group` (none: this rank's).
at::Tensor load_balancing_loss(const Routing& r, int64_t top_k, const std::optional<Group>& group);

}  // namespace dtrain::ep
