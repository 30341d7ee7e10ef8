// The mixture-of-experts layer: router, the dispatch of tokens to their experts' ranks and back, and
// the batched SwiGLU experts.
//
// Note [Expert-parallel dispatch]: each rank sorts its kept routing choices by expert (then by token
// and choice, so the order is deterministic) and gathers their tokens into one [A, dim] buffer whose
// rows for the experts of ep rank j are contiguous. The per-expert counts go first, in an all-to-all
// of E integers (ep rank j receives every rank's counts for its own E / n experts): from them each
// rank knows both split vectors of the token exchange without another round, send[j] = the rows
// for rank j's experts, recv[i] = the rows rank i has for this rank's. The tokens then travel in one
// all_to_all_single of those uneven splits; the received rows come grouped by source rank, and
// within a source by local expert; a stable regrouping by local expert feeds each expert one
// contiguous block. The outputs are put back in the received order and sent home by the reverse
// exchange (the two splits swapped), land in the sorted order of the choices, are weighted by their
// scores and summed into their tokens (index_add). Both exchanges are the differentiable
// all_to_all_single, whose backward is the same exchange reversed, so backward moves the output
// gradients to the experts and the input gradients home without code of its own.
#include <ATen/ATen.h>

#include <string>

#include "comm/shard_specs.h"
#include "dtrain/errors.h"
#include "dtrain/expert_parallel.h"
#include "dtrain/functional_collectives.h"
#include "ep/route.h"

