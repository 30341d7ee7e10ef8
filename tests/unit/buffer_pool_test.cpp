// fully_shard's pool of CPU buffers (Note [Buffer pool]): a freed block comes back at its own size,
// and the pool keeps no more than twice the largest working set a unit reserved.
#include "fsdp/buffer_pool.h"

#include <thread>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

namespace {

using dtrain::detail::fsdp::pool_free_bytes;
using dtrain::detail::fsdp::pooled_empty;
using dtrain::detail::fsdp::reserve_pool_for;

TEST(BufferPool, AFreedBlockComesBackAtItsOwnSizeOnly) {
  reserve_pool_for(1 << 20);
  const auto options = at::TensorOptions().dtype(at::kFloat);
  void* first = nullptr;
  {
    at::Tensor t = pooled_empty({1000, 3}, options);
    first = t.data_ptr();
  }
  at::Tensor other = pooled_empty({1000, 2}, options);  // another size: a block of its own
  EXPECT_NE(other.data_ptr(), first);
  at::Tensor again = pooled_empty({3000}, at::TensorOptions().dtype(at::kInt));  // the same bytes
  EXPECT_EQ(again.data_ptr(), first);
}

TEST(BufferPool, KeepsAtMostTwiceTheLargestReservation) {
  const size_t block = 64 << 20;  // larger than any earlier reservation: the cap is 2 blocks
  reserve_pool_for(block);
  const size_t before = pool_free_bytes();
  {
    std::vector<at::Tensor> held;
    for (int i = 0; i < 3; ++i) held.push_back(pooled_empty({static_cast<int64_t>(block)}, at::kByte));
  }
  EXPECT_LE(pool_free_bytes(), 2 * block);
  EXPECT_GE(pool_free_bytes(), before + block);  // kept two of the three (what was free before may go)
}

TEST(BufferPool, ABlockFreedOnAnotherThreadIsKept) {
  reserve_pool_for(1 << 20);
  at::Tensor t = pooled_empty({4099}, at::kFloat);
  void* data = t.data_ptr();
  std::thread([t = std::move(t)]() mutable { t = at::Tensor(); }).join();
  EXPECT_EQ(pooled_empty({4099}, at::kFloat).data_ptr(), data);
}

TEST(BufferPool, ARefilledStorageTakesItsBytesFromThePool) {
  reserve_pool_for(1 << 20);  // each case may run in a process of its own: the pool keeps nothing before
  at::Tensor t = pooled_empty({777}, at::kFloat);
  c10::StorageImpl* s = t.storage().unsafeGetStorageImpl();
  void* data = t.data_ptr();
  s->set_data_ptr_noswap(at::DataPtr(nullptr, t.device()));  // emptied as a resharded parameter is
  s->set_nbytes(0);
  s->set_data_ptr_noswap(s->allocator()->allocate(777 * 4));
  s->set_nbytes(777 * 4);
  EXPECT_EQ(t.data_ptr(), data);
}

}  // namespace
