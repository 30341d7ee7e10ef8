// Elastic membership (see rendezvous.h, steps E1-E8, and Note [Elastic membership] in elastic.h).
#include "elastic.h"

#include "store_keys.h"

#include <pthread.h>
#include <signal.h>

#include <algorithm>
#include <cstdio>
#include <sstream>

namespace dtrain::run {

namespace {

const StoreKeys key("dtrain-run/e/");
// How often a waiting node looks for node 0's word besides its admission (that the job is full).
constexpr Millis kAdmitPoll{250};

std::string flags_text(int nproc, int max_restarts, int lo, int hi) {
  return "--nnodes " + std::to_string(lo) + ":" + std::to_string(hi) + " --nproc_per_node " + std::to_string(nproc) +
         " --max_restarts " + std::to_string(max_restarts);
}

void sleep_for(Millis ms) { std::this_thread::sleep_for(ms); }

// "round/<attempt>": the transition line, then one "id hostname" row per node in group-rank order.
// group_rank stays -1 when `id` is not a member.
ElasticRound parse_round(const std::string& value, int attempt, int64_t id) {
  const std::string k = key("round", attempt);
  std::istringstream in(value);
  ElasticRound r;
  r.attempt = attempt;
  r.group_rank = -1;
  std::getline(in, r.line);
  std::string row;
  for (int g = 0; std::getline(in, row); ++g) {
    if (int_value(k, row.substr(0, row.find(' '))) == id) r.group_rank = g;
    r.nnodes = g + 1;
  }
  return r;
}

}  // namespace

ElasticRendezvous::ElasticRendezvous(NodeRendezvous& base, const std::string& master_host, uint16_t port,
                                     const ElasticOptions& o)
    : base_(base),
      store_(base.client()),
      o_(o),
      dead_after_(silent_host_after(o.beat_period)),
      host_(master_host),
      port_(port) {
  // E1.
  base_.answered("joining the rendezvous", [&] {
    id_ = store_.add(key("ids"), 1);
    store_.set(key("beat", id_), to_bytes("0"));
    if (o_.host) store_.set(key("master"), to_bytes(std::to_string(o_.master_port) + " " + o_.master_addr));
  });
  // The thread must not take the launcher's signals (main.cpp reads them through a signalfd): it
  // starts with all of them blocked.
  sigset_t all, old;
  sigfillset(&all);
  pthread_sigmask(SIG_SETMASK, &all, &old);
  beat_thread_ = std::thread([this, master_host, port] { heartbeat_loop(master_host, port); });
  pthread_sigmask(SIG_SETMASK, &old, nullptr);
}

void ElasticRendezvous::finish_job(bool failed) {
  try {
    if (!o_.host) {
      dtrain::store::ScopedTimeout closing(store_, std::min(o_.close_timeout, store_.timeout()));
      if (!silent()) store_.set(key("done", id_), to_bytes("1"));  // a silent store would hold it
      return;
    }
    const auto deadline = Clock::now() + (failed ? std::min(o_.close_timeout, o_.rdzv_timeout) : o_.rdzv_timeout);
    for (size_t g = 1; g < members_.size() && Clock::now() < deadline;) {
      if (store_.check({key("done", members_[g].id)}) || stale(members_[g]))
        ++g;
      else
        sleep_for(std::min(o_.beat_period, Millis(100)));
    }
  } catch (const std::exception&) {
    // The store is gone (node 0 finished first): nothing left to tell.
  }
}

ElasticRendezvous::~ElasticRendezvous() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (beat_thread_.joinable()) beat_thread_.join();
}

void ElasticRendezvous::heartbeat_loop(std::string host, uint16_t port) {
  // Every failure here ends the heartbeat quietly: node 0 then sees this node as gone, which is
  // the truth when the store is unreachable. Nothing may escape a background thread.
  try {
    dtrain::store::StoreClient client(host, port, Millis(5000), o_.secret);
    for (int64_t n = 1;; ++n) {
      client.set(key("beat", id_), to_bytes(std::to_string(n)));
      std::unique_lock<std::mutex> lock(mu_);
      if (cv_.wait_for(lock, o_.beat_period, [this] { return stop_; })) return;
    }
  } catch (...) {
  }
}