namespace dtrain {
namespace {

int64_t ep_size(const MoEOptions& o) { return o.ep_group() ? o.ep_group()->size() : 1; }
int64_t ep_rank(const MoEOptions& o) { return o.ep_group() ? o.ep_group()->rank() : 0; }

std::vector<int64_t> ep_to_vector(const at::Tensor& t) {
  at::Tensor c = t.to(at::kLong).contiguous();
  return std::vector<int64_t>(c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + c.numel());
}

void ep_check_options(const MoEOptions& o) {
  DTRAIN_CHECK(o.dim() > 0 && o.hidden_dim() > 0 && o.num_experts() > 0, "MoE: dim ", o.dim(), ", hidden_dim ",
               o.hidden_dim(), ", num_experts ", o.num_experts(), ": give each a positive size");
  DTRAIN_CHECK(o.top_k() >= 1 && o.top_k() <= o.num_experts(), "MoE: top_k ", o.top_k(), " with ", o.num_experts(),
               " experts: give 1 <= top_k <= num_experts");
  DTRAIN_CHECK(!o.capacity_factor() || *o.capacity_factor() > 0, "MoE: capacity_factor ",
               o.capacity_factor().value_or(0), " is not positive: give one > 0, or leave it unset for no drops");
  DTRAIN_CHECK(!o.expert_grad_divisor() || *o.expert_grad_divisor() >= 1, "MoE: expert_grad_divisor ",
               o.expert_grad_divisor().value_or(0), " is below 1: give 1 (the sum) or more");
  if (o.ep_group()) {
    DTRAIN_CHECK(o.ep_group()->is_member(), "MoE: rank ", rank(),
                 " is not a member of ep_group: build the layer only on the group's ranks");
    DTRAIN_CHECK(o.num_experts() % o.ep_group()->size() == 0, "MoE: num_experts ", o.num_experts(),
                 " is not divisible by the ep group's size ", o.ep_group()->size(),
                 ": give a multiple of the ep size, or a smaller ep group");
  }
}

// Each local expert on its block of rows (rows grouped by local expert, `rows[l]` of them).
at::Tensor ep_run_experts(const at::Tensor& x, const std::vector<int64_t>& rows, const at::Tensor& w1,
                          const at::Tensor& w2, const at::Tensor& w3) {
  std::vector<at::Tensor> out;
  int64_t start = 0;
  for (size_t l = 0; l < rows.size(); ++l) {
    const auto i = static_cast<int64_t>(l);
    at::Tensor xs = x.narrow(0, start, rows[l]);
    start += rows[l];
    out.push_back(at::matmul(at::silu(at::matmul(xs, w1[i])) * at::matmul(xs, w3[i]), w2[i]));
  }
  return out.empty() ? x.narrow(0, 0, 0) : at::cat(out, 0);
}

// The rows received from every ep rank, regrouped by local expert, computed, and put back in the
// received order. counts: [n, L], rows of source rank s for local expert l.
at::Tensor ep_compute(const at::Tensor& received, const at::Tensor& counts, const MoEImpl& m) {
  const int64_t n = counts.size(0), local = counts.size(1), r = received.size(0);
  at::Tensor local_id = at::repeat_interleave(at::arange(local, counts.options()).repeat({n}), counts.reshape({-1}));
  // Unique keys: a stable grouping by local expert, keeping the received order within each.
  at::Tensor regroup = at::argsort(local_id * std::max<int64_t>(r, 1) + at::arange(r, counts.options()));
  at::Tensor y = ep_run_experts(received.index_select(0, regroup), ep_to_vector(counts.sum(0)), m.w1, m.w2, m.w3);
  return y.index_select(0, at::argsort(regroup));
}

}  // namespace

MoEImpl::MoEImpl(const MoEOptions& options_) : options(options_) {
  ep_check_options(options);
  reset();
}

int64_t MoEImpl::local_experts() const { return options.num_experts() / ep_size(options); }
int64_t MoEImpl::first_expert() const { return ep_rank(options) * local_experts(); }

void MoEImpl::reset() {
  const int64_t e = options.num_experts(), d = options.dim(), h = options.hidden_dim();
  router = register_module("router", torch::nn::Linear(torch::nn::LinearOptions(d, e).bias(false)));
  // The whole [E, ...] from the same generator state on every rank, then this rank's rows: the
  // experts are those of one process holding them all.
  auto init = [&](std::vector<int64_t> shape, const char* name) {
    at::Tensor whole = at::randn(shape, at::kFloat) * options.init_std();
    at::Tensor mine = whole.narrow(0, first_expert(), local_experts()).clone();
    at::Tensor p = register_parameter(name, mine);
    if (options.ep_group() && options.ep_group()->size() > 1)
      comm::publish_shard_spec(p, ShardSpec(std::move(shape)).cut(0, *options.ep_group()));
    const int64_t divisor = options.expert_grad_divisor().value_or(ep_size(options));
    if (divisor != 1) p.register_hook([divisor](const at::Tensor& g) { return g / static_cast<double>(divisor); });
    return p;
  };
  w1 = init({e, d, h}, "w1");
  w2 = init({e, h, d}, "w2");
  w3 = init({e, d, h}, "w3");
}

at::Tensor MoEImpl::forward(const at::Tensor& x) {
  const int64_t e = options.num_experts(), k = options.top_k(), n = ep_size(options);
  DTRAIN_CHECK(x.dim() >= 1 && x.size(-1) == options.dim(), "MoE: input of shape ", x.sizes(), " for dim ",
               options.dim(), ": pass [..., ", options.dim(), "]");
  at::Tensor tokens = x.reshape({-1, options.dim()});
  const int64_t t = tokens.size(0);
  ep::Routing r = ep::route(router(tokens), options);
  aux_loss_ = ep::load_balancing_loss(r, k, options.ep_group());

  // The kept choices sorted by expert, then by token and choice (flat index t * k + j).
  at::Tensor kept = r.keep.reshape({-1}).nonzero().squeeze(1);
  at::Tensor flat_experts = r.experts.reshape({-1});
  at::Tensor order = at::argsort(flat_experts.index_select(0, kept) * std::max<int64_t>(t * k, 1) + kept);
  at::Tensor choice = kept.index_select(0, order);
  at::Tensor token = at::div(choice, k, "floor");
  at::Tensor per_expert = at::bincount(flat_experts.index_select(0, choice), {}, e);  // [E]

  at::Tensor counts = per_expert;  // becomes [n, L]: rows of each source rank for each local expert
  if (n > 1) {
    counts = at::empty_like(per_expert);
    all_to_all_single(counts, per_expert, {}, {}, *options.ep_group());
  }
  counts = counts.view({n, e / n});
  const std::vector<int64_t> send = ep_to_vector(per_expert.view({n, e / n}).sum(1)),
                             recv = ep_to_vector(counts.sum(1));
  dispatch_ = MoEDispatch{ep_to_vector(per_expert), send, recv, r.keep.numel() - kept.numel()};

  at::Tensor routed = tokens.index_select(0, token);
  at::Tensor received = n > 1 ? functional::all_to_all_single(routed, recv, send, *options.ep_group()) : routed;
  at::Tensor computed = ep_compute(received, counts, *this);
  at::Tensor back = n > 1 ? functional::all_to_all_single(computed, send, recv, *options.ep_group()) : computed;
  at::Tensor weighted = back * r.weights.reshape({-1}).index_select(0, choice).unsqueeze(1).to(back.scalar_type());
  at::Tensor out = at::zeros({t, options.dim()}, weighted.options()).index_add(0, token, weighted);
  return out.view(x.sizes());
}

}  // namespace dtrain
