// --ft on several nodes: the launchers' heartbeats (see ft_nodes.h, Note [Replicas on several nodes]).
#include "ft_nodes.h"

#include <signal.h>

#include "store_keys.h"

namespace dtrain::run {

namespace {

const StoreKeys ftn_key("dtrain-run/");

}  // namespace

FtNodes::FtNodes(NodeRendezvous& rdzv, int node_rank, int nnodes, const std::string& host, uint16_t port,
                 const std::string& secret, Millis beat_period)
    : rdzv_(rdzv),
      node_rank_(node_rank),
      nnodes_(nnodes),
      beat_period_(beat_period),
      dead_after_(silent_host_after(beat_period)),
      reported_(static_cast<size_t>(nnodes), false) {
  if (node_rank_ == 0) return;
  // The thread must not take the launcher's signals (main.cpp reads them through a signalfd).
  sigset_t all, old;
  sigfillset(&all);
  pthread_sigmask(SIG_SETMASK, &all, &old);
  beat_thread_ = std::thread([this, host, port, secret] { beat_loop(host, port, secret); });
  pthread_sigmask(SIG_SETMASK, &old, nullptr);
}

FtNodes::~FtNodes() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (beat_thread_.joinable()) beat_thread_.join();
}

void FtNodes::beat_loop(std::string host, uint16_t port, std::string secret) {
  // A failure ends the heartbeat quietly: node 0 then counts this node gone, which is the truth when
  // its store cannot be reached. Nothing may escape a background thread.
  try {
    dtrain::store::StoreClient client(host, port, Millis(5000), secret);
    for (int64_t n = 1;; ++n) {
      client.set(ftn_key("ft_beat", node_rank_), to_bytes(std::to_string(n)));
      std::unique_lock<std::mutex> lock(mu_);
      if (cv_.wait_for(lock, beat_period_, [this] { return stop_; })) return;
    }
  } catch (...) {
  }
}

bool FtNodes::gone(int node_rank) {
  const std::string key = ftn_key("ft_beat", node_rank);
  auto& store = rdzv_.client();
  const std::string v = store.check({key}) ? to_string(store.get(key, Millis(1000))) : "";
  const auto now = Clock::now();
  auto it = seen_.find(node_rank);
  if (it == seen_.end() || it->second.value != v) {
    seen_[node_rank] = Seen{v, now};
    return false;
  }
  return now - it->second.changed > dead_after_;
}

std::string FtNodes::gone_line(int node_rank) {
  reported_[static_cast<size_t>(node_rank)] = true;
  return "node " + std::to_string(node_rank) + "'s launcher is gone (no heartbeat for " + seconds_text(dead_after_) +
         "): its replicas leave the quorum, the other nodes' replicas train on (--ft)";
}

std::vector<std::string> FtNodes::newly_gone() {
  std::vector<std::string> lines;
  for (int r = 1; r < nnodes_; ++r)
    if (!reported_[static_cast<size_t>(r)] && !rdzv_.node_done(r) && gone(r)) lines.push_back(gone_line(r));
  return lines;
}

void FtNodes::wait_done_or_gone(Millis timeout, const NodeRendezvous::Say& say) {
  const auto deadline = Clock::now() + timeout;
  try {
    for (int r = 1; r < nnodes_ && Clock::now() < deadline;) {
      if (reported_[static_cast<size_t>(r)] || rdzv_.node_done(r)) {
        ++r;
      } else if (gone(r)) {  // lost after this node's workers ended: said here, once
        say(gone_line(r));
        ++r;
      } else {
        std::this_thread::sleep_for(std::min(beat_period_, Millis(100)));
      }
    }
  } catch (const std::exception&) {
    // Node 0's own store failing here leaves nothing to wait for.
  }
}

}  // namespace dtrain::run
