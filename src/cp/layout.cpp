// The head-tail layout of a context-parallel sequence and the blocks each rank computes in it.
#include <ATen/ATen.h>

#include <cmath>
#include <limits>

#include "cp/blocks.h"
#include "dtrain/context_parallel.h"
#include "dtrain/functional_collectives.h"
#include "tp/dims.h"

namespace dtrain {
namespace {

// Which chunk of the sequence (of 2 n) group rank r's local chunk c (0 head, 1 tail) is.
int64_t cp_sequence_chunk(int64_t n, int64_t r, int64_t c) { return c == 0 ? r : 2 * n - 1 - r; }

}  // namespace

namespace cp {

at::Tensor chunk_of(const at::Tensor& x, int64_t dim, int64_t c) {
  if (c < 0) return x;
  const int64_t half = x.size(dim) / 2;
  return x.narrow(dim, c * half, half);
}

at::Tensor block_scores(const at::Tensor& q, const at::Tensor& k, double scale, BlockMask mask) {
  at::Tensor s = at::matmul(q, k.transpose(-2, -1)) * scale;
  if (mask == BlockMask::kCausal) {
    at::Tensor future = at::ones({q.size(-2), k.size(-2)}, q.options().dtype(at::kBool)).triu(1);
    s = s.masked_fill(future, -std::numeric_limits<double>::infinity());
  }
  return s;
}

at::Tensor reorder_chunks(const at::Tensor& x, int64_t dim, int64_t n, bool to_sequence) {
  const int64_t c = x.size(dim) / (2 * n);
  std::vector<at::Tensor> parts(static_cast<size_t>(2 * n));
  for (int64_t r = 0; r < n; ++r) {
    for (int64_t h = 0; h < 2; ++h) {
      const int64_t local = 2 * r + h, seq = cp_sequence_chunk(n, r, h);
      // Chunk `local` of the ranks' concatenation is chunk `seq` of the sequence.
      const int64_t from = to_sequence ? local : seq, to = to_sequence ? seq : local;
      parts[static_cast<size_t>(to)] = x.narrow(dim, from * c, c);
    }
  }
  return at::cat(parts, dim);
}

double attention_scale(const at::Tensor& q, const std::optional<double>& scale) {
  return scale ? *scale : 1.0 / std::sqrt(static_cast<double>(q.size(-1)));
}

}  // namespace cp

at::Tensor context_parallel_shard(const at::Tensor& x, int64_t seq_dim, const Group& group) {
  seq_dim = tp::wrap_dim(seq_dim, x, "context_parallel_shard", "seq_dim");
  const int64_t n = group.size(), r = group.rank(), len = x.size(seq_dim);
  DTRAIN_CHECK(len % (2 * n) == 0, "context_parallel_shard: sequence length ", len, " along dim ", seq_dim,
               " is not divisible by 2 * cp = ", 2 * n, " (head-tail chunks): pad it to a multiple");
  const int64_t c = len / (2 * n);
  return at::cat(
      {x.narrow(seq_dim, cp_sequence_chunk(n, r, 0) * c, c), x.narrow(seq_dim, cp_sequence_chunk(n, r, 1) * c, c)},
      seq_dim);
}

at::Tensor context_parallel_unshard(const at::Tensor& x_local, int64_t seq_dim, const Group& group) {
  seq_dim = tp::wrap_dim(seq_dim, x_local, "context_parallel_unshard", "seq_dim");
  DTRAIN_CHECK(x_local.size(seq_dim) % 2 == 0, "context_parallel_unshard: the local length ", x_local.size(seq_dim),
               " along dim ", seq_dim, " is odd: pass a part made by context_parallel_shard (two equal chunks)");
  at::Tensor all = functional::all_gather(x_local, seq_dim, group);
  return cp::reorder_chunks(all, seq_dim, group.size(), /*to_sequence=*/true);
}

std::vector<int64_t> context_parallel_positions(int64_t seq_len, int64_t cp_size, int64_t cp_rank) {
  DTRAIN_CHECK(cp_size >= 1 && cp_rank >= 0 && cp_rank < cp_size, "context_parallel_positions: rank ", cp_rank,
               " of cp size ", cp_size, ": give 0 <= rank < size");
  DTRAIN_CHECK(seq_len % (2 * cp_size) == 0, "context_parallel_positions: sequence length ", seq_len,
               " is not divisible by 2 * cp = ", 2 * cp_size, " (head-tail chunks): pad it to a multiple");
  const int64_t c = seq_len / (2 * cp_size);
  std::vector<int64_t> pos;
  for (int64_t h = 0; h < 2; ++h)
    for (int64_t i = 0; i < c; ++i) pos.push_back(cp_sequence_chunk(cp_size, cp_rank, h) * c + i);
  return pos;
}

std::vector<RingBlock> ring_attention_blocks(int64_t cp_size, int64_t cp_rank, bool is_causal) {
  DTRAIN_CHECK(cp_size >= 1 && cp_rank >= 0 && cp_rank < cp_size, "ring_attention_blocks: rank ", cp_rank,
               " of cp size ", cp_size, ": give 0 <= rank < size");
  std::vector<RingBlock> blocks;
  for (int64_t step = 0; step < cp_size; ++step) {
    const int64_t src = ((cp_rank - step) % cp_size + cp_size) % cp_size;  // whose K/V this rank holds
    if (!is_causal) {
      blocks.push_back({step, -1, -1, BlockMask::kFull});
      continue;
    }
    // A query chunk sees the key chunks before it in full, itself under the causal mask, none after.
    for (int64_t qc = 0; qc < 2; ++qc) {
      for (int64_t kc = 0; kc < 2; ++kc) {
        const int64_t qs = cp_sequence_chunk(cp_size, cp_rank, qc), ks = cp_sequence_chunk(cp_size, src, kc);
        if (ks > qs) continue;
        blocks.push_back({step, qc, kc, ks == qs ? BlockMask::kCausal : BlockMask::kFull});
      }
    }
  }
  return blocks;
}

}  // namespace dtrain
