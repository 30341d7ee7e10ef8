// DTRAIN_DEBUG=DETAIL: the cross-rank check run before every collective (PyTorch's
// TORCH_DISTRIBUTED_DEBUG=DETAIL wraps its process groups the same way). Without it the backends
// still catch ranks that call different collectives, or the same one with different shapes (shared
// memory: shm/comm.h; Gloo: Note [Guarded Gloo collectives]); with it the collectives are numbered
// too, and a rank that is stuck elsewhere is named once the timeout passes.
//
// Protocol, per group, for the collective number `seq` (counted per group on every member):
//   1. Describe the call in text, e.g. "all_reduce(float[4, 2], op=SUM)": the operation, the
//      shapes and dtypes of the tensors every rank passes, the reduce op and the root.
//   2. Publish it in the job store under debug/<group>/<seq>/<group rank>, and delete this rank's
//      key of seq-2 (every rank has read it: a rank publishes seq only after it read everyone's
//      seq-1, which each rank published only after it read everyone's seq-2).
//   3. Read every other member's description of `seq` (waits up to the group's timeout).
//   4. Compare with group rank 0's: on a difference throw dtrain::Error naming both ranks and
//      their calls. No rank has started the collective, so the group stays usable.
#pragma once

#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "dtrain/process_group.h"

namespace dtrain::comm {

// The current level; cheap (an atomic load once the level is known).
bool detail_checks_on();
// "float[4, 2]"
std::string describe(const at::Tensor& t);
// Steps 1-4 for the call `desc` on group g (the caller is a member). Throws dtrain::Error on a mismatch.
void check_same_call(const detail::GroupImpl& g, const std::string& desc);
// init_process_group: reads $DTRAIN_DEBUG unless set_debug_level was called; throws on a bad value.
void init_debug_level();

}  // namespace dtrain::comm
