// Every LibTorch-version-specific c10d call lives here. LibTorch 1.13: ProcessGroupGloo/NCCL derive from
// c10d::ProcessGroup. LibTorch >= 2.0: they derive from c10d::Backend, which has the same collective methods.
#pragma once

#include <torch/csrc/api/include/torch/version.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Types.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>
#if TORCH_VERSION_MAJOR >= 2
#include <torch/csrc/distributed/c10d/Backend.hpp>
#endif

namespace dtrain::compat {

#if TORCH_VERSION_MAJOR >= 2
using Backend = c10d::Backend;
#else
using Backend = c10d::ProcessGroup;
#endif

// c10d::Store::clone() (a store for another thread) is pure virtual in recent 2.x releases; a store
// dtrain implements provides it there.
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 6)
#define DTRAIN_C10D_STORE_CLONE 1
#else
#define DTRAIN_C10D_STORE_CLONE 0
#endif

// Joining Python ranks' default group (comm/pytorch_peers.h) needs PyTorch 2.x's store protocol and
// ProcessGroupGloo::Options::create_default.
#define DTRAIN_PYTORCH_PEERS_SUPPORTED (TORCH_VERSION_MAJOR >= 2)

// ProcessGroupGloo's _allgather_base and _reduce_scatter_base (all_gather_single and
// reduce_scatter_single underneath): 1.13 throws "no support"; checked in 2.15's headers, so earlier
// 2.x releases are treated as 1.13 and the front end composes both from all_gather and all_reduce
// (Note [Tensor collectives on Gloo] in comm/collectives.cpp).
// Off for now: 2.15's native all-gather refused the stacked output shape ((N, ...) for inputs of
// (...)) that the front end accepts ("invalid tensor size at index 0"); every version composes.
#define DTRAIN_GLOO_HAS_TENSOR_COLLECTIVES 0

// The object collectives are called on.
using BackendPtr = c10::intrusive_ptr<Backend>;

// Runs fn when `work` completes, on the thread that completes it (immediately when it already has).
// False when the work has no completion future (c10d's base Work::getFuture throws): the caller then
// runs fn itself after waiting.
inline bool add_completion_callback(const c10::intrusive_ptr<c10d::Work>& work, std::function<void()> fn) {
  c10::intrusive_ptr<c10::ivalue::Future> fut;
  try {
    fut = work->getFuture();
  } catch (const std::exception&) {
    return false;
  }
  if (!fut) return false;
  fut->addCallback([fn = std::move(fn)](c10::ivalue::Future&) { fn(); });
  return true;
}

}  // namespace dtrain::compat
