// The parameters that no rank holds whole, as checkpoints see them (CheckpointManager's shard files,
// dcp's chunks): fully_shard's rows (dim 0 over its group, FSDP2's Shard(0)) and parallelize_module's
// shards (dim 0 or 1 over the tp group, DTensor's Shard(0) or Shard(1)), in one form. Both cut as
// torch.chunk does: part g of n starts at g * ceil(size / n).
#pragma once

#include <cstdint>
#include <unordered_map>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include "dtrain/process_group.h"

namespace dtrain::ckpt {

struct ParamShard {
  at::Tensor shard;                 // this rank's part (the parameter itself under tensor parallelism)
  std::vector<int64_t> full_shape;  // the whole parameter's
  int64_t dim = 0;                  // the sharded dimension
  int64_t offset = 0;               // where this rank's part starts along dim
  Group group;                      // sharded over
  bool whole = false;               // fully_shard: gathered now (between a unit's forward and backward)
};
using ParamShards = std::unordered_map<const c10::TensorImpl*, ParamShard>;

// Every sharded parameter of `model`, by TensorImpl. Throws for a tensor-parallel parameter that
// fully_shard shards again (checkpoints of 2-D sharding are not supported yet).
ParamShards param_shards(const torch::nn::Module& model);

}  // namespace dtrain::ckpt
