// make_shm_process_group: the rendezvous of the shared-memory segments (steps in shm_process_group.h).
#include <sys/stat.h>
#include <unistd.h>

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include <fstream>
#include <algorithm>
#include <map>
#include <utility>

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

namespace {

// Step 1's result: each rank's host key, and the ranks of each host in the order hosts first appear.
struct Hosts {
  std::vector<std::string> keys;                  // by group rank
  std::map<std::string, std::vector<int>> ranks;  // by host key, ascending
  std::vector<std::string> order;                 // host keys by lowest rank
  bool shared() const {
    for (const auto& [key, on_host] : ranks)
      if (on_host.size() > 1) return true;
    return false;
  }
};

// 1. Every rank publishes its host key and reads everyone's.
Hosts exchange_host_keys(c10d::Store& store, int rank, int size) {
  store.set("shm/host/" + std::to_string(rank), bytes(host_key()));
  Hosts h;
  h.keys.resize(size);
  for (int r = 0; r < size; ++r) h.keys[r] = text(store.get("shm/host/" + std::to_string(r)));
  for (int r = 0; r < size; ++r) {
    if (h.ranks[h.keys[r]].empty()) h.order.push_back(h.keys[r]);
    h.ranks[h.keys[r]].push_back(r);
  }
  return h;
}

// This rank's place among the hosts: its host's index and ranks, and whether it leads the host.
ShmTopology topology_of(const Hosts& h, int rank, const std::vector<int>& labels) {
  const std::string& mine = h.keys[rank];
  ShmTopology topo;
  topo.hosts = static_cast<int>(h.order.size());
  topo.host_index = static_cast<int>(std::find(h.order.begin(), h.order.end(), mine) - h.order.begin());
  topo.host_ranks = h.ranks.at(mine);
  topo.leader = topo.host_ranks.front() == rank;
  topo.leader_local = 0;
  for (const auto& key : h.order) topo.leader_labels.push_back(labels[h.ranks.at(key).front()]);
  return topo;
}

// 3. The host's lowest rank creates the segment and publishes its name (or its error, marked '!');
// the others attach. Returns the error text, empty on success.
std::string open_segment(c10d::Store& store, const ShmTopology& topo, int local_rank, size_t slot_bytes,
                         shm::Segment& seg) {
  const int on_host = static_cast<int>(topo.host_ranks.size());
  if (on_host < 2) return "";
  const std::string seg_key = "shm/seg/" + std::to_string(topo.host_index);
  try {
    if (topo.leader) {
      try {
        seg =
            shm::Segment::create(shm::Segment::unique_name("h" + std::to_string(topo.host_index)), on_host, slot_bytes);
        store.set(seg_key, bytes(seg.name()));
      } catch (const std::exception& e) {
        store.set(seg_key, bytes("!" + std::string(e.what())));
        throw;
      }
    } else {
      std::string name = text(store.get(seg_key));
      DTRAIN_CHECK(name.empty() || name[0] != '!', name.substr(1));
      seg = shm::Segment::attach(name, on_host, slot_bytes);
    }
    seg.prefault(local_rank);
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

// Every rank reports how step 3 went and reads every report: the reads are also the barrier after
// which the segment may be unlinked. Returns the lowest failed rank and its error (-1: none failed).
std::pair<int, std::string> first_failure(c10d::Store& store, int rank, int size, const std::string& error) {
  store.set("shm/status/" + std::to_string(rank), bytes(error.empty() ? "ok" : error));
  std::pair<int, std::string> first{-1, ""};
  for (int r = 0; r < size; ++r) {
    std::string s = text(store.get("shm/status/" + std::to_string(r)));
    if (s != "ok" && first.first < 0) first = {r, s};
  }
  return first;
}

}  // namespace

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

  const Hosts hosts = exchange_host_keys(store, c.rank, c.size);
  // 2. Nobody shares a host.
  if (!hosts.shared()) {
    DTRAIN_CHECK(mode != ShmMode::kRequired, "rank ", c.rank, ": DTRAIN_SHM=1 but no two of the group's ", c.size,
                 " ranks share a host: unset DTRAIN_SHM (or set it to 0) for this job");
    return gloo_only();
  }
  ShmTopology topo = topology_of(hosts, c.rank, labels);
  const std::vector<int>& mine = topo.host_ranks;
  const int local_rank = static_cast<int>(std::find(mine.begin(), mine.end(), c.rank) - mine.begin());

  shm::Segment seg;
  const std::string error = open_segment(store, topo, local_rank, slot_bytes_from_env(), seg);
  const auto [failed_rank, first_error] = first_failure(store, c.rank, c.size, error);
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
