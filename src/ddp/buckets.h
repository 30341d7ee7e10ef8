// Gradient bucket assignment, as PyTorch's compute_bucket_assignment_by_size:
//
//   1. Walk the parameters in REVERSE registration order (backward produces the last layers'
//      gradients first, so they should be reduced first).
//   2. Keep one open bucket per (dtype, device); add the parameter to its open bucket.
//   3. When an open bucket reaches its size limit, close it. The first bucket of each
//      (dtype, device) uses first_cap_bytes (small, so communication starts early), later ones
//      cap_bytes. (PyTorch 1.13 applies the small limit to the first layers, then rebuilds the
//      buckets after one iteration in gradient-ready order; walking in reverse gives that order
//      from the start.)
//   4. Open buckets are closed at the end; buckets are ordered by when their first parameter
//      was visited, i.e. in the order backward fills them.
#pragma once

#include <cstddef>
#include <vector>

#include <ATen/core/Tensor.h>

namespace dtrain::ddp {

std::vector<std::vector<int>> assign_buckets(const std::vector<at::Tensor>& params, size_t first_cap_bytes,
                                             size_t cap_bytes);

}  // namespace dtrain::ddp
