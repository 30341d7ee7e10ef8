#include "comm/replica_group.h"

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include "comm/backend.h"
#include "comm/store_adapter.h"
#include "dtrain/errors.h"

namespace dtrain::comm {

compat::BackendPtr make_replica_group(const ReplicaGroupConfig& c) {
  try {
    // Its own connection: Gloo's rendezvous waits on the store while the caller's own client may be
    // busy with heartbeats.
    auto client = c10::make_intrusive<ClientStore>(c.host, c.port, c.timeout, c.secret);
    BackendConfig config;
    config.name = "gloo";
    config.store = c10::make_intrusive<c10d::PrefixStore>(c.prefix, client);
    config.rank = c.rank;
    config.size = c.size;
    config.timeout = c.timeout;
    config.bind_address = client->local_address();
    config.shared_memory = false;
    return make_backend(config).pg;
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    throw Error(detail::cat("replica group '", c.prefix, "' (rank ", c.rank, " of ", c.size,
                            ") could not be built: ", e.what()));
  }
}

}  // namespace dtrain::comm
