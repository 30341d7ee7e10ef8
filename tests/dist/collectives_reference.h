// Exact references for the randomized collectives test (collectives_random_test.cpp): every rank
// can compute every rank's input of every operation, and the inputs are small integers, so that each
// sum, product, minimum and maximum is exact in every dtype (bfloat16 holds integers up to 256
// exactly; the largest value here is 8 * 3 ranks) and a result can be compared bit for bit.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <torch/csrc/api/include/torch/version.h>

#include "dtrain/process_group.h"

namespace dtrain::test_ref {

enum class Kind {
  kAllReduce,
  kBroadcast,
  kReduce,
  kAllGather,
  kReduceScatter,
  kGather,
  kScatter,
  kAllGatherIntoTensor,
  kReduceScatterTensor,
  kAllToAllSingle
};
constexpr Kind kKinds[] = {Kind::kAllReduce,           Kind::kBroadcast,     Kind::kReduce,  Kind::kAllGather,
                           Kind::kReduceScatter,       Kind::kGather,        Kind::kScatter, Kind::kAllGatherIntoTensor,
                           Kind::kReduceScatterTensor, Kind::kAllToAllSingle};

inline const char* name(Kind k) {
  switch (k) {
    case Kind::kAllReduce:
      return "all_reduce";
    case Kind::kBroadcast:
      return "broadcast";
    case Kind::kReduce:
      return "reduce";
    case Kind::kAllGather:
      return "all_gather";
    case Kind::kReduceScatter:
      return "reduce_scatter";
    case Kind::kAllGatherIntoTensor:
      return "all_gather_into_tensor";
    case Kind::kReduceScatterTensor:
      return "reduce_scatter_tensor";
    case Kind::kGather:
      return "gather";
    case Kind::kScatter:
      return "scatter";
    case Kind::kAllToAllSingle:
      return "all_to_all_single";
  }
  return "?";
}

inline bool reduces(Kind k) {
  return k == Kind::kAllReduce || k == Kind::kReduce || k == Kind::kReduceScatter || k == Kind::kReduceScatterTensor;
}

// Rank r's input of operation `op` (part `part` of a list input): integers in [-8, 8], or in
// {-2, -1, 1, 2} for PRODUCT, from a hash of (seed, op, r, part) and the element index.
inline at::Tensor input_of(uint64_t seed, int op, int r, int part, int64_t numel, at::ScalarType dtype, ReduceOp rop) {
  uint64_t h = seed * 0x9E3779B97F4A7C15ull ^ (static_cast<uint64_t>(op) << 20) ^ (static_cast<uint64_t>(r) << 8) ^
               static_cast<uint64_t>(part);
  h ^= h >> 29;
  h *= 0xBF58476D1CE4E5B9ull;
  h ^= h >> 32;
  at::Tensor v =
      (at::arange(numel, at::kLong) * static_cast<int64_t>(2 * (h % 7) + 1) + static_cast<int64_t>((h >> 8) % 31)) % 17;
  if (rop == ReduceOp::PRODUCT) {
    v = v % 4;
    v = at::where(v < 2, v - 2, v - 1);
  } else {
    v = v - 8;
  }
  return v.to(dtype);
}

// The reduction over ranks 0..n-1 of their part `part`, as the collective must produce it: exact in
// double, then in the dtype; AVG divides that sum in the dtype, as dtrain does after a SUM.
inline at::Tensor reduced(uint64_t seed, int op, int n, int part, int64_t numel, at::ScalarType dtype, ReduceOp rop) {
  at::Tensor acc;
  for (int r = 0; r < n; ++r) {
    at::Tensor x = input_of(seed, op, r, part, numel, dtype, rop).to(at::kDouble);
    if (r == 0) {
      acc = x;
      continue;
    }
    switch (rop) {
      case ReduceOp::SUM:
      case ReduceOp::AVG:
        acc = acc + x;
        break;
      case ReduceOp::PRODUCT:
        acc = acc * x;
        break;
      case ReduceOp::MIN:
        acc = at::minimum(acc, x);
        break;
      case ReduceOp::MAX:
        acc = at::maximum(acc, x);
        break;
    }
  }
  at::Tensor out = acc.to(dtype);
  if (rop == ReduceOp::AVG) out.div_(n);
  return out;
}

// Rows rank i sends rank j in all_to_all_single operation of size `numel`: uneven, zeros among them.
inline int64_t exchange_rows(int64_t numel, int i, int j) { return (numel * (i + 1) + 7 * j) % (numel + 1); }

// Whether the default group must run `kind` on `dtype`, by what dtrain documents: shared memory
// reduces the floating-point dtypes and moves any dtype, but hands all_to_all to Gloo; Gloo takes
// float32/64, float16, the integers but int16, and bfloat16 from LibTorch 2.x on (1.13's Gloo has
// none). Written out here, not asked of dtrain, so that a wrong answer in the library fails the test.
inline bool expect_supported(Kind kind, at::ScalarType dtype, bool shm) {
  const bool floating = dtype == at::kFloat || dtype == at::kDouble || dtype == at::kHalf || dtype == at::kBFloat16;
  if (shm && kind != Kind::kAllToAllSingle && (!reduces(kind) || floating)) return true;
  if (dtype == at::kShort) return false;
  if (dtype == at::kBFloat16) return TORCH_VERSION_MAJOR >= 2;
  return true;
}

}  // namespace dtrain::test_ref
