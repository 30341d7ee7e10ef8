// The BLAS LibTorch calls must be OpenBLAS, not Debian's reference BLAS (14x slower).
#include "dtrain/system.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

TEST(System, BlasIsNotTheReferenceImplementation) {
  at::Tensor a = at::ones({64, 64});
  at::Tensor c = at::mm(a, a);  // make sure the BLAS path has been used
  ASSERT_FLOAT_EQ(c[0][0].item<float>(), 64.0f);
  const std::string lib = dtrain::blas_library();
  ASSERT_FALSE(lib.empty()) << "no sgemm_ symbol found in the process";
  EXPECT_FALSE(dtrain::blas_is_reference())
      << "LibTorch calls the reference BLAS " << lib << ": run scripts/setup.sh (libopenblas0-openmp)";
}

TEST(System, MemoryReadings) {
  EXPECT_GT(dtrain::rss_bytes(), 1 << 20);
  // The current reading first: the peak read after it can only be as large (in one expression the
  // order is the compiler's, and a page touched between the two readings would fail the other order).
  const int64_t now = dtrain::rss_bytes();
  EXPECT_GE(dtrain::peak_rss_bytes(), now);
}

#include <dlfcn.h>
#include <sys/resource.h>

#include <cstdlib>
#include <cstring>
#include <vector>

namespace {
// AddressSanitizer (scripts/sanitize.sh) replaces malloc with its own allocator, which glibc's
// mallopt settings do not reach; its runtime defines __asan_init.
bool under_address_sanitizer() { return dlsym(RTLD_DEFAULT, "__asan_init") != nullptr; }

long minor_faults() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return u.ru_minflt;
}
}  // namespace

TEST(System, AllocatorKeepsActivationSizedBlocks) {
  // Note [malloc churn]: a training step allocates and frees activation-sized blocks; after tuning,
  // the next step reuses them without faulting their pages in again. (With DTRAIN_MALLOC_TUNING=0
  // this test fails: glibc unmaps or trims the freed 40 MiB.)
  if (under_address_sanitizer()) GTEST_SKIP() << "malloc is AddressSanitizer's here, not glibc's";
  dtrain::reduce_allocator_churn();
  constexpr size_t kBlock = 1 << 20, kCount = 40;
  auto step = [&] {
    std::vector<char*> blocks;
    for (size_t i = 0; i < kCount; ++i) {
      blocks.push_back(static_cast<char*>(std::malloc(kBlock)));
      std::memset(blocks.back(), 1, kBlock);
    }
    for (char* b : blocks) std::free(b);
  };
  step();
  const long before = minor_faults();
  step();
  const long faults = minor_faults() - before;
  EXPECT_LT(faults, 1000) << "the second step faulted " << faults << " pages in again (40 MiB = 10240 pages)";
}
