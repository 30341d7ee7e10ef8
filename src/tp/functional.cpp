// The differentiable collectives (include/dtrain/functional_collectives.h) and the tensor-parallel
// region boundaries (src/tp/regions.h): forward under NoGradGuard through the public collectives,
// backward a node from compat that holds the group.
#include <ATen/ATen.h>

#include <algorithm>
#include <torch/csrc/autograd/grad_mode.h>

#include "compat/autograd_compat.h"
#include "comm/tags.h"
#include "dtrain/functional_collectives.h"
#include "tp/dims.h"
#include "tp/regions.h"

namespace dtrain {
namespace {

// Size along dim, checked divisible by the group size.
int64_t part_size(const at::Tensor& t, int64_t dim, const Group& group, const char* op) {
  const int64_t n = group.size();
  DTRAIN_CHECK(t.size(dim) % n == 0, op, ": the input's size ", t.size(dim), " along dim ", dim,
               " is not divisible by the group size ", n, ": pad it to a multiple");
  return t.size(dim) / n;
}

at::Tensor gather_forward(const at::Tensor& x, int64_t dim, const Group& group) {
  const int64_t n = group.size();
  auto in = x.contiguous();
  std::vector<int64_t> stacked{n};
  for (int64_t s : in.sizes()) stacked.push_back(s);
  at::Tensor out = at::empty(stacked, in.options());  // [n, ...x]
  all_gather_into_tensor(out, in, group);
  out = out.movedim(0, dim);  // [..., n, x.size(dim), ...]
  std::vector<int64_t> shape(in.sizes().begin(), in.sizes().end());
  shape[dim] *= n;
  return out.reshape(shape);
}

at::Tensor scatter_forward(const at::Tensor& x, int64_t dim, ReduceOp op, const Group& group) {
  const int64_t n = group.size();
  const int64_t k = part_size(x, dim, group, "reduce_scatter");
  at::Tensor parts = x.unflatten(dim, {n, k}).movedim(dim, 0).contiguous();  // [n, ..., k, ...]
  at::Tensor out = at::empty(parts.sizes().slice(1), x.options());
  reduce_scatter_tensor(out, parts, op, group);
  return out;
}

// Part i of x along split_dim to group rank i, over point-to-point messages on one reserved tag
// (each pair exchanges one message each way per call, so order alone matches them).
at::Tensor all_to_all_forward(const at::Tensor& x, int64_t split_dim, int64_t cat_dim, const Group& group) {
  const int64_t n = group.size();
  const int64_t k = part_size(x, split_dim, group, "all_to_all");
  const int me = group.rank();
  std::vector<at::Tensor> sent(n), got(n);
  std::vector<Work> works;
  for (int64_t r = 0; r < n; ++r) {
    sent[r] = x.narrow(split_dim, r * k, k).contiguous();
    if (r == me) {
      got[r] = sent[r];
      continue;
    }
    got[r] = at::empty_like(sent[r]);
    const int peer = group.ranks()[r];
    works.push_back(isend(sent[r], peer, group, comm::kAllToAllTag));
    works.push_back(irecv(got[r], peer, group, comm::kAllToAllTag));
  }
  for (auto& w : works) w.wait();
  return at::cat(got, cat_dim);
}

// out (made under NoGradGuard) gets `backward` as its grad_fn, with x as its one input.
at::Tensor with_backward(at::Tensor out, const at::Tensor& x, const char* name,
                         std::function<at::Tensor(const at::Tensor&)> backward) {
  compat::set_custom_backward(out, {x}, name,
                              [backward = std::move(backward)](const at::Tensor& g, const std::vector<bool>& needs) {
                                return std::vector<at::Tensor>{needs[0] ? backward(g) : at::Tensor()};
                              });
  return out;
}

}  // namespace

namespace functional {

at::Tensor all_reduce(const at::Tensor& input, ReduceOp op, const Group& group) {
  const bool linear = op == ReduceOp::SUM || op == ReduceOp::AVG;
  DTRAIN_CHECK(linear || !(torch::autograd::GradMode::is_enabled() && input.requires_grad()),
               "functional::all_reduce: ", to_string(op),
               " has no gradient: use SUM or AVG, or pass a tensor that does not require grad");
  at::Tensor out;
  {
    at::NoGradGuard no_grad;
    out = input.clone(at::MemoryFormat::Contiguous);
    dtrain::all_reduce(out, op, group);
  }
  return with_backward(out, input, "dtrain::functional::all_reduce",
                       [op, group](const at::Tensor& g) { return functional::all_reduce(g, op, group); });
}

at::Tensor all_gather(const at::Tensor& input, int64_t dim, const Group& group) {
  dim = tp::wrap_dim(dim, input, "functional::all_gather");
  at::Tensor out;
  {
    at::NoGradGuard no_grad;
    out = gather_forward(input, dim, group);
  }
  return with_backward(out, input, "dtrain::functional::all_gather", [dim, group](const at::Tensor& g) {
    return functional::reduce_scatter(g, dim, ReduceOp::SUM, group);
  });
}

at::Tensor reduce_scatter(const at::Tensor& input, int64_t dim, ReduceOp op, const Group& group) {
  dim = tp::wrap_dim(dim, input, "functional::reduce_scatter");
  DTRAIN_CHECK(op == ReduceOp::SUM || op == ReduceOp::AVG, "functional::reduce_scatter: ", to_string(op),
               " has no gradient: use SUM or AVG");
  at::Tensor out;
  {
    at::NoGradGuard no_grad;
    out = scatter_forward(input, dim, op, group);
  }
  const double scale = op == ReduceOp::AVG ? 1.0 / group.size() : 1.0;
  return with_backward(out, input, "dtrain::functional::reduce_scatter", [dim, scale, group](const at::Tensor& g) {
    at::Tensor full = functional::all_gather(g, dim, group);
    return scale == 1.0 ? full : full * scale;
  });
}

at::Tensor all_to_all(const at::Tensor& input, int64_t split_dim, int64_t cat_dim, const Group& group) {
  split_dim = tp::wrap_dim(split_dim, input, "functional::all_to_all");
  cat_dim = tp::wrap_dim(cat_dim, input, "functional::all_to_all");
  at::Tensor out;
  {
    at::NoGradGuard no_grad;
    out = all_to_all_forward(input, split_dim, cat_dim, group);
  }
  return with_backward(out, input, "dtrain::functional::all_to_all", [split_dim, cat_dim, group](const at::Tensor& g) {
    return functional::all_to_all(g, cat_dim, split_dim, group);
  });
}

at::Tensor all_to_all_single(const at::Tensor& input, std::vector<int64_t> output_split_sizes,
                             std::vector<int64_t> input_split_sizes, const Group& group) {
  DTRAIN_CHECK(output_split_sizes.empty() == input_split_sizes.empty(),
               "functional::all_to_all_single: output_split_sizes ", at::IntArrayRef(output_split_sizes),
               " with input_split_sizes ", at::IntArrayRef(input_split_sizes),
               ": pass both, or neither for equal parts");
  DTRAIN_CHECK(input.dim() >= 1, "functional::all_to_all_single: the input has shape ", input.sizes(),
               ": it needs a dim 0 to split (reshape a scalar to [1])");
  if (output_split_sizes.empty()) {
    // Equal parts both ways, as PyTorch: the output has the input's shape.
    const int64_t k = part_size(input, 0, group, "functional::all_to_all_single");
    output_split_sizes.assign(static_cast<size_t>(group.size()), k);
    input_split_sizes = output_split_sizes;
  }
  // A negative size is refused by dtrain::all_to_all_single, naming it; it counts 0 here.
  int64_t rows = 0;
  for (int64_t s : output_split_sizes) rows += std::max<int64_t>(s, 0);
  at::Tensor out;
  {
    at::NoGradGuard no_grad;
    const at::Tensor in = input.contiguous();
    std::vector<int64_t> shape = in.sizes().vec();
    shape[0] = rows;
    out = at::empty(shape, in.options());
    dtrain::all_to_all_single(out, in, output_split_sizes, input_split_sizes, group);
  }
  return with_backward(out, input, "dtrain::functional::all_to_all_single",
                       [os = output_split_sizes, is = input_split_sizes, group](const at::Tensor& g) {
                         return functional::all_to_all_single(g, is, os, group);
                       });
}

}  // namespace functional

namespace tp {

at::Tensor enter_region(const at::Tensor& x, const Group& group) {
  at::Tensor out;
  {
    at::NoGradGuard no_grad;
    out = x.variable_data();  // x's storage and shape, not a view, without x's history: to carry the node
  }
  return with_backward(out, x, "dtrain::tp::enter_region", [group](const at::Tensor& g) {
    at::Tensor sum = g.clone(at::MemoryFormat::Contiguous);
    all_reduce(sum, ReduceOp::SUM, group);
    return sum;
  });
}

at::Tensor leave_region(const at::Tensor& x, const Group& group) {
  at::Tensor out;
  {
    at::NoGradGuard no_grad;
    out = x.clone(at::MemoryFormat::Contiguous);
    all_reduce(out, ReduceOp::SUM, group);
  }
  return with_backward(out, x, "dtrain::tp::leave_region", [](const at::Tensor& g) { return g; });
}

at::Tensor gather_last_dim(const at::Tensor& x, int64_t whole, const Group& group) {
  const int64_t dim = x.dim() - 1, n = group.size(), chunk = (whole + n - 1) / n;
  const int64_t start = std::min(whole, group.rank() * chunk), length = x.size(dim);
  at::Tensor out;
  {
    // torch.chunk's parts: full ones, then at most one shorter, then empty ones, so padding each to
    // ceil(whole / n) puts every pad after the last real column: the gathered row trims to `whole`.
    at::NoGradGuard no_grad;
    at::Tensor padded = length == chunk ? x : at::constant_pad_nd(x, {0, chunk - length});
    out = gather_forward(padded, dim, group).narrow(dim, 0, whole);
  }
  return with_backward(out, x, "dtrain::tp::gather_last_dim",
                       [dim, start, length](const at::Tensor& g) { return g.narrow(dim, start, length).contiguous(); });
}

at::Tensor reduce_scatter_dim(const at::Tensor& x, int64_t dim, const Group& group) {
  dim = tp::wrap_dim(dim, x, "RowwiseParallel output");
  at::Tensor out;
  {
    at::NoGradGuard no_grad;
    out = scatter_forward(x, dim, ReduceOp::SUM, group);
  }
  return with_backward(out, x, "dtrain::tp::reduce_scatter_dim", [dim, group](const at::Tensor& g) {
    at::NoGradGuard no_grad;
    return gather_forward(g, dim, group);
  });
}

at::Tensor gather_dim(const at::Tensor& x, int64_t dim, const Group& group) {
  dim = wrap_dim(dim, x, "redistribute");
  const int64_t start = group.rank() * x.size(dim), length = x.size(dim);
  at::Tensor out;
  {
    at::NoGradGuard no_grad;
    out = gather_forward(x, dim, group);
  }
  return with_backward(out, x, "dtrain::tp::gather_dim",
                       [dim, start, length](const at::Tensor& g) { return g.narrow(dim, start, length).contiguous(); });
}

at::Tensor part_dim(const at::Tensor& x, int64_t dim, const Group& group) {
  dim = wrap_dim(dim, x, "redistribute");
  const int64_t k = part_size(x, dim, group, "redistribute");
  at::Tensor out;
  {
    at::NoGradGuard no_grad;
    out = x.narrow(dim, group.rank() * k, k).clone(at::MemoryFormat::Contiguous);
  }
  return with_backward(out, x, "dtrain::tp::part_dim", [dim, group](const at::Tensor& g) {
    at::NoGradGuard no_grad;
    return gather_forward(g.contiguous(), dim, group);
  });
}

}  // namespace tp
}  // namespace dtrain