std::string ElasticRendezvous::silent_host_text() const { return run::silent_host_text(host_, port_, dead_after_); }

std::string ElasticRendezvous::member_text(int group_rank) const {
  return "node " + std::to_string(group_rank) + " (" + members_[static_cast<size_t>(group_rank)].hostname + ")";
}

ElasticNext ElasticRendezvous::join(const NodeRendezvous::Say& say) {
  if (!o_.host) return wait_for_admission(say);
  ElasticNext first = form_round(0, {Member{id_, o_.hostname}}, "", "", say);
  if (!first.round)  // the nodes that did come learn why instead of waiting for a store that vanishes
    for (const Member& m : pending_) store_.set(key("admit", m.id), to_bytes("error " + first.message));
  return first;
}

std::optional<std::string> ElasticRendezvous::await_admission(const NodeRendezvous::Say& say) {
  // E2: queue up as a waiting node and wait for node 0's admission. Every request here has the
  // store's read_timeout: a TimeoutError is node 0 not answering, never a key that is not there yet.
  const Millis patience = o_.rdzv_timeout * 2 + Millis(5000);
  auto deadline = Clock::now() + patience;
  std::optional<std::string> host_beat_key;  // node 0's heartbeat, once it said that the job is full
  std::string host_beat;
  // One compare-and-set: node 0 never sees a node half queued, whenever this one dies.
  append_line(store_, key("queue"),
              std::to_string(id_) + " " + std::to_string(o_.nproc_per_node) + " " + std::to_string(o_.max_restarts) +
                  " " + std::to_string(o_.min_nodes) + " " + std::to_string(o_.max_nodes) + " " + o_.hostname);
  for (;;) {
    if (store_.check({key("admit", id_)})) {
      std::string admit = to_string(store_.get(key("admit", id_), Millis(10000)));
      store_.set(key("admit_read", id_), to_bytes("1"));  // node 0 may end its store now (end_job)
      return admit;
    }
    if (!host_beat_key && store_.check({key("full", id_)})) {
      const std::string note = to_string(store_.get(key("full", id_), Millis(1000)));
      const size_t nl = note.find('\n');
      host_beat_key = key("beat", int_value(key("full", id_), note.substr(0, nl)));
      say(note.substr(nl + 1));
    }
    if (host_beat_key) {  // a full job may run for days: wait for a place as long as node 0 lives
      const std::string beat = to_string(store_.get(*host_beat_key, Millis(1000)));
      if (beat != host_beat) host_beat = beat, deadline = Clock::now() + patience;
    }
    if (Clock::now() >= deadline) return std::nullopt;
    sleep_for(kAdmitPoll);
  }
}

ElasticNext ElasticRendezvous::wait_for_admission(const NodeRendezvous::Say& say) {
  const std::string where = store_.host() + ":" + std::to_string(store_.port());
  std::optional<std::string> given;
  try {
    given = await_admission(say);
  } catch (const dtrain::store::TimeoutError&) {  // read_timeout (Note [Store deadlines and closing])
    return {std::nullopt, 1, base_.no_answer_text("waiting to be admitted")};
  } catch (const std::exception& e) {
    return {
        std::nullopt, 1,
        "lost the rendezvous at " + where + " while waiting to be admitted (did node 0's launcher end?): " + e.what()};
  }
  if (!given)
    return {std::nullopt, 1,
            "node 0 did not admit this node within " + seconds_text(o_.rdzv_timeout * 2 + Millis(5000)) + " at " +
                where + " (is its launcher stuck? --rdzv_timeout sets how long a node waits)"};
  const std::string& admit = *given;
  if (admit.rfind("error ", 0) == 0) return {std::nullopt, 1, admit.substr(6)};
  if (admit.rfind("end ", 0) == 0)  // "end <exit code> <line>": the job ended while this node waited
    return {std::nullopt, static_cast<int>(int_value(key("admit", id_), admit.substr(4, admit.find(' ', 4) - 4))),
            admit.substr(admit.find(' ', 4) + 1)};
  const int attempt = static_cast<int>(int_value(key("admit", id_), admit));
  ElasticRound r = parse_round(to_string(store_.get(key("round", attempt), Millis(10000))), attempt, id_);
  if (r.group_rank < 0) return {std::nullopt, 1, "node 0 admitted this node but left it out of attempt " + admit};
  read_master();
  return {r, 0, ""};
}

