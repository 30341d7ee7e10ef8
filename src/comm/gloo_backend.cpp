// The one translation unit that includes LibTorch's ProcessGroupGloo.hpp. It compiles against the
// opaque gloo headers in src/compat/gloo_opaque (see the README there): LibTorch downloads ship no gloo
// headers, and a system's gloo may differ from the one inside LibTorch, so nothing compiled here may
// depend on gloo's definitions. The process group is created by LibTorch's own (out-of-line)
// constructor; this file only fills the Options and allocates the object.
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

#include "comm/gloo_backend.h"
#include "common/env.h"
#include "dtrain/errors.h"

namespace dtrain::comm {

// gloo::Context and gloo::rendezvous::Store are opaque classes of at least kPoisonBytes; a c10d
// object that held one by value would be at least that large. These two sizes are what this file
// allocates, so they must come from c10d's own members alone (ctest gloo_opaque_check covers the
// code side: no gloo symbol is defined or referenced here).
static_assert(sizeof(c10d::ProcessGroupGloo) < gloo::opaque::kPoisonBytes,
              "ProcessGroupGloo holds a gloo object by value: its size depends on gloo's headers");
static_assert(sizeof(c10d::ProcessGroupGloo::Options) < gloo::opaque::kPoisonBytes,
              "ProcessGroupGloo::Options holds a gloo object by value");

compat::BackendPtr make_gloo_backend(const BackendConfig& c) {
  auto opts = c10d::ProcessGroupGloo::Options::create(c.timeout);
  for (const std::string& iface : env::list("GLOO_SOCKET_IFNAME"))
    opts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForInterface(iface));
  if (opts->devices.empty()) opts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname(c.bind_address));
  opts->threads = 2;
  return c10::make_intrusive<c10d::ProcessGroupGloo>(c.store, c.rank, c.size, opts);
}

compat::BackendPtr make_pytorch_gloo_backend(const BackendConfig& c) {
#if DTRAIN_PYTORCH_PEERS_SUPPORTED
  // Python's ProcessGroupGloo binding: the default options (devices from GLOO_SOCKET_IFNAME or the
  // host's address, TORCH_GLOO_LAZY_INIT, two threads per device), then its group name. Every rank
  // must have the same number of devices: each is a context Gloo connects through the store.
  auto opts = c10d::ProcessGroupGloo::Options::create_default(c.timeout);
  opts->group_name = "0";
  return c10::make_intrusive<c10d::ProcessGroupGloo>(c.store, c.rank, c.size, opts);
#else
  (void)c;
  throw Error("joining Python ranks needs dtrain built against LibTorch 2.x");
#endif
}

}  // namespace dtrain::comm
