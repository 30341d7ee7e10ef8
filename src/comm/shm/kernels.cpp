#include "comm/shm/kernels.h"

#include <algorithm>
#include <cstring>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define DTRAIN_HAVE_STREAMING_STORES 1
#endif

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

namespace dtrain::shm {

size_t element_size(DType t) {
  switch (t) {
    case DType::F32: return 4;
    case DType::F64: return 8;
    case DType::F16:
    case DType::BF16: return 2;
  }
  return 0;
}

const char* to_string(DType t) {
  switch (t) {
    case DType::F32: return "float32";
    case DType::F64: return "float64";
    case DType::F16: return "float16";
    case DType::BF16: return "bfloat16";
  }
  return "unknown dtype";
}

const char* to_string(RedOp op) {
  switch (op) {
    case RedOp::SUM: return "SUM";
    case RedOp::PROD: return "PRODUCT";
    case RedOp::MIN: return "MIN";
    case RedOp::MAX: return "MAX";
  }
  return "unknown op";
}

namespace {

struct Sum { template <class T> T operator()(T a, T b) const { return a + b; } };
struct Prod { template <class T> T operator()(T a, T b) const { return a * b; } };
// std::min/std::max keep `a` when the comparison is false, as Gloo's min/max do.
struct Min { template <class T> T operator()(T a, T b) const { return std::min(a, b); } };
struct Max { template <class T> T operator()(T a, T b) const { return std::max(a, b); } };

// Native types: one loop the compiler vectorizes. out may alias a or b, but only index for index
// (each index is read before it is written), so there is no loop-carried dependence: ivdep lets the
// compiler vectorize without its runtime overlap check, which would otherwise pick the scalar loop
// whenever out == b.
template <class T, class Op>
void loop(T* out, const T* a, const T* b, size_t n, Op op) {
#pragma GCC ivdep
  for (size_t i = 0; i < n; ++i) out[i] = op(a[i], b[i]);
}

// 16-bit floats: widen to float, combine, round back (c10's conversions round to nearest even).
template <class H, class Op>
void loop16(H* out, const H* a, const H* b, size_t n, Op op) {
  for (size_t i = 0; i < n; ++i) out[i] = H(op(static_cast<float>(a[i]), static_cast<float>(b[i])));
}

template <class Op>
void dispatch(void* out, const void* a, const void* b, size_t n, DType t, Op op) {
  switch (t) {
    case DType::F32:
      return loop(static_cast<float*>(out), static_cast<const float*>(a), static_cast<const float*>(b), n, op);
    case DType::F64:
      return loop(static_cast<double*>(out), static_cast<const double*>(a), static_cast<const double*>(b), n, op);
    case DType::F16:
      return loop16(static_cast<c10::Half*>(out), static_cast<const c10::Half*>(a),
                    static_cast<const c10::Half*>(b), n, op);
    case DType::BF16:
      return loop16(static_cast<c10::BFloat16*>(out), static_cast<const c10::BFloat16*>(a),
                    static_cast<const c10::BFloat16*>(b), n, op);
  }
}

// memcpy with non-temporal stores where the destination is 16-byte aligned.
void stream_copy(char* dst, const char* src, size_t bytes) {
#ifdef DTRAIN_HAVE_STREAMING_STORES
  const size_t head = std::min(bytes, (16 - (reinterpret_cast<uintptr_t>(dst) & 15)) & 15);
  std::memcpy(dst, src, head);
  dst += head;
  src += head;
  bytes -= head;
  size_t i = 0;
  for (; i + 64 <= bytes; i += 64) {
    const __m128i x0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    const __m128i x1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 16));
    const __m128i x2 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 32));
    const __m128i x3 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 48));
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i), x0);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 16), x1);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 32), x2);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 48), x3);
  }
  std::memcpy(dst + i, src + i, bytes - i);
#else
  std::memcpy(dst, src, bytes);
#endif
}

}  // namespace

void combine_streaming(void* out, void* shared, const void* a, const void* b, size_t count, DType t,
                       RedOp op) {
  const size_t es = element_size(t);
  const size_t block = 4096 / es;  // the block just written is still in L1 when it is streamed
  for (size_t done = 0; done < count; done += block) {
    const size_t n = std::min(block, count - done), off = done * es;
    char* o = static_cast<char*>(out) + off;
    combine(o, static_cast<const char*>(a) + off, static_cast<const char*>(b) + off, n, t, op);
    stream_copy(static_cast<char*>(shared) + off, o, n * es);
  }
#ifdef DTRAIN_HAVE_STREAMING_STORES
  _mm_sfence();
#endif
}

void combine(void* out, const void* a, const void* b, size_t count, DType t, RedOp op) {
  switch (op) {
    case RedOp::SUM: return dispatch(out, a, b, count, t, Sum{});
    case RedOp::PROD: return dispatch(out, a, b, count, t, Prod{});
    case RedOp::MIN: return dispatch(out, a, b, count, t, Min{});
    case RedOp::MAX: return dispatch(out, a, b, count, t, Max{});
  }
}

}  // namespace dtrain::shm
