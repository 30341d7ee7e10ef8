// fully_shard's and parallelize_module's shards in one form (param_shards.h).
#include "checkpoint/param_shards.h"

#include <algorithm>
#include <string>

#include "dtrain/errors.h"
#include "fsdp/shard_layout.h"
#include "tp/shards.h"

namespace dtrain::ckpt {

ParamShards param_shards(const torch::nn::Module& model) {
  ParamShards out;
  for (auto& [impl, l] : fsdp::shard_layouts(model)) {
    const int64_t rows = l.full_shape.empty() ? 1 : l.full_shape[0];
    out[impl] = ParamShard{l.shard, l.full_shape, 0, std::min(rows, l.group.rank() * l.chunk_rows), l.group, l.whole};
  }
  const auto tp_shards = tp::param_shards(model);
  if (tp_shards.empty()) return out;
  for (const auto& kv : model.named_parameters()) {
    const c10::TensorImpl* impl = kv.value().unsafeGetTensorImpl();
    auto it = tp_shards.find(impl);
    if (it == tp_shards.end()) continue;
    DTRAIN_CHECK(!out.count(impl), "checkpoint: '", kv.key(),
                 "' is tensor-parallel and fully_shard'ed both: checkpoints of 2-D sharded parameters are not "
                 "supported yet; checkpoint the model without fully_shard, or gather it whole and save that");
    const tp::ParamShard& s = it->second;
    out[impl] = ParamShard{kv.value(), s.full_shape, s.dim, s.start, s.group, false};
  }
  return out;
}

}  // namespace dtrain::ckpt
