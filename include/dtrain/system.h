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

// Note [malloc churn]: glibc returns freed activation-sized blocks (mmap'ed above its dynamic
// threshold, or trimmed from the heap top) to the kernel, and the next step page-faults them in
// again. Measured on train_fashion_mnist: one rank took 11 million minor faults and 84 s of system
// time in 4 epochs while the other took 0.1 million, and the whole job ran ~25% slower. This keeps
// blocks up to 32 MiB on the heap and stops trimming, once per process. Off with DTRAIN_MALLOC_TUNING=0.
void reduce_allocator_churn();

// Resident memory of this process now and at its peak, in bytes (from /proc/self/status).
int64_t rss_bytes();
int64_t peak_rss_bytes();

}  // namespace dtrain
