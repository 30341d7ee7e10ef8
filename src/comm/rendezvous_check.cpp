#include "comm/rendezvous_check.h"

#include <sstream>
#include <vector>

#include <torch/csrc/distributed/c10d/Store.hpp>

#include "comm/state.h"
#include "comm/store_count.h"
#include "common/util.h"
#include "dtrain/errors.h"
#include "store/store.h"

namespace dtrain::comm {
namespace {

using store::to_bytes;
using store::to_string;

std::string seconds(std::chrono::milliseconds t) {
  std::ostringstream os;
  os << t.count() / 1000.0 << " s";
  return os.str();
}

// Step 3 on rank 0. Returns the verdict text.
std::string judge(c10d::Store& store, int world_size, const std::string& my_host, std::chrono::milliseconds timeout) {
  std::vector<std::string> hosts{my_host};
  for (int r = 1; r < world_size; ++r) {
    const std::string key = "rank/" + std::to_string(r);
    try {
      store.wait({key}, timeout);
    } catch (const std::exception&) {
      std::ostringstream missing;
      int n = 0;
      for (int q = r; q < world_size; ++q)
        if (!store.check({"rank/" + std::to_string(q)})) missing << (n++ ? ", " : "") << q;
      return detail::cat("error\nrank(s) ", missing.str(), " did not join within ", seconds(timeout),
                         " (WORLD_SIZE=", world_size,
                         " on rank 0): start every rank, or check WORLD_SIZE and the master address");
    }
    auto lines = util::split(to_string(store.get(key)));
    DTRAIN_ASSERT(lines.size() == 2, "bad rendezvous record for rank ", r);
    if (lines[0] != std::to_string(world_size))
      return detail::cat("error\nranks disagree on the world size: rank 0 has WORLD_SIZE=", world_size, ", rank ", r,
                         " has WORLD_SIZE=", lines[0], ": give every rank the same WORLD_SIZE");
    hosts.push_back(lines[1]);
  }
  std::ostringstream verdict;
  verdict << "ok\n" << world_size;
  for (auto& h : hosts) verdict << "\n" << h;
  return verdict.str();
}

// Note [Verdict receipts]: rank 0 may host the store. Had it gone on at once after its verdict, a
// failure just after (its backend cannot start: no CUDA device, say) would close the store while the
// other ranks are still between wait("verdict") and get("verdict"), and they would report a missing
// verdict instead of the reason, which they meet themselves a moment later. So every other rank
// counts itself in "verdict_read", and rank 0 waits until every rank that joined has read the
// verdict: bounded by the rendezvous timeout after "ok" (all joined; a rank that died in between
// would fail the backend next anyway), 2 s after an error (the ranks that never joined never read).
void wait_until_read(c10d::Store& store, int world_size, bool ok, std::chrono::milliseconds timeout) {
  try {
    int64_t joined = 0;
    for (int r = 1; r < world_size; ++r) joined += store.check({"rank/" + std::to_string(r)}) ? 1 : 0;
    wait_for_count(store, "verdict_read", joined, ok ? timeout : std::chrono::milliseconds(2000), "rank 0: rendezvous",
                   "every rank that joined must read the verdict");
  } catch (const std::exception&) {
    // The store is gone, or a rank did not read the verdict in time: rank 0 goes on (after an error
    // verdict, to throw its own error) and meets that rank's absence in the backend, if it matters.
  }
}

// Step 5 on ranks 1..n-1. A store that answers "timed out" and a store that closed are different
// failures: the first means rank 0 is slow or elsewhere, the second that the process hosting the
// store (rank 0, or the launcher) has exited, and its own output says why.
std::string read_verdict(c10d::Store& store, int rank, std::chrono::milliseconds timeout) {
  const auto start = std::chrono::steady_clock::now();
  const auto limit = timeout + std::chrono::seconds(5);
  try {
    store.wait({"verdict"}, limit);
    return to_string(store.get("verdict"));
  } catch (const store::TimeoutError&) {
  } catch (const std::exception& e) {
    if (std::chrono::steady_clock::now() - start < limit)
      throw Error(detail::cat(
          "rank ", rank, ": the rendezvous store failed while this rank waited ",
          seconds(std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - start)),
          " for rank 0's verdict (", brief(e),
          "): the process hosting the store (rank 0, or the launcher) has exited: "
          "its own error says why"));
  }
  throw Error(detail::cat("rank ", rank, ": rank 0 gave no rendezvous verdict within ", seconds(limit),
                          ": is rank 0 running with the same MASTER_ADDR/PORT?"));
}

}  // namespace

LocalRanks rendezvous_check(c10d::Store& store, int rank, int world_size, const std::string& address,
                            int env_local_rank, int env_local_world, std::chrono::milliseconds timeout) {
  // Step 1.
  if (store.add("claim/" + std::to_string(rank), 1) > 1)
    throw Error(detail::cat("rank ", rank, ": another process already joined as rank ", rank,
                            ": give each process a distinct RANK"));
  // Step 2.
  const std::string host_key = util::host_name() + "/" + address;
  store.set("rank/" + std::to_string(rank), to_bytes(std::to_string(world_size) + "\n" + host_key));
  // Steps 3-4.
  std::string verdict;
  if (rank == 0) {
    verdict = judge(store, world_size, host_key, timeout);
    store.set("verdict", to_bytes(verdict));
    wait_until_read(store, world_size, verdict.rfind("ok", 0) == 0, timeout);
  } else {
    // Step 5.
    verdict = read_verdict(store, rank, timeout);
    try {
      store.add("verdict_read", 1);  // Note [Verdict receipts]
    } catch (const std::exception&) {
      // The store closed after the verdict: this rank goes on with it and meets the reason next.
    }
  }
  auto lines = util::split(verdict);
  if (!lines.empty() && lines[0] == "error")
    throw Error(detail::cat("rank ", rank, ": rendezvous failed: ", lines.size() > 1 ? lines[1] : "(no reason)"));
  DTRAIN_ASSERT(lines.size() >= 2 && lines[0] == "ok", "bad rendezvous verdict");
  if (lines[1] != std::to_string(world_size))
    throw Error(detail::cat("rank ", rank, ": ranks disagree on the world size: rank 0 has WORLD_SIZE=", lines[1],
                            ", rank ", rank, " has WORLD_SIZE=", world_size, ": give every rank the same WORLD_SIZE"));
  LocalRanks out;
  if (env_local_rank >= 0 && env_local_world > 0) {
    out.local_rank = env_local_rank;
    out.local_world_size = env_local_world;
    return out;
  }
  DTRAIN_ASSERT(static_cast<int>(lines.size()) == world_size + 2, "bad rendezvous verdict size");
  out.local_rank = 0;
  out.local_world_size = 0;
  for (int r = 0; r < world_size; ++r) {
    if (lines[r + 2] != host_key) continue;
    if (r < rank) ++out.local_rank;
    ++out.local_world_size;
  }
  if (env_local_rank >= 0) out.local_rank = env_local_rank;
  return out;
}

}  // namespace dtrain::comm
