// A dimension argument checked against a tensor and wrapped to [0, dim()), with the one error line
// every collective and layout of tensor and context parallelism gives for it.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

#include "dtrain/errors.h"

namespace dtrain {
namespace tp {

// `op` names the call and `arg` the argument ("dim", "seq_dim") in the error.
inline int64_t wrap_dim(int64_t dim, const at::Tensor& t, const char* op, const char* arg = "dim") {
  const int64_t n = t.dim();
  DTRAIN_CHECK(dim >= -n && dim < n, op, ": ", arg, " ", dim, " is out of range for a tensor of ", n,
               " dimensions: give one in [", -n, ", ", n - 1, "]");
  return dim < 0 ? dim + n : dim;
}

}  // namespace tp
}  // namespace dtrain
