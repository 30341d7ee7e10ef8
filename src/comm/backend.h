// Backend factory: "gloo" (CPU) and "nccl" (CUDA builds with NCCL). Callers choose by name, so a
// build without NCCL changes no call site: the only #if is in backend.cpp.
//
// comm/ is layered one way (docs/design.md, "comm/ inside"):
//   front end   init.cpp, collectives.cpp, work.cpp    -> this header, call_hint.h
//   factory     backend.cpp                            -> gloo_backend.h, shm/shm_process_group.h, NCCL
//   backends    gloo_backend.cpp, shm/                 -> backend_config.h, call_hint.h (shm/ also gloo_backend.h)
// The front end talks to every backend through c10d's Backend interface (compat::BackendPtr) and
// the hints of call_hint.h; no backend includes a header above it.
#pragma once

#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "comm/backend_config.h"

namespace dtrain::comm {

// Throws dtrain::Error for an unknown backend or one this LibTorch was built without.
// "gloo" gets shared-memory collectives for ranks that share a host (shm/shm_process_group.h;
// DTRAIN_SHM=0 turns them off, =1 requires them).
compat::BackendPtr make_backend(const BackendConfig& config);

// Whether `pg`, made by make_backend, runs collectives over shared memory on this rank's host.
bool uses_shared_memory(const compat::BackendPtr& pg);

// "" when `pg`, made by make_backend, can run the collective `type` on tensors like `t` with `op`
// (SUM when the collective does not reduce); otherwise what it cannot do and the remedy, e.g. "Gloo
// in LibTorch 1.13.0 has no BFloat16 collectives: convert the tensor ...". Decided from the call's
// arguments and facts every rank shares, so every rank of a correct program answers alike and a
// rejected call is rejected everywhere before anything is sent (Note [Broken groups] in
// shm/shm_process_group.cpp says what becomes of the calls that fail later).
std::string unsupported(const compat::BackendPtr& pg, c10d::OpType type, const at::Tensor& t, const c10d::ReduceOp& op);

// Note [Inline blocking collectives]: all-reduces `t` in place on this thread and returns true when
// `pg` can without a c10d Work (the shared-memory group on one host, nothing queued, a tensor and op
// it reduces); returns false, having done nothing, otherwise. Throws the backend's failure.
bool all_reduce_here(const compat::BackendPtr& pg, at::Tensor& t, const c10d::ReduceOp& op);

// The same for `ts` as one flat tensor (float32 or float64, one dtype, plain CPU tensors), SUM of
// every rank's values divided by its `divisor` first: DDP's average, read from and written to the
// gradients themselves instead of a bucket. A peer may all-reduce (SUM) a flat copy of its values,
// already divided, in the same call: the bits are the same.
bool all_reduce_divided_here(const compat::BackendPtr& pg, std::vector<at::Tensor>& ts, int64_t divisor);

// Whether `pg` runs c10d's _allgather_base (type _ALLGATHER_BASE) or _reduce_scatter_base
// (_REDUCE_SCATTER_BASE, with `op`) on tensors like `t` itself: NCCL, the shared-memory group on one
// host, Gloo where it has them (compat/c10d_compat.h); false: the front end composes the collective
// from all_gather or all_reduce. Every rank of a correct program answers alike.
bool takes_base_collective(const compat::BackendPtr& pg, c10d::OpType type, const at::Tensor& t,
                           const c10d::ReduceOp& op);

// Validates a backend name early (before any rendezvous), with the remedy in the message.
void check_backend_name(const std::string& name);

}  // namespace dtrain::comm
