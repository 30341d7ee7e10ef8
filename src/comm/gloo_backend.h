// Plain ProcessGroupGloo groups (gloo_backend.cpp, the one file that includes ProcessGroupGloo.hpp).
#pragma once

#include "comm/backend_config.h"

namespace dtrain::comm {

// A ProcessGroupGloo bound to config.bind_address (GLOO_SOCKET_IFNAME overrides), no shared memory.
compat::BackendPtr make_gloo_backend(const BackendConfig& config);
// The ProcessGroupGloo Python's init_process_group("gloo") creates (Note [PyTorch peers]).
compat::BackendPtr make_pytorch_gloo_backend(const BackendConfig& config);

}  // namespace dtrain::comm
