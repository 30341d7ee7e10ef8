// The collective the built-in communication hooks share: an asynchronous SUM all-reduce as a Future,
// with bfloat16 gathered on Gloo 1.x (Note [bfloat16 on Gloo 1.x] in comm_hooks.cpp).
#pragma once

#include "dtrain/comm_hooks.h"

namespace dtrain::ddp {

// Sums t over the group in place; the Future's value is t.
Future sum_future(at::Tensor t, const Group& group);
// The same for a small tensor: sends and receives instead of a Gloo collective (Note [Small sums as exchanges]).
Future small_sum_future(at::Tensor t, const Group& group);

}  // namespace dtrain::ddp
