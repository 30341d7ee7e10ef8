#include "comm/shm/kernels.h"

#include <algorithm>

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

// Native types: one loop the compiler vectorizes (out may alias a: the same index is read first).
template <class T, class Op>
void loop(T* out, T* out2, const T* a, const T* b, size_t n, Op op) {
  if (out2) {
    for (size_t i = 0; i < n; ++i) {
      T v = op(a[i], b[i]);
      out[i] = v;
      out2[i] = v;
    }
  } else {
    for (size_t i = 0; i < n; ++i) out[i] = op(a[i], b[i]);
  }
}

// 16-bit floats: widen to float, combine, round back (c10's conversions round to nearest even).
template <class H, class Op>
void loop16(H* out, H* out2, const H* a, const H* b, size_t n, Op op) {
  for (size_t i = 0; i < n; ++i) {
    H v = H(op(static_cast<float>(a[i]), static_cast<float>(b[i])));
    out[i] = v;
    if (out2) out2[i] = v;
  }
}

template <class Op>
void dispatch(void* out, void* out2, const void* a, const void* b, size_t n, DType t, Op op) {
  switch (t) {
    case DType::F32:
      return loop(static_cast<float*>(out), static_cast<float*>(out2), static_cast<const float*>(a),
                  static_cast<const float*>(b), n, op);
    case DType::F64:
      return loop(static_cast<double*>(out), static_cast<double*>(out2), static_cast<const double*>(a),
                  static_cast<const double*>(b), n, op);
    case DType::F16:
      return loop16(static_cast<c10::Half*>(out), static_cast<c10::Half*>(out2),
                    static_cast<const c10::Half*>(a), static_cast<const c10::Half*>(b), n, op);
    case DType::BF16:
      return loop16(static_cast<c10::BFloat16*>(out), static_cast<c10::BFloat16*>(out2),
                    static_cast<const c10::BFloat16*>(a), static_cast<const c10::BFloat16*>(b), n, op);
  }
}

}  // namespace

void combine(void* out, void* out2, const void* a, const void* b, size_t count, DType t, RedOp op) {
  switch (op) {
    case RedOp::SUM: return dispatch(out, out2, a, b, count, t, Sum{});
    case RedOp::PROD: return dispatch(out, out2, a, b, count, t, Prod{});
    case RedOp::MIN: return dispatch(out, out2, a, b, count, t, Min{});
    case RedOp::MAX: return dispatch(out, out2, a, b, count, t, Max{});
  }
}

}  // namespace dtrain::shm
