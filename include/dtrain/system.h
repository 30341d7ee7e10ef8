// Facts about the running process that matter for training speed and for monitoring.
#pragma once

#include <cstdint>
#include <string>

namespace dtrain {

// The shared library that provides the BLAS sgemm_ LibTorch calls (resolved path), and whether it
// is Debian's slow reference BLAS (install libopenblas0-openmp: a 512^3 matmul is ~14x faster).
std::string blas_library();
bool blas_is_reference();
// Warns once on stderr when the reference BLAS is in use.
void warn_if_slow_blas();

// Resident memory of this process now and at its peak, in bytes (from /proc/self/status).
int64_t rss_bytes();
int64_t peak_rss_bytes();

}  // namespace dtrain
