// The CPU buffers fully_shard's units use for a moment and again at the next unit: the all-gather's
// output, the whole parameters, the reduce-scatter's padded input (Note [Buffer pool] in
// buffer_pool.cpp). CUDA tensors come from CUDA's caching allocator instead.
#pragma once

#include <cstddef>

#include <ATen/core/Tensor.h>

namespace dtrain::detail::fsdp {

// An empty tensor whose storage comes from the pool (CPU) or from at::empty (any other device). Its
// storage's allocator is the pool's: a storage emptied and refilled in place (a parameter made whole
// again) takes its bytes from the pool too.
at::Tensor pooled_empty(at::IntArrayRef sizes, const at::TensorOptions& options);

// A unit needs `bytes` of such buffers at once: the pool keeps freed blocks up to twice the largest
// of these (the unit running and the one prefetched), and frees what is beyond.
void reserve_pool_for(size_t bytes);

// Bytes the pool holds free right now (counted by the CPU allocator as held, too).
size_t pool_free_bytes();

}  // namespace dtrain::detail::fsdp
