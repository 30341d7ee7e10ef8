// Where the layers that shard parameters (parallelize_module, fully_shard) publish each one's
// ShardSpec, for the readers of dtrain/shard_spec.h (Note [Published shard specs] in shard_spec.cpp).
#pragma once

#include <optional>

#include <ATen/core/Tensor.h>

#include "dtrain/shard_spec.h"

namespace dtrain::comm {

// Makes `spec` the spec of `param` (replacing the one published before); none withdraws it.
void publish_shard_spec(const at::Tensor& param, std::optional<ShardSpec> spec);

}  // namespace dtrain::comm
