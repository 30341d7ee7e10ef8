// What code outside tensor parallelism (checkpoints: dtrain::CheckpointManager, dtrain::dcp) needs to
// know of a parameter that parallelize_module sharded: which dimension, the whole shape, where this
// rank's part starts, and the group (PyTorch's DTensor Shard(dim) placement over that group).
#pragma once

#include <cstdint>
#include <unordered_map>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include "dtrain/process_group.h"

namespace dtrain::tp {

struct ParamShard {
  std::vector<int64_t> full_shape;  // the whole parameter's
  int64_t dim = 0;                  // the sharded dimension (Colwise Linear: 0, Rowwise Linear: 1)
  int64_t start = 0;                // this rank's first index along dim (torch.chunk's cut)
  Group group;                      // sharded over
};

// Every sharded parameter of `module` (and below), by its TensorImpl. A replicated one (a Rowwise
// Linear's bias) is not in it.
std::unordered_map<const c10::TensorImpl*, ParamShard> param_shards(const torch::nn::Module& module);

}  // namespace dtrain::tp
