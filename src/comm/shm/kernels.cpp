#include "comm/shm/kernels.h"

#include <algorithm>
#include <cstring>
#include <type_traits>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#include <immintrin.h>
#define DTRAIN_HAVE_STREAMING_STORES 1
#endif

// "No loop-carried dependence here" in each compiler's words (GCC and clang both vectorize the loop
// without a runtime overlap check then); other compilers get the plain loop.
#if defined(__clang__)
#define DTRAIN_IVDEP _Pragma("clang loop vectorize(assume_safety)")
#elif defined(__GNUC__)
#define DTRAIN_IVDEP _Pragma("GCC ivdep")
#else
#define DTRAIN_IVDEP
#endif

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include "dtrain/errors.h"

namespace dtrain::shm {

size_t element_size(DType t) {
  switch (t) {
    case DType::F32:
      return 4;
    case DType::F64:
      return 8;
    case DType::F16:
    case DType::BF16:
      return 2;
  }
  return 0;
}

const char* to_string(DType t) {
  switch (t) {
    case DType::F32:
      return "float32";
    case DType::F64:
      return "float64";
    case DType::F16:
      return "float16";
    case DType::BF16:
      return "bfloat16";
  }
  return "unknown dtype";
}

const char* to_string(RedOp op) {
  switch (op) {
    case RedOp::SUM:
      return "SUM";
    case RedOp::PROD:
      return "PRODUCT";
    case RedOp::MIN:
      return "MIN";
    case RedOp::MAX:
      return "MAX";
  }
  return "unknown op";
}

namespace {

struct Sum {
  template <class T>
  T operator()(T a, T b) const {
    return a + b;
  }
};
struct Prod {
  template <class T>
  T operator()(T a, T b) const {
    return a * b;
  }
};
// std::min/std::max keep `a` when the comparison is false, as Gloo's min/max do.
struct Min {
  template <class T>
  T operator()(T a, T b) const {
    return std::min(a, b);
  }
};
struct Max {
  template <class T>
  T operator()(T a, T b) const {
    return std::max(a, b);
  }
};

// SUM where one operand is this rank's own contribution, divided on its way in (DDP's average: every
// rank divides its gradients by the divisor, then they are summed, as a bucket filled by div_out and
// then all-reduced would be). float and double only.
struct SumDivA {
  double d;
  template <class T>
  T operator()(T a, T b) const {
    return a / static_cast<T>(d) + b;
  }
};
struct SumDivB {
  double d;
  template <class T>
  T operator()(T a, T b) const {
    return a + b / static_cast<T>(d);
  }
};

// Native types: one loop the compiler vectorizes. out may alias a or b, but only index for index
// (each index is read before it is written), so there is no loop-carried dependence: ivdep lets the
// compiler vectorize without its runtime overlap check, which would otherwise pick the scalar loop
// whenever out == b.
// noinline keeps every (type, op) loop its own symbol, so that ctest shm_kernels_vectorized can check
// each one for packed instructions (a call per 4 KiB block costs nothing measurable).
template <class T, class Op>
__attribute__((noinline)) void loop(T* out, const T* a, const T* b, size_t n, Op op) {
  DTRAIN_IVDEP
  for (size_t i = 0; i < n; ++i) out[i] = op(a[i], b[i]);
}

template <class T>
__attribute__((noinline)) void divide_loop(T* out, const T* a, size_t n, T d) {
  DTRAIN_IVDEP
  for (size_t i = 0; i < n; ++i) out[i] = a[i] / d;
}

// 16-bit floats: widen to float, combine, round back (c10's conversions round to nearest even).
template <class H, class Op>
__attribute__((noinline)) void loop16(H* out, const H* a, const H* b, size_t n, Op op) {
  for (size_t i = 0; i < n; ++i) out[i] = H(op(static_cast<float>(a[i]), static_cast<float>(b[i])));
}

#ifdef DTRAIN_HAVE_STREAMING_STORES
// float16 through F16C: c10::Half's conversions are portable bit manipulation that GCC leaves
// scalar, about 8x slower than this. Eight halves at a time are widened, combined as floats and
// rounded back to nearest even, which is what c10::Half(float) does; the tail takes the portable
// loop. Compiled for AVX + F16C in this function only and chosen at run time, so the library still
// runs on any x86-64. The lane operations keep std::min/std::max's choice of operand (Min, Max).
template <class Op>
__attribute__((target("avx,f16c"))) inline __m256 lanes(__m256 a, __m256 b) {
  static_assert(std::is_same_v<Op, Sum> || std::is_same_v<Op, Prod> || std::is_same_v<Op, Min> ||
                std::is_same_v<Op, Max>);
  if constexpr (std::is_same_v<Op, Sum>)
    return _mm256_add_ps(a, b);
  else if constexpr (std::is_same_v<Op, Prod>)
    return _mm256_mul_ps(a, b);
  else if constexpr (std::is_same_v<Op, Min>)
    return _mm256_min_ps(b, a);  // b < a ? b : a
  else
    return _mm256_max_ps(b, a);  // b > a ? b : a
}

template <class Op>
__attribute__((target("avx,f16c"), noinline)) void loop_f16c(c10::Half* out, const c10::Half* a, const c10::Half* b,
                                                             size_t n, Op op) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 x = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a + i)));
    const __m256 y = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + i)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i),
                     _mm256_cvtps_ph(lanes<Op>(x, y), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  loop16(out + i, a + i, b + i, n - i, op);
}

