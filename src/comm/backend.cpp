#include "comm/backend.h"

#ifdef DTRAIN_WITH_NCCL
#include <ATen/detail/CUDAHooksInterface.h>
#include <torch/csrc/distributed/c10d/NCCLUtils.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

#include "comm/gloo_backend.h"
#include "comm/shm/shm_process_group.h"
#include "dtrain/errors.h"

namespace dtrain::comm {

void check_backend_name(const std::string& name) {
  DTRAIN_CHECK(name == "gloo" || name == "nccl", "unknown backend '", name,
               "': use 'gloo' (CPU tensors) or 'nccl' (CUDA tensors, CUDA builds)");
#ifndef DTRAIN_WITH_NCCL
  DTRAIN_CHECK(name != "nccl",
               "backend 'nccl' needs a CUDA build of LibTorch with NCCL, but dtrain was built against "
               "a CPU-only LibTorch: use backend 'gloo', or rebuild dtrain against CUDA LibTorch");
#endif
  if (name == "gloo") shm_mode_from_env();  // a bad DTRAIN_SHM fails here, before any rendezvous
}

#ifdef DTRAIN_WITH_NCCL
static compat::BackendPtr make_nccl(const BackendConfig& c) {
  DTRAIN_CHECK(at::detail::getCUDAHooks().getNumGPUs() > 0, "rank ", c.rank,
               ": backend 'nccl' needs a CUDA device, and this machine has none visible: use backend 'gloo' "
               "for CPU tensors, or run on a machine with GPUs (check CUDA_VISIBLE_DEVICES)");
  // ProcessGroupNCCL::Options holds an ncclConfig_t by value, whose layout changes between NCCL
  // releases: this file must have been compiled with the nccl.h of the NCCL that LibTorch loads
  // (src/CMakeLists.txt prefers the one beside PyPI's torch). Allocating Options of the wrong size
  // would corrupt the heap, so a mismatch is refused.
  const std::string loaded = c10d::getNcclVersion();  // "2.30.7"
  const std::string compiled = std::to_string(NCCL_MAJOR) + "." + std::to_string(NCCL_MINOR) + ".";
  DTRAIN_CHECK(loaded.rfind(compiled, 0) == 0, "rank ", c.rank, ": dtrain was compiled with nccl.h ", NCCL_MAJOR, ".",
               NCCL_MINOR, " but LibTorch loads NCCL ", loaded,
               ": rebuild dtrain with the nccl.h of that NCCL first in the include path");
  auto opts = c10d::ProcessGroupNCCL::Options::create();
  opts->timeout = c.timeout;
  return c10::make_intrusive<c10d::ProcessGroupNCCL>(c.store, c.rank, c.size, opts);
}
#endif

#ifdef DTRAIN_WITH_NCCL
namespace {

class NcclCapabilities final : public Capabilities {
 public:
  std::string unsupported(c10d::OpType, const at::Tensor& t, const c10d::ReduceOp&) const override {
    return t.is_cuda() ? ""
                       : detail::cat("NCCL takes CUDA tensors, not ", t.device(),
                                     ": move the tensor to collective_device(group), or use a gloo group");
  }
  bool takes_base_collective(c10d::OpType, const at::Tensor&, const c10d::ReduceOp&) const override { return true; }
};

}  // namespace
#endif

// The shared-memory group answers for itself; Gloo alone (one rank per host without a segment
// group, a one-rank group, Python peers) through Gloo's table.
static Backend gloo_family(compat::BackendPtr pg) {
  auto* own = dynamic_cast<Capabilities*>(pg.get());
  return {pg, own ? own : &gloo_capabilities()};
}

Backend make_backend(const BackendConfig& config) {
  check_backend_name(config.name);
#ifdef DTRAIN_WITH_NCCL
  static NcclCapabilities nccl_capabilities;
  if (config.name == "nccl") return {make_nccl(config), &nccl_capabilities};
#endif
  if (config.pytorch_peers) return gloo_family(make_pytorch_gloo_backend(config));
  if (!config.shared_memory) return gloo_family(make_gloo_backend(config));
  const ShmMode mode = shm_mode_from_env();
  return gloo_family(make_shm_process_group(config, make_gloo_backend(config), mode));
}

}  // namespace dtrain::comm
