// Backend factory: "gloo" (CPU) and "nccl" (CUDA builds with NCCL). Callers choose by name, so a
// build without NCCL changes no call site: the only #if is in backend.cpp.
//
// comm/ is layered one way (docs/design.md, "comm/ inside"):
//   front end   init.cpp, collectives.cpp, work.cpp    -> this header, capabilities.h
//   factory     backend.cpp                            -> gloo_backend.h, shm/shm_process_group.h, NCCL
//   backends    gloo_backend.cpp, shm/                 -> backend_config.h, capabilities.h (shm/ also gloo_backend.h)
// The front end talks to every backend through c10d's Backend interface (compat::BackendPtr) and
// capabilities.h's; no backend includes a header above it.
#pragma once

#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "comm/backend_config.h"
#include "comm/capabilities.h"

namespace dtrain::comm {

// The process group and what answers for it (Note [One backend interface] in capabilities.h).
// Throws dtrain::Error for an unknown backend or one this LibTorch was built without.
// "gloo" gets shared-memory collectives for ranks that share a host (shm/shm_process_group.h;
// DTRAIN_SHM=0 turns them off, =1 requires them).
Backend make_backend(const BackendConfig& config);

// Validates a backend name early (before any rendezvous), with the remedy in the message.
void check_backend_name(const std::string& name);

}  // namespace dtrain::comm