// CPUID leaf 1: ECX bit 29 F16C, bit 28 AVX. (GCC's __builtin_cpu_supports knows "f16c", clang 14's
// does not.) AVX also needs the OS to save the YMM registers, which __builtin_cpu_supports("avx")
// checks through XGETBV.
bool has_f16c() {
  static const bool yes = [] {
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    return __get_cpuid(1, &eax, &ebx, &ecx, &edx) && (ecx & (1u << 29)) != 0 && __builtin_cpu_supports("avx");
  }();
  return yes;
}
#endif

template <class Op>
void dispatch(void* out, const void* a, const void* b, size_t n, DType t, Op op) {
  switch (t) {
    case DType::F32:
      return loop(static_cast<float*>(out), static_cast<const float*>(a), static_cast<const float*>(b), n, op);
    case DType::F64:
      return loop(static_cast<double*>(out), static_cast<const double*>(a), static_cast<const double*>(b), n, op);
    case DType::F16:
#ifdef DTRAIN_HAVE_STREAMING_STORES
      if (has_f16c())
        return loop_f16c(static_cast<c10::Half*>(out), static_cast<const c10::Half*>(a),
                         static_cast<const c10::Half*>(b), n, op);
#endif
      return loop16(static_cast<c10::Half*>(out), static_cast<const c10::Half*>(a), static_cast<const c10::Half*>(b), n,
                    op);
    case DType::BF16:
      return loop16(static_cast<c10::BFloat16*>(out), static_cast<const c10::BFloat16*>(a),
                    static_cast<const c10::BFloat16*>(b), n, op);
  }
}

template <class Op>
void dispatch_wide(void* out, const void* a, const void* b, size_t n, DType t, Op op) {
  DTRAIN_ASSERT(t == DType::F32 || t == DType::F64);
  if (t == DType::F32)
    loop(static_cast<float*>(out), static_cast<const float*>(a), static_cast<const float*>(b), n, op);
  else
    loop(static_cast<double*>(out), static_cast<const double*>(a), static_cast<const double*>(b), n, op);
}

}  // namespace

void stream_copy(void* to, const void* from, size_t bytes) {
  char* dst = static_cast<char*>(to);
  const char* src = static_cast<const char*>(from);
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

void store_fence() {
#ifdef DTRAIN_HAVE_STREAMING_STORES
  _mm_sfence();
#endif
}

void combine_streaming(void* out, void* shared, const void* a, const void* b, size_t count, DType t, RedOp op,
                       const Divided* divided) {
  const size_t es = element_size(t);
  const size_t block = 4096 / es;  // the block just written is still in L1 when it is streamed
  for (size_t done = 0; done < count; done += block) {
    const size_t n = std::min(block, count - done), off = done * es;
    char* o = static_cast<char*>(out) + off;
    combine(o, static_cast<const char*>(a) + off, static_cast<const char*>(b) + off, n, t, op, divided);
    stream_copy(static_cast<char*>(shared) + off, o, n * es);
  }
  store_fence();
}

void divide(void* out, const void* a, size_t count, DType t, double divisor) {
  DTRAIN_ASSERT(t == DType::F32 || t == DType::F64);
  if (t == DType::F32)
    divide_loop(static_cast<float*>(out), static_cast<const float*>(a), count, static_cast<float>(divisor));
  else
    divide_loop(static_cast<double*>(out), static_cast<const double*>(a), count, divisor);
}

void combine(void* out, const void* a, const void* b, size_t count, DType t, RedOp op, const Divided* divided) {
  if (divided) {
    DTRAIN_ASSERT(op == RedOp::SUM);
    if (divided->first) return dispatch_wide(out, a, b, count, t, SumDivA{divided->divisor});
    return dispatch_wide(out, a, b, count, t, SumDivB{divided->divisor});
  }
  switch (op) {
    case RedOp::SUM:
      return dispatch(out, a, b, count, t, Sum{});
    case RedOp::PROD:
      return dispatch(out, a, b, count, t, Prod{});
    case RedOp::MIN:
      return dispatch(out, a, b, count, t, Min{});
    case RedOp::MAX:
      return dispatch(out, a, b, count, t, Max{});
  }
}

}  // namespace dtrain::shm
