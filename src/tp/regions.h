// The two differentiable boundaries of a tensor-parallel region (Megatron-LM's f and g), for values
// that every rank of the group holds alike (replicated) and that the loss counts once:
//   enter_region(x): identity forward; backward all-reduces (SUM) the gradient, since each rank's
//     shard of the layer contributes part of x's gradient (ColwiseParallel's input);
//   leave_region(x): all-reduce (SUM) forward; identity backward, since every rank holds the same
//     replicated gradient of the result (RowwiseParallel's output).
// The functional collectives (dtrain/functional_collectives.h) are the transposes instead: the
// loss of each rank counts.
#pragma once

#include <ATen/core/Tensor.h>

#include "dtrain/process_group.h"

namespace dtrain::tp {

at::Tensor enter_region(const at::Tensor& x, const Group& group);
at::Tensor leave_region(const at::Tensor& x, const Group& group);
// all-gather along the last dimension forward, this rank's part of the gradient backward (a
// ColwiseParallel output asked to be replicated). x is this rank's part of `whole` columns as
// torch.chunk cuts them (the parts may be unequal).
at::Tensor gather_last_dim(const at::Tensor& x, int64_t whole, const Group& group);
// reduce-scatter (SUM) along dim forward, all-gather backward (a RowwiseParallel output asked to be
// sharded, as sequence parallelism does).
at::Tensor reduce_scatter_dim(const at::Tensor& x, int64_t dim, const Group& group);

// Between layouts of a value the loss counts once (dtrain::redistribute): all-gather along dim
// forward, this rank's part of the gradient backward (Shard(d) -> Replicate()); and this rank's part
// along dim forward, the gradient all-gathered backward (Replicate() -> Shard(d)). Equal parts.
at::Tensor gather_dim(const at::Tensor& x, int64_t dim, const Group& group);
at::Tensor part_dim(const at::Tensor& x, int64_t dim, const Group& group);

}  // namespace dtrain::tp