void ElasticRendezvous::read_master() {
  const std::string k = key("master"), v = to_string(store_.get(k, Millis(10000)));
  const size_t space = v.find(' ');
  const int64_t port = int_value(k, v.substr(0, space));
  if (space == std::string::npos || port < 1 || port > 65535)
    throw std::runtime_error("the rendezvous store's key '" + k + "' holds '" + v.substr(0, 64) +
                             "', not node 0's PORT ADDRESS: another process wrote it");
  o_.master_port = static_cast<uint16_t>(port);
  o_.master_addr = v.substr(space + 1);
}

void ElasticRendezvous::absorb_waiters() {
  const std::string q = key("queue");
  if (!store_.check({q})) return;
  std::istringstream lines(to_string(store_.get(q, Millis(10000))));
  std::string line;
  for (int64_t n = 0; std::getline(lines, line); ++n) {
    if (n < waiters_seen_) continue;
    waiters_seen_ = n + 1;
    std::istringstream in(line);
    int64_t id = 0;
    int nproc = 0, restarts = 0, lo = 0, hi = 0;
    std::string host;
    const bool parsed = static_cast<bool>(in >> id >> nproc >> restarts >> lo >> hi);
    if (parsed) std::getline(in >> std::ws, host);
    if (!parsed || host.empty() || id <= 0) {
      // Not a launcher's record: a stray write to an open store. It queues no node.
      std::fprintf(stderr, "dtrain-run: node 0 ignores '%s' in the rendezvous store's key '%s': not a waiting node\n",
                   line.substr(0, 64).c_str(), q.c_str());
      continue;
    }
    // Every node must agree on what the group may be, or the nodes would disagree on WORLD_SIZE.
    if (nproc != o_.nproc_per_node || restarts != o_.max_restarts || lo != o_.min_nodes || hi != o_.max_nodes) {
      store_.set(key("admit", id),
                 to_bytes("error nodes disagree: node 0 has " +
                          flags_text(o_.nproc_per_node, o_.max_restarts, o_.min_nodes, o_.max_nodes) + ", " + host +
                          " has " + flags_text(nproc, restarts, lo, hi) + "; give every node the same flags"));
      continue;
    }
    pending_.push_back(Member{id, host});
  }
}

void ElasticRendezvous::drop_dead_waiters() {
  // A waiting node whose heartbeat stopped (its launcher died while it waited) is never admitted.
  // watch() calls this every interval, not only when a place frees up: a node dead for a while
  // would look alive at a first look and take the place of a live one.
  for (auto it = pending_.begin(); it != pending_.end();) {
    if (!stale(*it)) {
      ++it;
      continue;
    }
    // Should it be alive after all, it hears why instead of waiting for a place that never comes.
    store_.set(key("admit", it->id), to_bytes("error node 0 heard no heartbeat from this node for " +
                                              seconds_text(dead_after_) + " while it waited: it is not admitted"));
    it = pending_.erase(it);
  }
}

void ElasticRendezvous::tell_waiters_full() {
  for (const Member& m : pending_) {
    if (!told_full_.insert(m.id).second) continue;
    store_.set(
        key("full", m.id),
        to_bytes(std::to_string(id_) + "\nthe job is full: node 0 runs --nnodes " + std::to_string(o_.min_nodes) + ":" +
                 std::to_string(o_.max_nodes) + " with " + std::to_string(members_.size()) +
                 " nodes; this node waits for a place (a node that leaves frees one) until the job ends"));
  }
}

bool ElasticRendezvous::stale(const Member& m) {
  if (m.id == id_) return false;
  const auto now = Clock::now();
  std::string v;
  if (store_.check({key("beat", m.id)})) v = to_string(store_.get(key("beat", m.id), Millis(1000)));
  auto it = beats_.find(m.id);
  if (it == beats_.end() || it->second.value != v) {
    beats_[m.id] = Beat{v, now};
    return false;
  }
  return now - it->second.changed > dead_after_;
}

