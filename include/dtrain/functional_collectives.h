// Differentiable collectives (torch.distributed.nn.functional, and the functional collectives of
// torch.distributed._functional_collectives): each returns a new tensor and has a backward, the
// collective's transpose, so autograd can run through communication.
//
//   at::Tensor y = dtrain::functional::all_gather(x, /*dim=*/0, tp);  // [n * b, h]; x: [b, h]
//   y.sum().backward();                                                // x.grad(): reduce_scatter of y's
//
// Every rank of the group calls them in the same order, forward and backward, as every collective.
// Each output on rank r is a function of every rank's input, and each backward returns the gradient
// of the SUM over ranks of what each rank's output feeds: the transpose.
//
//   forward                               backward (of the gradients)
//   all_reduce(x, SUM)                    all_reduce(SUM)
//   all_reduce(x, AVG)                    all_reduce(AVG)
//   all_gather(x, dim)                    reduce_scatter(SUM, dim)
//   reduce_scatter(x, dim, SUM)           all_gather(dim)
//   all_to_all(x, split_dim, cat_dim)     all_to_all(cat_dim, split_dim)
//   all_to_all_single(x, out_s, in_s)     all_to_all_single(in_s, out_s)
//
// A value computed alike on every rank (a replicated loss) counts once per rank under this rule.
// Tensor parallel layers, which treat such a value as one, use their own pair (an identity whose
// backward is an all-reduce, and the reverse: src/tp/regions.h), as Megatron-LM does.
//
// Shapes: every rank passes the same shape (all_to_all_single: the same sizes past dim 0);
// reduce_scatter and all_to_all need the size along the split dimension divisible by the group size. MIN, MAX and
// PRODUCT all-reduces run, but refuse an input that requires grad.
#pragma once

#include <cstdint>
#include <vector>

#include <ATen/core/Tensor.h>

#include "dtrain/process_group.h"

namespace dtrain::functional {

at::Tensor all_reduce(const at::Tensor& input, ReduceOp op = ReduceOp::SUM, const Group& group = Group());
// Every rank's input concatenated along dim, in group-rank order.
at::Tensor all_gather(const at::Tensor& input, int64_t dim = 0, const Group& group = Group());
// The reduction of every rank's input, of which group rank r keeps part r along dim.
at::Tensor reduce_scatter(const at::Tensor& input, int64_t dim = 0, ReduceOp op = ReduceOp::SUM,
                          const Group& group = Group());
// Part i of the input along split_dim goes to group rank i; the parts received are concatenated along
// cat_dim in group-rank order.
at::Tensor all_to_all(const at::Tensor& input, int64_t split_dim = 0, int64_t cat_dim = 0,
                      const Group& group = Group());
// torch.distributed._functional_collectives.all_to_all_single, uneven splits: input_split_sizes[j]
// rows (dim 0) of the input go to group rank j, and the result is the output_split_sizes[i] rows
// received from each group rank i, concatenated in group-rank order (dtrain::all_to_all_single's
// contract). Pass both split sizes, or neither for equal parts (dim 0 divisible by the group size).
// Backward: the same exchange of the gradient with the two split sizes swapped.
//   at::Tensor y = dtrain::functional::all_to_all_single(x, /*output_split_sizes=*/{3, 1},
//                                                         /*input_split_sizes=*/{2, 2}, ep_group);
at::Tensor all_to_all_single(const at::Tensor& input, std::vector<int64_t> output_split_sizes = {},
                             std::vector<int64_t> input_split_sizes = {}, const Group& group = Group());

}  // namespace dtrain::functional
