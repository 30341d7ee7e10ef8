// make_shm_process_group: the rendezvous of the shared-memory segments (steps in shm_process_group.h).
#include <sys/stat.h>
#include <unistd.h>

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include <fstream>
#include <map>

#include "comm/shm/shm_pg_impl.h"
#include "comm/shm/shm_process_group.h"
#include "comm/gloo_backend.h"
#include "common/env.h"
#include "common/util.h"
#include "dtrain/errors.h"

namespace dtrain::comm {
namespace {

std::vector<uint8_t> bytes(const std::string& s) { return {s.begin(), s.end()}; }
std::string text(const std::vector<uint8_t>& b) { return {b.begin(), b.end()}; }

// Ranks with equal keys can map the same /dev/shm: same kernel (boot id), same host name, same
// /dev/shm mount. DTRAIN_SHM_HOST overrides it (e.g. to treat the processes of one machine as
// separate hosts and exercise the hierarchical path).
std::string host_key() {
  if (auto h = env::text("DTRAIN_SHM_HOST")) return "env:" + *h;
  std::string boot;
  std::ifstream("/proc/sys/kernel/random/boot_id") >> boot;
  struct stat st {};
  stat("/dev/shm", &st);
  return detail::cat(util::host_name(), "/", boot, "/", st.st_dev, ":", st.st_ino);
}

size_t slot_bytes_from_env() { return static_cast<size_t>(*env::integer("DTRAIN_SHM_SLOT_BYTES")); }

}  // namespace

ShmMode shm_mode_from_env() {
  const std::string v = env::choice("DTRAIN_SHM");
  if (v == "0") return ShmMode::kOff;
  if (v == "1") return ShmMode::kRequired;
  return ShmMode::kAuto;
}

compat::BackendPtr make_shm_process_group(const BackendConfig& c, compat::BackendPtr gloo, ShmMode mode) {
  if (c.size == 1) return gloo;              // nothing to exchange, nothing to mismatch
  std::vector<int> labels = c.global_ranks;  // global ranks, for error messages
  if (labels.empty())
    for (int r = 0; r < c.size; ++r) labels.push_back(r);
  // Without shared memory the group still wraps Gloo: its collectives are checked before they start
  // (Note [Guarded Gloo collectives] in shm_gloo_guard.cpp).
  auto gloo_only = [&] {
    return c10::make_intrusive<ShmProcessGroup>(
        c.rank, c.size, ShmGroupParts{gloo, nullptr, compat::BackendPtr(), ShmTopology{}, labels, c.store});
  };
  if (mode == ShmMode::kOff) return gloo_only();
  auto& store = *c.store;
  const size_t slot_bytes = slot_bytes_from_env();

  // 1. Host keys.
  store.set("shm/host/" + std::to_string(c.rank), bytes(host_key()));
  std::vector<std::string> keys(c.size);
  for (int r = 0; r < c.size; ++r) keys[r] = text(store.get("shm/host/" + std::to_string(r)));
  std::map<std::string, std::vector<int>> by_host;
  std::vector<std::string> host_order;
  for (int r = 0; r < c.size; ++r) {
    if (by_host[keys[r]].empty()) host_order.push_back(keys[r]);
    by_host[keys[r]].push_back(r);
  }
  bool shared = false;
  for (const auto& [k, ranks] : by_host) shared = shared || ranks.size() > 1;
  // 2. Nobody shares a host.
  if (!shared) {
    DTRAIN_CHECK(mode != ShmMode::kRequired, "rank ", c.rank, ": DTRAIN_SHM=1 but no two of the group's ", c.size,
                 " ranks share a host: unset DTRAIN_SHM (or set it to 0) for this job");
    return gloo_only();
  }
  const std::vector<int>& mine = by_host[keys[c.rank]];
  ShmTopology topo;
  topo.hosts = static_cast<int>(host_order.size());
  topo.host_index =
      static_cast<int>(std::find(host_order.begin(), host_order.end(), keys[c.rank]) - host_order.begin());
  topo.leader = mine.front() == c.rank;
  topo.leader_local = 0;
  topo.host_ranks = mine;
  for (const auto& key : host_order) topo.leader_labels.push_back(labels[by_host[key].front()]);
  const int local_rank = static_cast<int>(std::find(mine.begin(), mine.end(), c.rank) - mine.begin());

  // 3. Segments: the host's lowest rank creates, the others attach; everyone reports.
  shm::Segment seg;
  std::string error;
  const std::string seg_key = "shm/seg/" + std::to_string(topo.host_index);
  if (mine.size() > 1) {
    try {
      if (topo.leader) {
        try {
          seg = shm::Segment::create(shm::Segment::unique_name("h" + std::to_string(topo.host_index)),
                                     static_cast<int>(mine.size()), slot_bytes);
          store.set(seg_key, bytes(seg.name()));
        } catch (const std::exception& e) {
          store.set(seg_key, bytes("!" + std::string(e.what())));
          throw;
        }
      } else {
        std::string name = text(store.get(seg_key));
        DTRAIN_CHECK(name.empty() || name[0] != '!', name.substr(1));
        seg = shm::Segment::attach(name, static_cast<int>(mine.size()), slot_bytes);
      }
      seg.prefault(local_rank);
    } catch (const std::exception& e) {
      error = e.what();
    }
  }
  store.set("shm/status/" + std::to_string(c.rank), bytes(error.empty() ? "ok" : error));
  std::string first_error;
  int failed_rank = -1;
  for (int r = 0; r < c.size; ++r) {
    std::string s = text(store.get("shm/status/" + std::to_string(r)));
    if (s != "ok" && failed_rank < 0) {
      failed_rank = r;
      first_error = s;
    }
  }
  seg.unlink();  // every rank of the host has attached (or failed): Note [Segment lifetime]
  // 4. Agreement.
  if (failed_rank >= 0) {
    std::string msg =
        detail::cat("shared-memory collectives are unavailable (group rank ", failed_rank, ": ", first_error, ")");
    DTRAIN_CHECK(mode != ShmMode::kRequired, "rank ", c.rank, ": DTRAIN_SHM=1 but ", msg);
    warn_once("shm-unavailable", msg + "; using Gloo over TCP");
    return gloo_only();
  }
  std::unique_ptr<shm::Comm> local;
  if (mine.size() > 1) {
    std::vector<int> local_labels;
    for (int r : mine) local_labels.push_back(labels[r]);
    local = std::make_unique<shm::Comm>(std::move(seg), local_rank, local_labels, c.timeout);
  }
  compat::BackendPtr leaders;
  if (topo.hosts > 1 && topo.leader) {
    BackendConfig lc = c;
    lc.store = c10::make_intrusive<c10d::PrefixStore>("shm/leaders", c.store);
    lc.rank = topo.host_index;
    lc.size = topo.hosts;
    leaders = make_gloo_backend(lc);
  }
  return c10::make_intrusive<ShmProcessGroup>(
      c.rank, c.size,
      ShmGroupParts{std::move(gloo), std::move(local), std::move(leaders), std::move(topo), labels, c.store});
}

}  // namespace dtrain::comm