ElasticNext ElasticRendezvous::form_round(int attempt, const std::vector<Member>& survivors, const std::string& why,
                                          const std::string& note, const NodeRendezvous::Say& say) {
  // E3: survivors first (their relative order, so node 0 stays node 0 and ranks stay contiguous),
  // then waiting nodes in arrival order, up to MAX; once MIN are there, wait --rdzv_last_call for more.
  const auto start = Clock::now();
  std::optional<Clock::time_point> last_call_end;
  const size_t lo = static_cast<size_t>(o_.min_nodes), hi = static_cast<size_t>(o_.max_nodes);
  const std::string where = store_.host() + ":" + std::to_string(store_.port());
  if (attempt == 0)
    say("node 0 waiting for nodes of --nnodes " + std::to_string(lo) + ":" + std::to_string(hi) + " at " + where +
        " (--rdzv_timeout " + seconds_text(o_.rdzv_timeout) + ", --rdzv_last_call " + seconds_text(o_.last_call) + ")");
  for (;;) {
    absorb_waiters();
    drop_dead_waiters();
    const size_t n = std::min(hi, survivors.size() + pending_.size());
    if (n >= hi) break;
    if (n >= lo) {
      if (!last_call_end) last_call_end = Clock::now() + o_.last_call;
      if (Clock::now() >= *last_call_end) break;
    } else if (attempt > 0) {
      return {std::nullopt, 1, ""};  // below MIN after a change: the caller ends the job
    } else if (Clock::now() - start >= o_.rdzv_timeout) {
      return {std::nullopt, 1,
              "only " + std::to_string(n) + " of at least " + std::to_string(lo) + " nodes joined the rendezvous at " +
                  where + " within --rdzv_timeout " + seconds_text(o_.rdzv_timeout) + " (--nnodes " +
                  std::to_string(lo) + ":" + std::to_string(hi) + ")"};
    }
    sleep_for(std::min(o_.beat_period, Millis(100)));
  }
  const int old_world = static_cast<int>(members_.size()) * o_.nproc_per_node;
  members_ = survivors;
  std::vector<Member> joined;
  while (members_.size() < hi && !pending_.empty()) {
    joined.push_back(pending_.front());
    members_.push_back(pending_.front());
    pending_.erase(pending_.begin());
  }
  const int world = static_cast<int>(members_.size()) * o_.nproc_per_node;
  std::string line;
  if (attempt == 0) {
    line = "elastic job formed by ";
    for (size_t g = 0; g < members_.size(); ++g) line += (g ? ", " : "") + member_text(static_cast<int>(g));
    line += "; world size " + std::to_string(world);
  } else {
    line = why;
    for (const Member& m : joined) {
      const auto g = std::find_if(members_.begin(), members_.end(), [&](const Member& x) { return x.id == m.id; }) -
                     members_.begin();
      line += (line.empty() ? "" : "; ") + member_text(static_cast<int>(g)) + " joined";
    }
    if (line.empty()) line = "restart with the same nodes";
    line += "; world size " + std::to_string(old_world) + " -> " + std::to_string(world);
  }
  line += " (attempt " + std::to_string(attempt) + note + ")";
  std::string value = line;
  for (const Member& m : members_) value += "\n" + std::to_string(m.id) + " " + m.hostname;
  store_.set(key("round", attempt), to_bytes(value));
  for (const Member& m : joined)
    if (m.id != id_) store_.set(key("admit", m.id), to_bytes(std::to_string(attempt)));
  stop_reason_.clear();
  membership_stop_ = false;
  // Forget the heartbeats of nodes that are gone; the waiting ones stay followed (drop_dead_waiters).
  for (auto it = beats_.begin(); it != beats_.end();) {
    auto same = [&](const Member& m) { return m.id == it->first; };
    const bool known =
        std::any_of(members_.begin(), members_.end(), same) || std::any_of(pending_.begin(), pending_.end(), same);
    it = known ? std::next(it) : beats_.erase(it);
  }
  ElasticRound r;
  r.attempt = attempt;
  r.group_rank = 0;
  r.nnodes = static_cast<int>(members_.size());
  r.line = line;
  return {r, 0, ""};
}

