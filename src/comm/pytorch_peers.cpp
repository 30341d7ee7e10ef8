// Joining a process group with Python ranks (Note [PyTorch peers] in pytorch_peers.h).
#include "comm/pytorch_peers.h"

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "dtrain/errors.h"

namespace dtrain::comm {

bool pytorch_peers_requested(bool option) {
  // Read even when the option is set, so that a bad value is reported either way.
  const bool from_env = env::flag("DTRAIN_PYTORCH_PEERS");
  return option || from_env;
}

#if DTRAIN_PYTORCH_PEERS_SUPPORTED

c10::intrusive_ptr<c10d::Store> connect_pytorch_store(const Endpoint& master, int rank, int world_size,
                                                      std::chrono::milliseconds timeout, bool agent_store) {
  // The options of Python's _create_c10d_store for env://.
  c10d::TCPStoreOptions o;
  o.port = master.port;
  o.isServer = rank == 0 && !agent_store;
  o.numWorkers = world_size;
  o.waitWorkers = true;
  o.timeout = timeout;
  o.multiTenant = true;
  o.useLibUV = true;
  return c10::make_intrusive<c10d::TCPStore>(master.host, o);
}

c10::intrusive_ptr<c10d::Store> pytorch_group_store(const c10::intrusive_ptr<c10d::Store>& base,
                                                    const std::string& python_name) {
  // init_process_group prefixes "default_pg"; each group prefixes its name onto the store it was
  // given, and a new group is given the default group's prefixed store; then the device's prefix.
  c10::intrusive_ptr<c10d::Store> s = c10::make_intrusive<c10d::PrefixStore>("default_pg", base);
  s = c10::make_intrusive<c10d::PrefixStore>("0/", s);
  if (python_name != "0") s = c10::make_intrusive<c10d::PrefixStore>(python_name + "/", s);
  return c10::make_intrusive<c10d::PrefixStore>("cpu/", s);
}

#else

[[noreturn]] static void unsupported() {
  throw Error(
      "DTRAIN_PYTORCH_PEERS needs dtrain built against LibTorch 2.x, the LibTorch of the Python ranks' "
      "PyTorch (this one is 1.x, whose store protocol and Gloo differ): build dtrain against that PyTorch's "
      "LibTorch (README: 'Using dtrain with your LibTorch')");
}
c10::intrusive_ptr<c10d::Store> connect_pytorch_store(const Endpoint&, int, int, std::chrono::milliseconds, bool) {
  unsupported();
}
c10::intrusive_ptr<c10d::Store> pytorch_group_store(const c10::intrusive_ptr<c10d::Store>&, const std::string&) {
  unsupported();
}

#endif

}  // namespace dtrain::comm
