// The arithmetic shared by ring and Ulysses attention: chunks of the head-tail layout and one
// block's scores under its mask.
#pragma once

#include <cstdint>

#include <ATen/core/Tensor.h>

#include "dtrain/context_parallel.h"

namespace dtrain::cp {

// Chunk c (0: head, 1: tail) of a local part along dim; -1: all of it.
at::Tensor chunk_of(const at::Tensor& x, int64_t dim, int64_t c);
// q k^T * scale over the last two dimensions, with the entries above the diagonal at -inf under
// BlockMask::kCausal (q and k the same chunk of the sequence).
at::Tensor block_scores(const at::Tensor& q, const at::Tensor& k, double scale, BlockMask mask);
// The 2 * n chunks of x along dim (n ranks' parts concatenated in group-rank order) put in sequence
// order (to_sequence) or back into that order.
at::Tensor reorder_chunks(const at::Tensor& x, int64_t dim, int64_t n, bool to_sequence);
// 1 / sqrt(head_dim) unless given.
double attention_scale(const at::Tensor& q, const std::optional<double>& scale);

}  // namespace dtrain::cp
