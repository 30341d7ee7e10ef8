// The Gloo process group with shared-memory collectives for ranks that share a host.
//
// ShmProcessGroup is a c10d process group (compat::Backend) wrapping the group's ProcessGroupGloo, so
// DDP and every other caller get it through the same interface. all_reduce and reduce (SUM, PRODUCT,
// MIN, MAX on float32/float64/float16/bfloat16 CPU tensors), reduce-scatter of one tensor (the same;
// c10d's _reduce_scatter_base), broadcast, all_gather (also into one tensor: _allgather_base),
// gather, scatter (any dtype) and barrier run over shared memory on a worker thread (asynchronous like Gloo: the
// caller gets a Work at once);
// everything else, and every tensor the shared-memory path does not take, goes to Gloo, on the same
// worker, once every rank has described the same call (Note [Guarded Gloo collectives] in
// shm_gloo_guard.cpp). Without shared memory (DTRAIN_SHM=0, or one rank per host) the group still
// wraps Gloo, for that check.
//
// Across hosts all_reduce is hierarchical (Horovod's): shared memory inside each host, Gloo between
// one leader per host, shared memory to spread the result; the other collectives use Gloo.
//
// Setup (make_backend, comm/backend.cpp): see make_shm_process_group below.
//
// The group is its own Capabilities (comm/capabilities.h): the factory asks it through that interface.
//
// Layering: shm/ depends on the lowest layer of comm/ (backend_config.h, capabilities.h) and on
// gloo_backend.h (it wraps and creates Gloo groups); the factory (backend.cpp) is the only file above
// that includes this header, so the front end (collectives, Group) never sees the shared-memory group.
#pragma once

#include <string>
#include <vector>

#include "comm/backend_config.h"
#include "compat/c10d_compat.h"

namespace dtrain::comm {

enum class ShmMode { kOff, kAuto, kRequired };

// DTRAIN_SHM: unset/"auto" -> kAuto, "0" -> kOff, "1" -> kRequired; anything else is an error.
ShmMode shm_mode_from_env();

// Steps (every rank of the group, through the group's store):
//   1. Publish this rank's host key (DTRAIN_SHM_HOST if set, else host name + boot id + the
//      identity of /dev/shm) and read everyone's; ranks with the same key share a host.
//   2. If no two ranks share a host, wrap `gloo` alone (kRequired: error).
//   3. Each host's lowest rank creates a segment (segment.h) and publishes its name; the others
//      attach. Every rank publishes "ok" or its error and reads everyone's: all ranks agree.
//   4. Any error: kAuto warns once and wraps `gloo` alone; kRequired throws. Otherwise the creators
//      unlink the names (Note [Segment lifetime]) and, with several hosts, the host leaders build
//      a Gloo group among themselves.
compat::BackendPtr make_shm_process_group(const BackendConfig& config, compat::BackendPtr gloo, ShmMode mode);

}  // namespace dtrain::comm
