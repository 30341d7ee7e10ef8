// glibc's mmap threshold under fully_shard (Note [Sharding and glibc's mmap threshold]). A program of
// its own: the threshold is process-wide, and a block other tests freed on the heap would serve the
// allocations below from there (glibc looks in its free lists before it maps a block).
#include <malloc.h>

#include <cstdlib>
#include <cstring>
#include <map>
#include <optional>
#include <string>

#include <gtest/gtest.h>

#include "common/malloc_threshold.h"
#include "dtrain/errors.h"
#include "sanitizer.h"

namespace {

// Note [Sharding and glibc's mmap threshold]: once pinned, freeing a mapped block (the whole
// parameters fully_shard frees as it shards them) no longer raises the threshold, so a block between
// the pinned threshold and that one's size is still mapped, and given back at free. (Unpinned, the
// 4 MiB block freed first raises glibc's threshold to 4 MiB and the 2 MiB block comes from the heap.)
TEST(MallocThreshold, PinnedThresholdMapsBlocksBelowOnesFreedBefore) {
#if defined(DTRAIN_TEST_SANITIZER)
  GTEST_SKIP() << "malloc is the sanitizer's here, not glibc's: it has no mmap threshold to pin";
#endif
  ASSERT_TRUE(dtrain::detail::pin_mmap_threshold(1 << 20));
  char* whole = static_cast<char*>(std::malloc(4 << 20));
  ASSERT_NE(whole, nullptr);
  std::memset(whole, 1, 4 << 20);
  std::free(whole);
  const size_t mapped = mallinfo2().hblkhd;
  char* shard = static_cast<char*>(std::malloc(2 << 20));
  ASSERT_NE(shard, nullptr);
  EXPECT_GE(mallinfo2().hblkhd, mapped + (2 << 20)) << "the 2 MiB block came from a heap, not a mapping of its own";
  std::free(shard);
  EXPECT_EQ(mallinfo2().hblkhd, mapped) << "the 2 MiB block's mapping was not given back at free";
}

TEST(MallocThreshold, ShardingLeavesAProgramsOwnChoice) {
  using dtrain::detail::sharding_mmap_threshold;
  auto from = [](std::map<std::string, std::string> vars) {
    return [vars](const std::string& name) -> std::optional<std::string> {
      auto it = vars.find(name);
      return it == vars.end() ? std::nullopt : std::optional<std::string>(it->second);
    };
  };
  EXPECT_EQ(sharding_mmap_threshold(from({}), false), size_t{1} << 20);
  EXPECT_EQ(sharding_mmap_threshold(from({{"DTRAIN_FSDP_MMAP_THRESHOLD", "4194304"}}), false), size_t{4} << 20);
  EXPECT_EQ(sharding_mmap_threshold(from({{"DTRAIN_FSDP_MMAP_THRESHOLD", "0"}}), false), 0u);
  EXPECT_EQ(sharding_mmap_threshold(from({}), /*program_tuned=*/true), 0u);
  EXPECT_EQ(sharding_mmap_threshold(from({{"MALLOC_MMAP_THRESHOLD_", "65536"}}), false), 0u);
  EXPECT_EQ(sharding_mmap_threshold(from({{"GLIBC_TUNABLES", "glibc.malloc.mmap_threshold=65536"}}), false), 0u);
  EXPECT_EQ(sharding_mmap_threshold(from({{"GLIBC_TUNABLES", "glibc.malloc.arena_max=2"}}), false), size_t{1} << 20);
  try {
    sharding_mmap_threshold(from({{"DTRAIN_FSDP_MMAP_THRESHOLD", "67108864"}}), false);
    FAIL() << "a threshold over glibc's 32 MiB maximum was taken";
  } catch (const dtrain::Error& e) {
    EXPECT_NE(std::string(e.what()).find("DTRAIN_FSDP_MMAP_THRESHOLD"), std::string::npos) << e.what();
  }
}

}  // namespace