std::optional<std::string> ElasticRendezvous::watch(int attempt) {
  if (!o_.host) {  // E5: follow node 0
    try {
      dtrain::store::ScopedTimeout quick(store_, dead_after_);
      if (!store_.check({key("stop", attempt)})) return std::nullopt;
      return "stopped this node's workers: " + to_string(store_.get(key("stop", attempt), Millis(1000)));
    } catch (const dtrain::store::TimeoutError&) {
      host_silent_ = true;
      return "stopped this node's workers: " + silent_host_text();
    } catch (const std::exception& e) {  // the store closed: node 0 is gone, finish_attempt says so
      return "stopped this node's workers: lost the rendezvous at " + host_ + ":" + std::to_string(port_) + ": " +
             e.what();
    }
  }
  if (!stop_reason_.empty()) return std::nullopt;
  std::string reason;
  for (size_t g = 1; g < members_.size() && reason.empty(); ++g)
    if (stale(members_[g]))
      reason = member_text(static_cast<int>(g)) + " stopped sending heartbeats (" + seconds_text(dead_after_) + ")";
  if (reason.empty()) {
    absorb_waiters();
    drop_dead_waiters();
    if (pending_.empty()) return std::nullopt;
    if (members_.size() >= static_cast<size_t>(o_.max_nodes)) {  // they wait for a place (torchelastic's
      tell_waiters_full();                                       // redundancy list): no restart for them
      return std::nullopt;
    }
    // Note [Elastic restarts]: a failure that came first makes this attempt a failure; it stops the
    // workers itself (step 5), and the waiting node is admitted at the restart that follows.
    if (!base_.claim_for_membership_change(attempt)) return std::nullopt;
    membership_stop_ = true;
    reason = pending_.front().hostname + " is waiting to join";
  }
  stop_reason_ = reason;
  store_.set(key("stop", attempt), to_bytes(reason));
  return "stopped this node's workers: " + reason;
}

ElasticNext ElasticRendezvous::finish_attempt(int attempt, int exit_code, const NodeRendezvous::Say& say) {
  if (o_.host) return host_finish(attempt, exit_code, say);
  if (silent()) return {std::nullopt, 1, silent_host_text() + ", so the elastic job ends"};
  // E6: report, then follow node 0's decision.
  const std::string lost = "lost the rendezvous at " + store_.host() + ":" + std::to_string(store_.port()) +
                           ": node 0's launcher (the rendezvous host) is gone, so the elastic job ends";
  std::string decision;
  try {
    store_.set(key("outcome", attempt, id_), to_bytes(std::to_string(exit_code)));
    if (exit_code != 0 && exit_code != 1) return {std::nullopt, exit_code, ""};  // signalled: this node leaves
    const auto given = poll_key(store_, key("decision", attempt), o_.rdzv_timeout * 2 + Millis(10000));
    if (!given) return {std::nullopt, 1, "node 0 gave no decision after attempt " + std::to_string(attempt)};
    decision = *given;
  } catch (const dtrain::store::TimeoutError&) {  // read_timeout (Note [Store deadlines and closing])
    return {std::nullopt, 1,
            base_.no_answer_text("waiting for node 0's decision after attempt " + std::to_string(attempt))};
  } catch (const std::exception&) {
    return {std::nullopt, 1, lost};
  }
  if (decision == "done") return {std::nullopt, exit_code, ""};
  if (decision.rfind("stop ", 0) == 0) return {std::nullopt, 1, decision.substr(5)};
  ElasticRound r = parse_round(to_string(store_.get(key("round", attempt + 1), Millis(10000))), attempt + 1, id_);
  if (r.group_rank < 0)
    return {std::nullopt, 1,
            "node 0 left this node out of attempt " + std::to_string(attempt + 1) + " (" + r.line +
                "): it missed its heartbeats for " + seconds_text(dead_after_)};
  return {r, 0, ""};
}

