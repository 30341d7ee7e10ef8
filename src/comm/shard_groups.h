// The groups over which a parameter's gradient is sharded. Each rank holds only its part of such a
// gradient, so a fact about the whole gradient (an inf or NaN anywhere, for GradScaler's skip
// decision) needs a reduction over these groups, as PyTorch reduces GradScaler's found_inf over a
// DTensor gradient's mesh. fully_shard adds its group for every parameter it shards (and, under
// HSDP, its replicate group after it, so that the flag reaches every rank of the mesh), and
// parallelize_module adds the tp group for every parameter it splits; a parameter that both shard
// (tensor parallelism inside fully_shard) has both, in the order they were added. A replicated
// parameter (a Rowwise Linear's bias) is in no group: its gradient is whole on every rank.
#pragma once

#include <vector>

#include <ATen/core/Tensor.h>

#include "dtrain/process_group.h"

namespace dtrain::comm {

// Records that `param`'s gradient is sharded over `group` (once per group name). The record ends
// with the tensor (held weakly).
void add_shard_group(const at::Tensor& param, const Group& group);
// The groups `param`'s gradient is sharded over, in the order they were added (empty: whole).
std::vector<Group> shard_groups(const at::Tensor& param);
// The distinct groups (by name) over which any of `params` is sharded, in the order of first
// appearance: the same on every rank that holds the same parameters in the same order.
std::vector<Group> shard_groups(const std::vector<at::Tensor>& params);

}  // namespace dtrain::comm
