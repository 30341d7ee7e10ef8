#include "comm/backend.h"

#include <sstream>

#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#ifdef DTRAIN_WITH_NCCL
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

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

compat::BackendPtr make_gloo_backend(const BackendConfig& c) {
  auto opts = c10d::ProcessGroupGloo::Options::create(c.timeout);
  if (const char* ifname = std::getenv("GLOO_SOCKET_IFNAME"); ifname && *ifname) {
    std::stringstream ss(ifname);
    for (std::string iface; std::getline(ss, iface, ',');)
      if (!iface.empty()) opts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForInterface(iface));
  } else {
    opts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname(c.bind_address));
  }
  opts->threads = 2;
  return c10::make_intrusive<c10d::ProcessGroupGloo>(c.store, c.rank, c.size, opts);
}

#ifdef DTRAIN_WITH_NCCL
static compat::BackendPtr make_nccl(const BackendConfig& c) {
  auto opts = c10d::ProcessGroupNCCL::Options::create();
  opts->timeout = c.timeout;
  return c10::make_intrusive<c10d::ProcessGroupNCCL>(c.store, c.rank, c.size, opts);
}
#endif

compat::BackendPtr make_backend(const BackendConfig& config) {
  check_backend_name(config.name);
#ifdef DTRAIN_WITH_NCCL
  if (config.name == "nccl") return make_nccl(config);
#endif
  const ShmMode mode = shm_mode_from_env();
  return make_shm_process_group(config, make_gloo_backend(config), mode);
}

}  // namespace dtrain::comm
