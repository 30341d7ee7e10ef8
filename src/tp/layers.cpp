// The forward of ParallelLinear and ParallelEmbedding under each style (include/dtrain/tensor_parallel.h
// gives the layouts; src/tp/regions.h the boundaries and their backward).
//
//   ColwiseParallel Linear (weight rows [start, start + length)):
//     x (whole) -> enter_region -> x W_r^T + b_r = this rank's columns of y -> [all-gather]
//   RowwiseParallel Linear (weight columns [start, start + length)):
//     x_r (this rank's columns of x) -> x_r W_r^T, a partial sum -> leave_region (all-reduce) + b
//   RowwiseParallel Embedding (rows [start, start + length) of the vocabulary): indices sharded
//     along d are all-gathered first (PyTorch's default input, Shard(-1)); then each rank looks up the indices it holds
//     and gives zeros for the others; the sum over ranks (leave_region) is the whole lookup.
//   ColwiseParallel Embedding (columns of the embedding): the lookup gives this rank's columns.
#include <ATen/ATen.h>
#include <torch/nn/functional/embedding.h>
#include <torch/nn/functional/linear.h>

#include "dtrain/functional_collectives.h"
#include "tp/applied.h"
#include "tp/regions.h"

namespace dtrain {
namespace {

// Into the layer: a Replicate input enters the region; a Shard(d) input of a colwise layer is
// gathered along d (its backward reduce-scatters the partial gradients: functional::all_gather).
at::Tensor colwise_input(const tp::Applied& a, const at::Tensor& x) {
  if (a.input.kind == Layout::Kind::kReplicate) return tp::enter_region(x, a.group);
  return functional::all_gather(x, a.input.dim, a.group);
}

// Out of a colwise layer: this rank's part of the last dimension, or all of it.
at::Tensor colwise_output(const tp::Applied& a, const at::Tensor& y) {
  return a.output.kind == Layout::Kind::kReplicate ? tp::gather_last_dim(y, a.size, a.group) : y;
}

// Out of a rowwise layer: the sum of the ranks' partial results, whole or reduce-scattered.
at::Tensor rowwise_output(const tp::Applied& a, const at::Tensor& partial) {
  return a.output.kind == Layout::Kind::kReplicate ? tp::leave_region(partial, a.group)
                                                   : tp::reduce_scatter_dim(partial, a.output.dim, a.group);
}

}  // namespace

at::Tensor ParallelLinearImpl::forward(const at::Tensor& input) {
  if (!applied_) return torch::nn::LinearImpl::forward(input);
  const tp::Applied& a = *applied_;
  if (a.colwise) return colwise_output(a, torch::nn::functional::linear(colwise_input(a, input), weight, bias));
  at::Tensor x = input;
  if (a.input.kind == Layout::Kind::kReplicate)  // whole input: this rank's columns of it
    x = tp::enter_region(x, a.group).narrow(-1, a.start, a.length);
  at::Tensor y = rowwise_output(a, torch::nn::functional::linear(x, weight));
  if (!bias.defined()) return y;
  // A row-sharded output adds the whole bias to this rank's rows only: its gradient is the sum of
  // every rank's (enter_region's backward), as for a whole output it is each rank's alone.
  return a.output.kind == Layout::Kind::kReplicate ? y + bias : y + tp::enter_region(bias, a.group);
}

at::Tensor ParallelEmbeddingImpl::forward(const at::Tensor& indices) {
  if (!applied_) return torch::nn::EmbeddingImpl::forward(indices);
  const tp::Applied& a = *applied_;
  namespace F = torch::nn::functional;
  if (a.colwise) return colwise_output(a, F::embedding(indices, weight));
  at::Tensor all = indices;
  if (a.input.kind == Layout::Kind::kShard) {  // every rank's indices (they have no gradient)
    at::NoGradGuard no_grad;
    all = functional::all_gather(indices, a.input.dim, a.group);
  }
  at::Tensor outside = (all < a.start).logical_or(all >= a.start + a.length);
  at::Tensor local = (all - a.start).masked_fill(outside, 0);
  at::Tensor rows = F::embedding(local, weight).masked_fill(outside.unsqueeze(-1), 0.0);
  return rowwise_output(a, rows);
}

}  // namespace dtrain
