// Collectives for a caller whose input is scratch of its own, dropped once the collective is done
// (fully_shard's padded gradients): where the backend composes the collective from one that works in
// place, it may work in the input itself instead of a copy.
#pragma once

#include <ATen/core/Tensor.h>

#include "dtrain/process_group.h"

namespace dtrain::comm {

// reduce_scatter_tensor, the same values; where it is composed from an all-reduce
// (Note [Tensor collectives on Gloo]), that all-reduce runs in `input`, which holds the reduced
// whole afterwards.
Work reduce_scatter_tensor_of_scratch(at::Tensor& output, at::Tensor& input, ReduceOp op, const Group& group,
                                      bool async_op);

}  // namespace dtrain::comm
