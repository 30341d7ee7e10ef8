// A process group outside the world (fault tolerance's cross-replica group, dtrain/fault_tolerance.h):
// ranks 0..size-1 that meet under their own key prefix of a store every process reaches, plain Gloo
// (no shared memory), built and dropped while the process lives on. Every member builds it with the
// same prefix and size; a member that never comes makes the construction fail after `timeout`.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>

#include "compat/c10d_compat.h"

namespace dtrain::comm {

struct ReplicaGroupConfig {
  std::string host;  // the store's address
  uint16_t port = 0;
  std::string secret;  // the job's, or "" for an open store
  std::string prefix;  // unique per group (e.g. per quorum id)
  int rank = 0;
  int size = 1;
  std::chrono::milliseconds timeout{10000};
};

// Throws dtrain::Error naming the prefix and the cause (a peer that did not come, an unreachable store).
compat::BackendPtr make_replica_group(const ReplicaGroupConfig& config);

}  // namespace dtrain::comm
