// Note [PyTorch peers]: a job whose ranks are partly Python programs (torch.distributed, gloo,
// env://, the same PyTorch 2.x whose LibTorch dtrain was built against) and partly dtrain programs.
// Python's init_process_group knows nothing of dtrain's store, its rendezvous checks or its shared
// memory, so in this mode a dtrain rank joins exactly as a Python rank does:
//   1. The store is c10d's TCPStore at MASTER_ADDR:MASTER_PORT: rank 0 hosts it (multi-tenant, libuv,
//      waiting for WORLD_SIZE clients, each of which adds 1 to its "init/" key), or torchrun's
//      agent hosts it (TORCHELASTIC_USE_AGENT_STORE) and every rank is a client.
//   2. The default group's Gloo process group uses the store under Python's prefixes
//      "default_pg" / "0/" / "cpu/" (the first group of the process, on its CPU device) and Gloo's
//      default options (one device: GLOO_SOCKET_IFNAME or the host's address; TORCH_GLOO_LAZY_INIT),
//      which Python reads from the same environment.
//   3. Nothing else touches the store: no dtrain rendezvous check, no shared memory, no
//      DTRAIN_DEBUG=DETAIL (it compares calls through store keys Python ranks never write).
// Collectives, barrier and send/recv then pair with Python's call for call. Subgroups too: Python's
// new_group names its groups from a counter every rank advances once per call, members or not ("1",
// "2", ... after the default group's "0"), and hands Gloo the store under "default_pg" / "0/" /
// "<name>/" / "cpu/"; dtrain's new_group counts and prefixes the same, so the same calls in the same
// order on both sides make the same groups (Python's ranks sorted, as its new_group sorts them).
// LibTorch 2.x builds only.
#pragma once

#include <chrono>
#include <string>

#include "comm/launch_env.h"
#include "compat/c10d_compat.h"

namespace dtrain::comm {

// Whether this process joins a group with Python ranks: InitOptions().pytorch_peers(true), or
// DTRAIN_PYTORCH_PEERS=1. Throws for a value other than 0/1.
bool pytorch_peers_requested(bool option);

// Step 1. `agent_store`: torchrun's agent hosts the store, every rank is a client.
c10::intrusive_ptr<c10d::Store> connect_pytorch_store(const Endpoint& master, int rank, int world_size,
                                                      std::chrono::milliseconds timeout, bool agent_store);

// Step 2: the store Python's group `python_name` ("0": the default group; "1", "2", ...: new_group's)
// hands to its Gloo process group.
c10::intrusive_ptr<c10d::Store> pytorch_group_store(const c10::intrusive_ptr<c10d::Store>& base,
                                                    const std::string& python_name);

}  // namespace dtrain::comm
