// A shim for CheckpointManager's shard files (sharded.cpp) alone, which is being replaced by saves
// through dtrain::dcp: the parameters no rank holds whole, read from their ShardSpecs
// (dtrain/shard_spec.h) in the one-cut form those files record. Delete it with sharded.cpp.
#pragma once

#include <cstdint>
#include <unordered_map>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include "dtrain/errors.h"
#include "dtrain/process_group.h"
#include "dtrain/shard_spec.h"

namespace dtrain::ckpt {

struct ParamShard {
  at::Tensor shard;                 // this rank's part: the parameter itself
  std::vector<int64_t> full_shape;  // the whole parameter's
  int64_t dim = 0;                  // the sharded dimension
  int64_t offset = 0;               // where this rank's part starts along dim
  Group group;                      // sharded over
  bool whole = false;               // never set: a gathered unit's parameters publish no cut of their own
};
using ParamShards = std::unordered_map<const c10::TensorImpl*, ParamShard>;

// Every sharded parameter of `model`, by TensorImpl. Throws for one cut twice (tensor parallelism
// inside fully_shard), which the shard files cannot record: dtrain::dcp saves those.
inline ParamShards param_shards(const torch::nn::Module& model) {
  ParamShards out;
  for (const auto& kv : model.named_parameters()) {
    const auto spec = shard_spec_of(kv.value());
    if (!spec || !spec->is_sharded()) continue;
    DTRAIN_CHECK(spec->cuts().size() == 1, "checkpoint: '", kv.key(), "' is tensor-parallel and fully_shard'ed both (",
                 spec->to_string(),
                 "): CheckpointManager's shard files record one cut; save the model with dtrain::dcp::save");
    const ShardCut& c = spec->cuts().front();
    out[kv.value().unsafeGetTensorImpl()] = ParamShard{kv.value(), spec->full_shape(), c.dim, c.offset, c.group};
  }
  return out;
}

}  // namespace dtrain::ckpt
