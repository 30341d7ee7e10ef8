// glibc's mmap threshold under fully_shard (Note [Sharding and glibc's mmap threshold] in
// common/system.cpp).
#pragma once

#include <cstddef>

#include "common/env.h"

namespace dtrain::detail {

// The threshold fully_shard pins (DTRAIN_FSDP_MMAP_THRESHOLD, 1 MiB by default), or 0 where it leaves
// glibc alone: the variable is 0, the program tuned malloc itself (reduce_allocator_churn() ran:
// `program_tuned`), or the environment sets glibc's threshold (MALLOC_MMAP_THRESHOLD_, or
// glibc.malloc.mmap_threshold in GLIBC_TUNABLES).
size_t sharding_mmap_threshold(const env::Lookup& from, bool program_tuned);

// mallopt(M_MMAP_THRESHOLD, bytes): blocks of `bytes` and more are mapped from the kernel and given
// back at free, and glibc no longer raises the threshold by itself. False where mallopt refused.
bool pin_mmap_threshold(size_t bytes);

// Once per process, at the first fully_shard of CPU parameters, before the whole parameters are
// freed: pins sharding_mmap_threshold() where it is not 0. Returns what it pinned (0: nothing).
size_t settle_malloc_for_sharding();

// What settle_malloc_for_sharding() pinned so far (0: nothing, or not called yet).
size_t pinned_mmap_threshold();

}  // namespace dtrain::detail
