// Every LibTorch-version-specific c10d call lives here (DESIGN.md: building against 2.x is a contained
// change). LibTorch 1.13: ProcessGroupGloo/NCCL derive from c10d::ProcessGroup. LibTorch >= 2.0: they
// derive from c10d::Backend, which has the same collective methods.
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

// The object collectives are called on.
using BackendPtr = c10::intrusive_ptr<Backend>;

}  // namespace dtrain::compat
