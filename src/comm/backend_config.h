// What every backend is made from. The lowest layer of comm/: the backends (gloo_backend.h, shm/)
// and the factory (backend.h) include it; it includes none of them.
#pragma once

#include <chrono>
#include <string>
#include <vector>

#include "compat/c10d_compat.h"

namespace dtrain::comm {

struct BackendConfig {
  std::string name = "gloo";
  c10::intrusive_ptr<c10d::Store> store;  // already prefixed for this group
  int rank = 0;
  int size = 1;
  std::chrono::milliseconds timeout{0};
  // Address whose interface Gloo listens on: the local end of the store connection, i.e. the
  // interface that routes to the master. GLOO_SOCKET_IFNAME (comma-separated) overrides it.
  std::string bind_address = "127.0.0.1";
  // The group's global ranks (index = group rank), for error messages; empty = the same numbers.
  std::vector<int> global_ranks;
  // Python ranks share the group (Note [PyTorch peers]): Gloo as Python configures it, nothing else;
  // python_group is Python's name for the group ("0": the default group).
  bool pytorch_peers = false;
  std::string python_group = "0";
  // false: plain Gloo, never the shared-memory group (fault tolerance's cross-replica groups, whose
  // peers may be SIGKILLed at any moment: Gloo's sockets report that at once).
  bool shared_memory = true;
};

}  // namespace dtrain::comm
