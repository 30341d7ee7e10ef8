// Construction-time agreement and state broadcast for the wrappers that replicate or shard a model
// (DistributedDataParallel, fully_shard), as PyTorch keeps them in torch/distributed/utils.py.
//
// verify_same_model:
//   1. Each rank describes its parameters ("name shape dtype" per line) and hashes the text.
//   2. One all_gather of the hashes: equal everywhere -> done (the common case costs one tiny
//      collective).
//   3. Otherwise every rank publishes its description in the store under key_prefix (this DDP's own,
//      the same on every member: Note [Group-agreed ids]) and reads everyone's, and all ranks throw
//      the same one-line error naming the first differing parameter and the ranks.
// broadcast_from_first_rank: rank 0 of the group broadcasts tensors, coalesced per dtype into
// flat buffers (one collective per dtype instead of one per tensor); broadcast_from, from any member.
#pragma once

#include <string>
#include <vector>

#include "dtrain/process_group.h"

namespace dtrain::comm {

// who: what the error line starts with (the caller, as the user named it).
void verify_same_model(const std::vector<std::string>& names, const std::vector<at::Tensor>& params, const Group& group,
                       const std::string& key_prefix, const std::string& who = "DistributedDataParallel");

void broadcast_from_first_rank(const std::vector<at::Tensor>& tensors, const Group& group);
// The same from any member (src: a global rank).
void broadcast_from(const std::vector<at::Tensor>& tensors, int src, const Group& group);

}  // namespace dtrain::comm
