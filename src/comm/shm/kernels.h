// Elementwise reductions for the shared-memory collectives (torch-free, built with -O3 so the
// float loops vectorize). out[i] = op(a[i], b[i]); `out` may alias `a` or `b`, index for index.
//
// float16 and bfloat16 are combined in float and rounded once per pass (round to nearest even),
// which is what Gloo does for two ranks, so a two-rank SUM is bit-identical to Gloo's.
#pragma once

#include <cstddef>
#include <cstdint>

namespace dtrain::shm {

enum class DType : uint32_t { F32 = 1, F64 = 2, F16 = 3, BF16 = 4 };
enum class RedOp : uint32_t { SUM = 1, PROD = 2, MIN = 3, MAX = 4 };

size_t element_size(DType t);
const char* to_string(DType t);
const char* to_string(RedOp op);

// A SUM in which one operand is this rank's own contribution, divided by `divisor` on its way in:
// out = a / divisor + b (`first`) or a + b / divisor. float32 and float64 only.
struct Divided {
  double divisor;
  bool first;
};

void combine(void* out, const void* a, const void* b, size_t count, DType t, RedOp op,
             const Divided* divided = nullptr);

// out[i] = a[i] / divisor (out may alias a). float32 and float64 only.
void divide(void* out, const void* a, size_t count, DType t, double divisor);

// out[i] = op(a[i], b[i]) into `out`, and the same values into `shared` with non-temporal
// (streaming) stores, block by block. `out` may alias a or b; `shared` may alias a. Meant for a result
// that another process reads from shared memory: streamed lines go to memory instead of staying
// modified in this core's cache, and the reader then fetches them from memory rather than from this
// core, which is faster at every size (the numbers: docs/benchmarks.md, shared-memory all-reduce).
// Ends with a store fence, so a release store that follows publishes the values.
void combine_streaming(void* out, void* shared, const void* a, const void* b, size_t count, DType t, RedOp op,
                       const Divided* divided = nullptr);

// memcpy with non-temporal stores where `dst` is 16-byte aligned: the destination's lines are not
// read first and do not stay in cache. For outputs larger than the cache keeps anyway. Weakly ordered:
// call store_fence() before anything that publishes the bytes to another thread or process.
void stream_copy(void* dst, const void* src, size_t bytes);

// Orders every streaming store before it ahead of the stores that follow (sfence).
void store_fence();

}  // namespace dtrain::shm
