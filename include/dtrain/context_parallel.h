// Context parallelism: attention over a sequence sharded along its length across the ranks of a
// `cp` group, so that activations of long sequences fit (PyTorch's
// torch.distributed.tensor.experimental.context_parallel, which patches CUDA's SDPA kernels; these
// run anywhere, Gloo on CPU included, and are called outright).
//
//   dtrain::Group cp = mesh.get_group("cp");
//   at::Tensor q_l = dtrain::context_parallel_shard(q, /*seq_dim=*/2, cp);   // [B, H, S / cp, D]
//   at::Tensor k_l = dtrain::context_parallel_shard(k, 2, cp), v_l = dtrain::context_parallel_shard(v, 2, cp);
//   at::Tensor o_l = dtrain::ring_attention(q_l, k_l, v_l, cp, /*is_causal=*/true);
//   at::Tensor o = dtrain::context_parallel_unshard(o_l, 2, cp);             // [B, H, S, D], every rank
//   // or: dtrain::ulysses_attention(q_l, k_l, v_l, cp, /*is_causal=*/true)
//
// Contract:
//   - Layout: a sequence of S tokens is cut in 2 * cp equal chunks and group rank r holds chunks r and
//     2 * cp - 1 - r, in that order (PyTorch's _HeadTailLoadBalancer, its default): under a causal mask
//     every rank then computes the same number of score blocks (ring_attention_blocks). S must divide
//     by 2 * cp; context_parallel_shard refuses it in one line otherwise. context_parallel_positions
//     says which positions a rank holds (rotary embeddings need them).
//   - ring_attention and ulysses_attention take q, k, v of shape [B, H, S / cp, D] (k and v alike,
//     q with the same B, H and D; for a causal mask the same S / cp too), each rank its part in that
//     layout, and return this rank's part of softmax(q k^T * scale + mask) v, scale defaulting to
//     1 / sqrt(D), as at::scaled_dot_product_attention on the whole sequence, and its gradients for q,
//     k and v, both exact (float64 agrees with one process to rounding). Grouped-query attention:
//     repeat k and v to q's heads first.
//   - Collective over the group: every member calls them, forward and backward, in the same order as
//     its other collectives on the group. A group of one rank computes plain attention.
//   - ring_attention keeps Q and passes K and V around the ring (cp - 1 messages to the next rank,
//     each overlapped with the current block's arithmetic); backward passes them around again with
//     the dK and dV of each block, so it keeps only q, k, v, the output and the row log-sum-exp of
//     forward, not the blocks received. Its messages use reserved point-to-point tags (>= 0x6F000000).
//   - ulysses_attention all-to-alls from sequence-sharded to head-sharded (H must divide by cp; it
//     refuses otherwise in one line), attends over the whole sequence locally and all-to-alls back;
//     autograd goes through dtrain::functional::all_to_all.
//   - context_parallel_unshard all-gathers (functional::all_gather, so it is differentiable: its
//     backward keeps each rank's part of the SUM over ranks of the gradients) and restores the order.
// Design: docs/design.md, "Context parallelism".
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include <ATen/core/Tensor.h>

#include "dtrain/process_group.h"

namespace dtrain {

// This group rank's part of x along seq_dim in the head-tail layout: chunks r and 2 * cp - 1 - r of
// 2 * cp, concatenated. Differentiable (narrow and cat).
at::Tensor context_parallel_shard(const at::Tensor& x, int64_t seq_dim, const Group& group);
// The whole of x along seq_dim, in sequence order, on every rank: the inverse of context_parallel_shard.
at::Tensor context_parallel_unshard(const at::Tensor& x_local, int64_t seq_dim, const Group& group);
// The sequence positions that group rank cp_rank holds of a sequence of seq_len, in its local order:
// [r c, (r + 1) c) then [(2 cp - 1 - r) c, (2 cp - r) c), c = seq_len / (2 cp).
std::vector<int64_t> context_parallel_positions(int64_t seq_len, int64_t cp_size, int64_t cp_rank);

// Which part of a score block is computed: all of it, its lower triangle with the diagonal (a chunk
// against itself), or nothing.
enum class BlockMask { kFull, kCausal, kSkip };

// One computed block of ring attention: at ring step `step` a rank holds the K/V of group rank
// (rank - step) mod cp; the block pairs its query chunk q_chunk with that K/V's chunk kv_chunk
// (0 or 1: the head or the tail chunk; -1: the whole local part, without a causal mask).
struct RingBlock {
  int64_t step = 0;
  int64_t q_chunk = -1, kv_chunk = -1;
  BlockMask mask = BlockMask::kFull;
};
// The blocks group rank cp_rank computes, in order (the skipped ones left out): ring_attention runs
// exactly these. Causal: 2 * cp + 1 chunk blocks on every rank (two of them diagonal), a total of the
// lower triangle of the (2 cp)^2 chunk grid; not causal: cp whole blocks.
std::vector<RingBlock> ring_attention_blocks(int64_t cp_size, int64_t cp_rank, bool is_causal);

// Exact attention over the sequence sharded across `group` (layout above), K/V passed around a ring.
at::Tensor ring_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const Group& group,
                          bool is_causal = false, std::optional<double> scale = std::nullopt);
// The same through two all-to-alls (DeepSpeed-Ulysses): heads sharded while the sequence is whole.
at::Tensor ulysses_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const Group& group,
                             bool is_causal = false, std::optional<double> scale = std::nullopt);

}  // namespace dtrain
