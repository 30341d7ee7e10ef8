// fully_shard's pool of CPU buffers (see buffer_pool.h).
//
// Note [Buffer pool]
// Every unit allocates the same few buffers twice a step and frees them a moment later: the
// all-gather's output and the whole parameters (forward, and again in backward under ZeRO-3), the
// reduce-scatter's input and output. On CUDA, PyTorch's caching allocator keeps such blocks; on CPU
// LibTorch's allocator is malloc, which gives blocks this large back to the kernel (mmap, or a
// trimmed heap), so every step touched fresh pages again: 16 k page faults per step on 8 units of
// 4 MB (63 MB of pages zeroed by the kernel), against 2 k for DDP, whose buckets live as long as it
// does. So the units take these buffers from a pool that keeps freed blocks by size, up to twice the
// largest unit's working set (the unit running, the one prefetched), and frees the rest. That working
// set is what a unit holds for a moment only: its whole parameters, its shard cast to the param dtype
// where it differs, its padded gradients where they cannot go as they are. Not the reduce-scatter's
// output, which every unit holds until the end of backward: those came back all at once, a block per
// unit of a size no forward takes, and stayed resident through the optimizer's step (the peak). The
// cap counted them and the gradients that need no copy, and twice each: three times the blocks a
// step reuses, 100 MB kept on 5 units of 16 MB (bench_fsdp's peak RSS). The blocks
// come from LibTorch's CPU allocator of the moment (an allocator a program installed counts them),
// and a block is only reused at its own size: units of one model are of a few sizes. The pool is
// process-wide (units of several models share it) and thread-safe: an asynchronous collective may
// drop the last reference to its input on the transport's thread.
#include "fsdp/buffer_pool.h"

#include <algorithm>
#include <map>
#include <memory>
#include <mutex>

#include <ATen/ATen.h>
#include <ATen/EmptyTensor.h>
#include <c10/core/CPUAllocator.h>
#include <torch/version.h>

namespace dtrain::detail::fsdp {
namespace {

class Pool final : public c10::Allocator {
 public:
#if TORCH_VERSION_MAJOR >= 2
  c10::DataPtr allocate(size_t n) override { return take(n); }
  void copy_data(void* dest, const void* src, size_t count) const override { default_copy_data(dest, src, count); }
#else
  c10::DataPtr allocate(size_t n) const override { return const_cast<Pool*>(this)->take(n); }
#endif
  c10::DeleterFnPtr raw_deleter() const override { return nullptr; }

  void reserve_for(size_t bytes) {
    std::lock_guard<std::mutex> lock(mutex_);
    cap_ = std::max(cap_, 2 * bytes);
  }
  size_t free_bytes() {
    std::lock_guard<std::mutex> lock(mutex_);
    return held_;
  }

 private:
  // A block the pool handed out or holds: the CPU allocator's own pointer, freed with it.
  struct Block {
    Pool* pool;
    size_t bytes;
    c10::DataPtr inner;
  };

  c10::DataPtr take(size_t n) {
    std::unique_ptr<Block> block;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto it = free_.find(n);
      if (it != free_.end()) {
        block = std::move(it->second);
        free_.erase(it);
        held_ -= n;
      }
    }
    if (!block) block.reset(new Block{this, n, c10::GetCPUAllocator()->allocate(n)});
    void* data = block->inner.get();
    const c10::Device device = block->inner.device();
    return c10::DataPtr(data, block.release(), &Pool::give_back, device);
  }

  static void give_back(void* ctx) {
    std::unique_ptr<Block> block(static_cast<Block*>(ctx));
    Pool* pool = block->pool;
    std::lock_guard<std::mutex> lock(pool->mutex_);
    if (block->bytes == 0 || pool->held_ + block->bytes > pool->cap_) return;  // freed here
    pool->held_ += block->bytes;
    pool->free_.emplace(block->bytes, std::move(block));
  }

  std::mutex mutex_;
  std::multimap<size_t, std::unique_ptr<Block>> free_;
  size_t held_ = 0, cap_ = 0;
};

// Never destroyed: a tensor freed during the program's exit still gives its block back.
Pool& pool() {
  static Pool* p = new Pool();
  return *p;
}

}  // namespace

at::Tensor pooled_empty(at::IntArrayRef sizes, const at::TensorOptions& options) {
  if (!options.device().is_cpu()) return at::empty(sizes, options);
  return at::detail::empty_generic(sizes, &pool(), c10::DispatchKeySet(c10::DispatchKey::CPU),
                                   c10::typeMetaToScalarType(options.dtype()), c10::MemoryFormat::Contiguous);
}

void reserve_pool_for(size_t bytes) { pool().reserve_for(bytes); }

size_t pool_free_bytes() { return pool().free_bytes(); }

}  // namespace dtrain::detail::fsdp
