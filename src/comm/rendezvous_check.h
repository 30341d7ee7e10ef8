// The agreement every rank reaches through the store before any backend is built, so that a
// misconfigured job fails at once with one clear line on every rank instead of hanging:
//
//   1. Each rank claims its rank with add("claim/<r>"): a second claimant is told it is a duplicate.
//   2. Each rank publishes "rank/<r>" = "<world_size>\n<host key>".
//   3. Rank 0 reads ranks 1..n-1 in order (each within the timeout), checks that their world size
//      equals its own, and derives local ranks from the host keys (host name + the address that
//      reaches the master, so network namespaces count as hosts).
//   4. Rank 0 publishes "verdict" = "ok\n<world_size>\n<host key per rank>" or "error\n<message>",
//      and waits until every rank that joined has counted itself in "verdict_read".
//   5. Every rank reads the verdict; an error or a different world size throws dtrain::Error, and
//      so does a store that closes meanwhile (its host exited), which is not reported as a timeout.
#pragma once

#include <chrono>
#include <string>

namespace c10d {
class Store;
}

namespace dtrain::comm {

struct LocalRanks {
  int local_rank = 0;
  int local_world_size = 1;
};

// env_local_rank / env_local_world >= 0 come from the launcher and win over derived values.
LocalRanks rendezvous_check(c10d::Store& store, int rank, int world_size, const std::string& address,
                            int env_local_rank, int env_local_world, std::chrono::milliseconds timeout);

}  // namespace dtrain::comm
