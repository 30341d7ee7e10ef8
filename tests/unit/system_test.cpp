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
  EXPECT_GE(dtrain::peak_rss_bytes(), dtrain::rss_bytes());
}
