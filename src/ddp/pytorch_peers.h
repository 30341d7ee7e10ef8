// Note [DDP with PyTorch peers]: in a job with PyTorch peers (Note [PyTorch peers]) dtrain's
// DistributedDataParallel issues exactly the collectives of PyTorch 2.x's Python DDP, with the same
// dtypes, sizes, roots and order, so Python's DistributedDataParallel and dtrain's train one model:
//   construction   1. all_gather of each rank's parameter count (int64 [1]); a difference is an error
//                     on every rank, before anything else is sent;
//                  2. broadcast from group rank 0 of every parameter's sizes and strides (int64),
//                     checked against this rank's;
//                  3. the module state (every parameter, then the buffers unless broadcast_buffers is
//                     off) broadcast from group rank 0 in buckets of 250 MiB per (dtype, device),
//                     buckets in the order of their first tensor (broadcast_coalesced below);
//                  4. gradient buckets as Python's compute_bucket_assignment_by_size over the
//                     parameters in registration order, buckets then reversed: one bucket of all
//                     parameters unless find_unused_parameters (limits [first, cap]) and not
//                     static_graph;
//   each forward   5. with grad enabled, once after the first synchronized backward (not with
//                     find_unused_parameters unless static_graph): the buckets rebuilt in the order
//                     that backward produced the gradients, rank 0's order taken by every rank
//                     (sync_bucket_indices: int32 [indices..., bucket count], then int32 sizes);
//                  6. the buffers broadcast from rank 0 as in 3, when the previous forward was a
//                     synchronized one (Python's require_forward_param_sync) and broadcast_buffers;
//   each backward  7. every bucket's SUM all-reduce in bucket order, each gradient multiplied by
//                     1/size on its way into the bucket (divided when it is the bucket's view);
//                  8. with find_unused_parameters, after the last bucket: the int32 SUM all-reduce of
//                     "this rank produced a gradient for it since the last synchronized backward"
//                     (no_sync backwards count); parameters no rank used keep their .grad();
//                     static_graph sends it once, before every bucket, in its first backward, which
//                     launches all buckets at its end.
//   under Join     Python's Join (include/dtrain/join.h) and its DDP hook: each iteration the
//                  buffers come from the highest active rank (an int64 MAX all-reduce first) and a
//                  "synchronize?" all-reduce follows; a joined rank sends zeros for every bucket and
//                  the used map as it last reduced it; at the end the model of the highest rank
//                  that was active last goes to all, as in 3.
// What dtrain cannot match in this mode is refused in one line at construction or first use:
// communication hooks, joinables after DDP in a Join, and buckets rebuilt over parameters of several
// dtypes or devices
// (Python's order then depends on its hash table).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "dtrain/process_group.h"

namespace dtrain::ddp::pytorch_peers {

constexpr size_t kBroadcastBucketBytes = 250u * 1024 * 1024;  // Python DDP's broadcast_bucket_size

// Steps 1-2. names: for the error line.
void verify_params(const std::vector<std::string>& names, const std::vector<at::Tensor>& params, const Group& group);

// Steps 3 and 6: tensors broadcast from group rank `src_group_rank`, coalesced as Python's
// _broadcast_coalesced.
void broadcast_coalesced(const std::vector<at::Tensor>& tensors, size_t bucket_bytes, int src_group_rank,
                         const Group& group);

// Python's compute_bucket_assignment_by_size: `order` empty walks the tensors by index and sorts the
// buckets by their smallest index; otherwise tensors[k] is parameter order[k] and buckets keep the
// order they closed in.
std::vector<std::vector<int>> assign_buckets(const std::vector<at::Tensor>& tensors, const std::vector<size_t>& limits,
                                             const std::vector<int>& order = {});

// Step 4: the initial buckets of Python's DDP (already reversed).
std::vector<std::vector<int>> initial_buckets(const std::vector<at::Tensor>& params, size_t first_cap, size_t cap,
                                              bool find_unused_parameters, bool static_graph);

// Step 5: the buckets rebuilt from this rank's gradient-ready order, then rank 0's taken.
std::vector<std::vector<int>> rebuilt_buckets(const std::vector<at::Tensor>& params, const std::vector<int>& order,
                                              size_t first_cap, size_t cap, const Group& group);

}  // namespace dtrain::ddp::pytorch_peers