ElasticNext ElasticRendezvous::end_job(int attempt, int code, const std::string& message) {
  // E8: nobody waits in vain.
  store_.set(key("decision", attempt), to_bytes(code == 0 ? "done" : "stop " + message));
  try {
    absorb_waiters();
  } catch (const std::exception&) {
  }
  const std::string end = code == 0 ? "end 0 the elastic job ended" : "end 1 the elastic job ended (it failed)";
  for (const Member& m : pending_)
    store_.set(key("admit", m.id), to_bytes(end + " before node 0 admitted this node; nothing ran here"));
  // The store ends with this launcher, and a waiting node reads its word only every kAdmitPoll: wait
  // (bounded) until each has read it, or it would find the store closed instead, and fail where it
  // was told the job ended (on a loaded machine its poll came after this launcher had exited).
  const auto deadline = Clock::now() + kAdmitPoll * 8;
  for (const Member& m : pending_)
    while (!store_.check({key("admit_read", m.id)}) && Clock::now() < deadline) sleep_for(Millis(10));
  pending_.clear();
  return ElasticNext{std::nullopt, code, message};
}

std::vector<int> ElasticRendezvous::outcomes(int attempt, int exit_code) {
  // E6: every member's outcome, or its absence of heartbeats (-2: gone).
  const auto deadline = Clock::now() + o_.rdzv_timeout;
  std::vector<int> codes(members_.size(), -1);
  codes[0] = exit_code;
  for (;;) {
    bool waiting = false;
    for (size_t g = 1; g < members_.size(); ++g) {
      if (codes[g] != -1) continue;
      const std::string k = key("outcome", attempt, members_[g].id);
      if (store_.check({k}))
        codes[g] = static_cast<int>(int_value(k, to_string(store_.get(k, Millis(1000)))));
      else if (stale(members_[g]) || Clock::now() >= deadline)
        codes[g] = -2;
      else
        waiting = true;
    }
    if (!waiting) return codes;
    sleep_for(std::min(o_.beat_period, Millis(100)));
  }
}

std::string ElasticRendezvous::failure_cause(int attempt) {
  // The first failure anywhere (step 5's failure/<k>), else the member node 0 stopped hearing from.
  if (auto f = base_.remote_failure(attempt, -1)) return *f;
  return stop_reason_.empty() ? "a node's workers stopped" : stop_reason_;
}

ElasticNext ElasticRendezvous::host_finish(int attempt, int exit_code, const NodeRendezvous::Say& say) {
  if (exit_code != 0 && exit_code != 1)
    return end_job(attempt, exit_code, "node 0's launcher (the rendezvous host) was stopped by a signal: the job ends");
  const std::vector<int> codes = outcomes(attempt, exit_code);
  // E7.
  if (std::all_of(codes.begin(), codes.end(), [](int c) { return c == 0; })) return end_job(attempt, 0, "");
  std::vector<Member> survivors;
  std::string left;
  for (size_t g = 0; g < members_.size(); ++g) {
    if (codes[g] == 0 || codes[g] == 1) {
      survivors.push_back(members_[g]);
      continue;
    }
    left += (left.empty() ? "" : "; ") + member_text(static_cast<int>(g)) + " left" +
            (codes[g] == -2 ? "" : " (its launcher was stopped by a signal)");
  }
  // Note [Elastic restarts]: only node 0's stop for a waiting node, with every member still there, is free.
  const bool failed = !left.empty() || !membership_stop_;
  const std::string why = left.empty() && failed ? failure_cause(attempt) : left;
  const std::string restarts = "--max_restarts " + std::to_string(o_.max_restarts);
  if (failed && failures_ >= o_.max_restarts)
    return end_job(attempt, 1,
                   why + "; " + restarts + " used up after attempt " + std::to_string(attempt) + ": the job ends");
  const std::string note = failed ? ", restart " + std::to_string(++failures_) + " of " + restarts : "";
  const int old_world = static_cast<int>(members_.size()) * o_.nproc_per_node;
  ElasticNext next =
      form_round(attempt + 1, survivors, left.empty() && failed ? "restart after " + why : why, note, say);
  if (!next.round)
    return end_job(attempt, 1,
                   why + "; " + std::to_string(survivors.size()) + " node(s) remain, fewer than the minimum " +
                       std::to_string(o_.min_nodes) + " of --nnodes " + std::to_string(o_.min_nodes) + ":" +
                       std::to_string(o_.max_nodes) + ": the job ends (world size " + std::to_string(old_world) +
                       ", attempt " + std::to_string(attempt) + ")");
  store_.set(key("decision", attempt), to_bytes("restart"));
  return next;
}

}  // namespace dtrain::run
