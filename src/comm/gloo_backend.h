// Plain ProcessGroupGloo groups (gloo_backend.cpp, the one file that includes ProcessGroupGloo.hpp).
#pragma once

#include <string>

#include <ATen/core/Tensor.h>

#include "comm/backend_config.h"
#include "comm/capabilities.h"

namespace dtrain::comm {

// A ProcessGroupGloo bound to config.bind_address (GLOO_SOCKET_IFNAME overrides), no shared memory.
compat::BackendPtr make_gloo_backend(const BackendConfig& config);
// The ProcessGroupGloo Python's init_process_group("gloo") creates (Note [PyTorch peers]).
compat::BackendPtr make_pytorch_gloo_backend(const BackendConfig& config);

// "" when LibTorch's Gloo can run a collective on tensors like `t`; otherwise what it cannot take
// and the remedy, e.g. "Gloo in LibTorch 1.13.0 has no BFloat16 collectives: convert the tensor, e.g.
// to float32". The same for every collective kind (Note [Gloo's dtypes] in gloo_backend.cpp).
std::string gloo_unsupported(const at::Tensor& t);

// What Gloo alone answers (Note [One backend interface]): its dtypes, the tensor collectives of this
// LibTorch's Gloo, and small sums as exchanges. Stateless: one for every Gloo group.
Capabilities& gloo_capabilities();

}  // namespace dtrain::comm
