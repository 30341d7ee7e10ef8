// Backend factory: "gloo" (CPU) and "nccl" (CUDA builds with NCCL). Callers choose by name, so a
// build without NCCL changes no call site: the only #if is in backend.cpp.
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
  // Python ranks share the group (Note [PyTorch peers]): Gloo as Python configures it, nothing else.
  bool pytorch_peers = false;
};

// Throws dtrain::Error for an unknown backend or one this LibTorch was built without.
// "gloo" gets shared-memory collectives for ranks that share a host (shm/shm_process_group.h;
// DTRAIN_SHM=0 turns them off, =1 requires them).
compat::BackendPtr make_backend(const BackendConfig& config);

// A plain ProcessGroupGloo (no shared memory).
compat::BackendPtr make_gloo_backend(const BackendConfig& config);
// The ProcessGroupGloo Python's init_process_group("gloo") creates (Note [PyTorch peers]).
compat::BackendPtr make_pytorch_gloo_backend(const BackendConfig& config);

// Validates a backend name early (before any rendezvous), with the remedy in the message.
void check_backend_name(const std::string& name);

}  // namespace dtrain::comm
