// What code outside fully_shard (sharded checkpoints) needs to know of a sharded parameter: where
// this rank's rows sit in the whole parameter, as FSDP2 lays them out (dim 0 in chunks of
// ceil(rows / n), the last ranks padded or empty).
#pragma once

#include <cstdint>
#include <unordered_map>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include "dtrain/process_group.h"

namespace dtrain::fsdp {

struct ShardLayout {
  at::Tensor shard;                 // this rank's rows: the module's parameter while sharded
  std::vector<int64_t> full_shape;  // the whole parameter's
  int64_t chunk_rows = 0;           // ceil(full_shape[0] / group size)
  Group group;                      // sharded over
  bool whole = false;               // gathered now (between a unit's forward and its backward)
};

// Every parameter of `module` (and below) that a unit holds, by its TensorImpl.
std::unordered_map<const c10::TensorImpl*, ShardLayout> shard_layouts(const torch::nn::Module& module);

}  // namespace dtrain::fsdp
