// The flight recorder (see flight_recorder.h): the rings, the dump and the watchdog.
//
// Note [Flight record dumps]: the dump is PyTorch's flight-recorder dict (version "2.10", written by
// torch/csrc/distributed/c10d/FlightRecorder*), pickled: PyTorch 2.15's analyzer reads it for any
// backend ("gloo:" profiling names; it warns about unknown prefixes only), so one format serves both
// tools. Its fields: "version", "pg_config" (name -> name, desc, ranks as text "[0, 1]"),
// "pg_status", "entries" (record_id, pg_id, process_group (name, desc), collective_seq_id,
// p2p_seq_id, op_id, profiling_name, time_created_ns, input/output_sizes and _dtypes (c10's names),
// state, time_discovered_started_ns / _completed_ns, retired, timeout_ms, is_p2p, frames), plus
// dtrain's keys (common/flight_analysis.h). Shared memory records as "gloo" (it wraps Gloo's group).
// A dump copies each ring under its mutex, then builds and writes the file with no lock held;
// the file appears whole (written beside it, then renamed).
//
// Note [Flight watchdog]: a detached thread wakes every 100 ms: it dumps on SIGUSR1 (the handler
// only sets a flag: nothing else is safe in a handler) and when no call changed state for the stall
// time while one is pending. It and the rings' registry are never destroyed, so a program that
// exits without destroy_process_group leaves nothing running that touches freed memory.
//
// Note [Unwaited calls]: a call is marked completed by Work::wait, but an asynchronous call may be
// dropped unwaited (its result unused) or waited long after it finished. Such an entry would stay
// "started" and, once the program computes longer than the stall time, the watchdog would dump a
// stall that is none. So a started entry keeps the backend's handle: before the watchdog calls a
// stall, and before any dump, entries whose handle says completed are marked completed (the time
// is when that was discovered, as PyTorch's watchdog records it). The handle is let go once the
// entry finishes or its slot is reused; a failed handle is left for wait() to tell.
#include "comm/flight_recorder.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <thread>

#include <c10/core/ScalarType.h>

#include "common/env.h"
#include "common/flight_analysis.h"
#include "common/flight_pickle.h"
#include "common/util.h"
#include "comm/state.h"

namespace dtrain::comm {

enum class FlightState : uint8_t { kScheduled, kStarted, kCompleted, kFailed };

struct FlightEntry {
  uint64_t id = 0;  // 0: an empty slot
  int64_t seq = -1, p2p_seq = -1, peer_seq = -1;
  FlightCall call{"", ""};
  FlightState state = FlightState::kScheduled;
  int64_t created_ns = 0, started_ns = 0, completed_ns = 0;
  c10::intrusive_ptr<c10d::Work> work;  // while started: the backend's handle (Note [Unwaited calls])
};

class FlightRing {
 public:
  FlightRing(size_t capacity, std::string name, std::string backend, std::vector<int> ranks, int64_t timeout_ms)
      : slots(capacity),
        name(std::move(name)),
        backend(std::move(backend)),
        ranks(std::move(ranks)),
        timeout_ms(timeout_ms) {}
  std::mutex mu;
  std::vector<FlightEntry> slots;
  int64_t next_seq = 0, next_p2p = 0;
  std::map<int, int64_t> sent_to, received_from;  // messages per peer (group rank)
  const std::string name, backend;
  const std::vector<int> ranks;
  const int64_t timeout_ms;
};

static int64_t wall_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

namespace {

// The process-wide state; never destroyed (Note [Flight watchdog]).
struct Recorder {
  std::atomic<size_t> capacity{0};  // 0: off
  std::atomic<uint64_t> next_id{1};
  std::atomic<int64_t> pending{0};
  std::atomic<int64_t> last_change_ns{0};
  std::atomic<int> rank{-1}, world_size{0};
  std::atomic<bool> watching{false};
  std::atomic<bool> enabled{true};  // set_flight_recorder_enabled
  std::atomic<double> stall_s{0};
  std::mutex rings_mu;  // the registry; never held by a call
  std::vector<std::weak_ptr<FlightRing>> rings;
  std::mutex dump_mu;  // one dump at a time
  std::string dir;
  bool default_dir = false;  // dir is the fixed name in /tmp (no DTRAIN_FLIGHT_DIR)
  bool watchdog_started = false;
};
Recorder& rec() {
  static Recorder* r = new Recorder();
  return *r;
}
// Set by the SIGUSR1 handler on whichever thread takes the signal, taken by the watchdog thread: an
// atomic, not a volatile sig_atomic_t (which is safe against a handler on the same thread only; a
// second thread reading it races, as ThreadSanitizer reports). Lock-free, so safe in a handler.
std::atomic<bool> g_dump_requested{false};
static_assert(std::atomic<bool>::is_always_lock_free, "the SIGUSR1 handler may only touch a lock-free atomic");
thread_local int t_parts_depth = 0;

void on_sigusr1(int) {
  const int saved = errno;  // a handler leaves errno as the interrupted code had it
  g_dump_requested.store(true);
  errno = saved;
}

std::vector<int64_t> sizes_of(const at::Tensor& t) { return t.defined() ? t.sizes().vec() : std::vector<int64_t>{}; }

}  // namespace

FlightCall& FlightCall::in(const at::Tensor& t) {
  in_sizes.push_back(sizes_of(t));
  in_dtypes.push_back(t.defined() ? t.scalar_type() : at::kFloat);
  return *this;
}
FlightCall& FlightCall::in(const std::vector<at::Tensor>& ts) {
  for (const auto& t : ts) in(t);
  return *this;
}
FlightCall& FlightCall::out(const at::Tensor& t) {
  out_sizes.push_back(sizes_of(t));
  out_dtypes.push_back(t.defined() ? t.scalar_type() : at::kFloat);
  return *this;
}
FlightCall& FlightCall::out(const std::vector<at::Tensor>& ts) {
  for (const auto& t : ts) out(t);
  return *this;
}
FlightCall& FlightCall::flat(int64_t numel, at::ScalarType dtype) {
  in_sizes.push_back({numel});
  in_dtypes.push_back(dtype);
  out_sizes.push_back({numel});
  out_dtypes.push_back(dtype);
  return *this;
}

FlightCall& FlightCall::in_out(const at::Tensor& t) {
  in_place = &t;
  return *this;
}

namespace {

// e = call, where call names its tensor by in_out: the entry's vectors keep their capacity.
void flight_fill_in_place(FlightCall& e, const FlightCall& call) {
  const at::Tensor& t = *call.in_place;
  const auto sizes = t.defined() ? t.sizes() : c10::IntArrayRef();
  const at::ScalarType dtype = t.defined() ? t.scalar_type() : at::kFloat;
  for (auto* v : {&e.in_sizes, &e.out_sizes}) {
    v->resize(1);
    v->front().assign(sizes.begin(), sizes.end());
  }
  e.in_dtypes.assign(1, dtype);
  e.out_dtypes.assign(1, dtype);
  e.op = call.op;
  e.trace = call.trace;
  e.root = call.root;
  e.peer = call.peer;
  e.is_send = call.is_send;
  e.is_recv = call.is_recv;
  e.tag = call.tag;
  e.in_place = nullptr;  // the tensor is the caller's: the entry keeps sizes and dtypes only
}

}  // namespace

std::shared_ptr<FlightRing> make_flight_ring(const std::string& group_name, const std::string& backend,
                                             const std::vector<int>& ranks, int64_t timeout_ms) {
  const size_t n = rec().capacity.load();
  if (n == 0) return nullptr;
  auto ring = std::make_shared<FlightRing>(n, group_name, backend, ranks, timeout_ms);
  std::lock_guard<std::mutex> g(rec().rings_mu);
  auto& rings = rec().rings;
  rings.erase(std::remove_if(rings.begin(), rings.end(), [](const auto& w) { return w.expired(); }), rings.end());
  rings.push_back(ring);
  return ring;
}

FlightRecord record_call(const detail::GroupImpl& g, FlightCall call) {
  if (!g.flight || t_parts_depth > 0 || !rec().enabled.load(std::memory_order_relaxed)) return {};
  FlightRing& ring = *g.flight;
  const uint64_t id = rec().next_id.fetch_add(1, std::memory_order_relaxed);
  const int64_t now = wall_ns();
  c10::intrusive_ptr<c10d::Work> old_work;
  {
    std::lock_guard<std::mutex> lock(ring.mu);
    FlightEntry& e = ring.slots[id % ring.slots.size()];
    if (e.id != 0 && (e.state == FlightState::kScheduled || e.state == FlightState::kStarted))
      rec().pending.fetch_sub(1, std::memory_order_relaxed);  // overwritten while pending: never waited for
    old_work = std::move(e.work);                             // let go outside the lock
    e.id = id;
    e.state = FlightState::kScheduled;
    e.created_ns = now;
    e.started_ns = e.completed_ns = 0;
    if (call.is_send || call.is_recv) {
      e.seq = -1;
      e.p2p_seq = ring.next_p2p++;
      e.peer_seq = call.peer < 0 ? -1 : ++(call.is_send ? ring.sent_to : ring.received_from)[call.peer];
    } else {
      e.seq = ring.next_seq++;
      e.p2p_seq = -1;
      e.peer_seq = -1;
    }
    if (call.in_place)
      flight_fill_in_place(e.call, call);
    else
      e.call = std::move(call);
  }
  rec().pending.fetch_add(1, std::memory_order_relaxed);
  rec().last_change_ns.store(now, std::memory_order_relaxed);
  return FlightRecord(g.flight, id);
}

namespace {

// Moves entry `id` to `to` (a started one keeps `work`); false if it was overwritten meanwhile or had
// already finished.
bool advance(FlightRing& ring, uint64_t id, FlightState to, c10::intrusive_ptr<c10d::Work> work = {}) {
  const int64_t now = wall_ns();
  {
    std::lock_guard<std::mutex> lock(ring.mu);
    FlightEntry& e = ring.slots[id % ring.slots.size()];
    if (e.id != id || e.state == FlightState::kCompleted || e.state == FlightState::kFailed) return false;
    if (to == FlightState::kStarted) {
      e.started_ns = now;
      e.work = std::move(work);
    } else {
      if (e.started_ns == 0) e.started_ns = now;
      e.completed_ns = now;
      work = std::move(e.work);  // let go outside the lock
    }
    e.state = to;
  }
  if (to != FlightState::kStarted) rec().pending.fetch_sub(1, std::memory_order_relaxed);
  rec().last_change_ns.store(now, std::memory_order_relaxed);
  return true;
}

// The groups' rings still alive, taken from the registry under its lock.
std::vector<std::shared_ptr<FlightRing>> live_rings() {
  std::vector<std::shared_ptr<FlightRing>> rings;
  {
    std::lock_guard<std::mutex> g(rec().rings_mu);
    for (const auto& w : rec().rings)
      if (auto r = w.lock()) rings.push_back(std::move(r));
  }
  return rings;
}

// Note [Unwaited calls]: marks completed the started entries whose backend says so; true if any.
bool discover_completions() {
  const auto rings = live_rings();
  bool any = false;
  for (const auto& ring : rings) {
    std::vector<uint64_t> done;
    {
      std::lock_guard<std::mutex> lock(ring->mu);
      for (const auto& e : ring->slots)
        if (e.id != 0 && e.state == FlightState::kStarted && e.work && e.work->isCompleted() && !e.work->exception())
          done.push_back(e.id);
    }
    for (uint64_t id : done) any |= advance(*ring, id, FlightState::kCompleted);
  }
  return any;
}

}  // namespace

void FlightRecord::started(c10::intrusive_ptr<c10d::Work> work) {
  if (ring_) advance(*ring_, id_, FlightState::kStarted, std::move(work));
}
void FlightRecord::completed() {
  if (ring_) advance(*ring_, id_, FlightState::kCompleted);
}
void FlightRecord::failed(const std::string& why) {
  if (!ring_ || !advance(*ring_, id_, FlightState::kFailed)) return;
  const bool timed_out = why.find("timed out") != std::string::npos || why.find("Timed out") != std::string::npos;
  dump_flight_record(timed_out ? "a call timed out" : "a call failed");
}

FlightPartsScope::FlightPartsScope() { ++t_parts_depth; }
FlightPartsScope::~FlightPartsScope() { --t_parts_depth; }

namespace {

using json = nlohmann::json;

const char* state_name(FlightState s) {
  switch (s) {
    case FlightState::kScheduled:
      return "scheduled";
    case FlightState::kStarted:
      return "started";
    case FlightState::kCompleted:
      return "completed";
    case FlightState::kFailed:
      return "failed";
  }
  return "?";
}

json dtypes_json(const std::vector<at::ScalarType>& ds) {
  json out = json::array();
  for (auto d : ds) out.push_back(c10::toString(d));
  return out;
}

// "gloo:all_reduce", "gloo:send 0->1", "gloo:recv 1<-?" (group ranks, as PyTorch writes them).
std::string profiling_name(const FlightRing& ring, const FlightEntry& e, int me) {
  std::string name = (ring.backend == "nccl" ? "nccl:" : "gloo:") + std::string(e.call.trace);
  const std::string peer = e.call.peer < 0 ? "?" : std::to_string(e.call.peer);
  if (e.call.is_send) name += " " + std::to_string(me) + "->" + peer;
  if (e.call.is_recv) name += " " + std::to_string(me) + "<-" + peer;
  return name;
}

json entry_json(const FlightRing& ring, const FlightEntry& e, int pg_id, int me) {
  const std::string desc = ring.name == "default" ? "default_pg" : ring.name;
  const bool p2p = e.call.is_send || e.call.is_recv;
  auto opt = [](int64_t ns) { return ns ? json(ns) : json(nullptr); };
  json j = {{"record_id", e.id},
            {"pg_id", pg_id},
            {"process_group", {ring.name, desc}},
            {"collective_seq_id", p2p ? 0 : e.seq + 1},  // PyTorch counts from 1
            {"p2p_seq_id", p2p ? e.p2p_seq + 1 : 0},
            {"op_id", e.id},
            {"profiling_name", profiling_name(ring, e, me)},
            {"time_created_ns", e.created_ns},
            {"input_sizes", e.call.in_sizes},
            {"input_dtypes", dtypes_json(e.call.in_dtypes)},
            {"output_sizes", e.call.out_sizes},
            {"output_dtypes", dtypes_json(e.call.out_dtypes)},
            {"state", state_name(e.state)},
            {"time_discovered_started_ns", opt(e.started_ns)},
            {"time_discovered_completed_ns", opt(e.completed_ns)},
            {"retired", e.state == FlightState::kCompleted || e.state == FlightState::kFailed},
            {"timeout_ms", ring.timeout_ms},
            {"is_p2p", p2p},
            {"frames", json::array()},
            {"dtrain_op", e.call.op},
            {"dtrain_root", e.call.root < 0 ? -1 : ring.ranks.at(static_cast<size_t>(e.call.root))},
            {"dtrain_tag", e.call.tag}};
  if (p2p) {
    j["dtrain_peer"] = e.call.peer < 0 ? -1 : ring.ranks.at(static_cast<size_t>(e.call.peer));
    j["dtrain_peer_seq"] = e.peer_seq;
  }
  return j;
}

// The whole dump: every live ring's entries (copied under its mutex), oldest first; null when no
// group is alive (the program is exiting: its groups are gone, and an earlier dump says more).
json build_dump(const std::string& reason) {
  const auto rings = live_rings();
  if (rings.empty()) return nullptr;
  const int rank = rec().rank.load();
  json pg_config = json::object(), pg_status = json::object();
  std::vector<std::pair<uint64_t, json>> entries;
  for (size_t i = 0; i < rings.size(); ++i) {
    FlightRing& ring = *rings[i];
    std::vector<FlightEntry> copy;
    {
      std::lock_guard<std::mutex> lock(ring.mu);
      for (const auto& e : ring.slots)
        if (e.id != 0) copy.push_back(e);
    }
    const auto me_it = std::find(ring.ranks.begin(), ring.ranks.end(), rank);
    const int me = static_cast<int>(me_it - ring.ranks.begin());
    std::vector<std::string> ranks;
    for (int r : ring.ranks) ranks.push_back(std::to_string(r));
    pg_config[ring.name] = {{"name", ring.name},
                            {"desc", ring.name == "default" ? "default_pg" : ring.name},
                            {"ranks", "[" + util::join(ranks, ", ") + "]"}};
    int64_t enqueued = 0, started = 0, completed = 0;
    for (const auto& e : copy) {
      if (e.seq >= 0) {
        enqueued = std::max(enqueued, e.seq + 1);
        if (e.state != FlightState::kScheduled) started = std::max(started, e.seq + 1);
        if (e.state == FlightState::kCompleted) completed = std::max(completed, e.seq + 1);
      }
      entries.emplace_back(e.id, entry_json(ring, e, static_cast<int>(i), me));
    }
    pg_status[ring.name] = {{"last_enqueued_collective", enqueued},
                            {"last_started_collective", started},
                            {"last_completed_collective", completed}};
  }
  std::sort(entries.begin(), entries.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  json list = json::array();
  for (auto& e : entries) list.push_back(std::move(e.second));
  return {{"version", "2.10"},
          {"pg_config", pg_config},
          {"pg_status", pg_status},
          {"entries", list},
          {"rank", rank},
          {"dtrain",
           {{"dump_time_ns", wall_ns()},
            {"reason", reason},
            {"world_size", rec().world_size.load()},
            {"host", util::host_name()},
            {"pid", static_cast<int64_t>(getpid())}}}};
}

// Writes `bytes` to `path` whole: into a new file beside it (mkostemp: O_EXCL, so that nothing
// planted there, a link or a FIFO that would block the rank, is opened), then renamed over it.
bool write_whole(const std::string& path, const std::string& bytes, std::string& err) {
  std::string tmp = path + ".tmpXXXXXX";
  const int fd = mkostemp(tmp.data(), O_CLOEXEC);
  if (fd < 0) return err = "cannot create " + tmp + ": " + std::strerror(errno), false;
  fchmod(fd, 0644);  // readable as the other files of the folder (mkostemp makes 0600)
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = write(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      err = "cannot write " + tmp + ": " + std::strerror(errno);
      close(fd);
      unlink(tmp.c_str());
      return false;
    }
    done += static_cast<size_t>(n);
  }
  close(fd);
  if (rename(tmp.c_str(), path.c_str()) != 0) return err = "cannot rename " + tmp + ": " + std::strerror(errno), false;
  return true;
}

}  // namespace

std::string dump_flight_record(const std::string& reason) {
  if (rec().capacity.load() == 0) return "";
  std::lock_guard<std::mutex> g(rec().dump_mu);
  const int rank = rec().rank.load();
  std::string err;
  std::string path;
  try {
    const std::string& dir = rec().dir;
    if (rec().default_dir)  // a fixed name in /tmp: see make_own_folder
      util::make_own_folder(dir, "the flight-record folder", "set DTRAIN_FLIGHT_DIR to a folder of your own");
    if (mkdir(dir.c_str(), 0755) != 0 && errno != EEXIST) {
      err = "cannot create " + dir + ": " + std::strerror(errno);
    } else {
      discover_completions();
      const json dump = build_dump(reason);
      if (dump.is_null()) return "";
      path = dir + "/" + flight::kDumpPrefix + std::to_string(rank);
      if (!write_whole(path, flight::pickle::dumps(dump), err)) path.clear();
    }
  } catch (const std::exception& e) {
    err = e.what();
    path.clear();
  }
  const std::string line =
      path.empty() ? detail::cat("dtrain: rank ", rank, " could not write its flight record (", reason, "): ", err,
                                 ": set DTRAIN_FLIGHT_DIR to a writable folder\n")
                   : detail::cat("dtrain: rank ", rank, " wrote its flight record (", reason, ") to ", path, "\n");
  (void)!write(STDERR_FILENO, line.data(), line.size());  // one write: lines of ranks do not interleave
  return path;
}

namespace {

// Note [Flight watchdog].
void watch() {
  int64_t stalled_at = -1;  // the last_change_ns a stall dump was written for
  for (;;) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    try {
      if (!rec().watching.load()) continue;
      if (g_dump_requested.exchange(false)) dump_flight_record("SIGUSR1");
      const double stall = rec().stall_s.load();
      const int64_t last = rec().last_change_ns.load();
      if (stall > 0 && rec().pending.load() > 0 && last != stalled_at && wall_ns() - last >= stall * 1e9 &&
          !discover_completions()) {
        stalled_at = last;
        dump_flight_record(detail::cat("no call changed state for ", stall, " s while one is pending"));
      }
    } catch (const std::exception& e) {
      try {  // nothing may leave this thread, not even a failure to warn
        warn_once("flight-watchdog", std::string("dtrain: the flight recorder's watchdog failed: ") + e.what());
      } catch (...) {
      }
    } catch (...) {
    }
  }
}

}  // namespace

void start_flight_recorder(int rank, int world_size) {
  const auto n = env::integer("DTRAIN_FLIGHT_ENTRIES");
  const auto stall = env::seconds("DTRAIN_FLIGHT_STALL_S");
  const auto dir = env::text("DTRAIN_FLIGHT_DIR");
  Recorder& r = rec();
  r.rank = rank;
  r.world_size = world_size;
  r.stall_s = stall.value_or(0);
  r.capacity = static_cast<size_t>(n.value_or(0));
  {
    std::lock_guard<std::mutex> g(r.dump_mu);
    r.dir = dir ? *dir : "/tmp/dtrain-flight-" + std::to_string(geteuid());
    r.default_dir = !dir;
  }
  if (r.capacity == 0) return;
  struct sigaction old {};
  if (sigaction(SIGUSR1, nullptr, &old) == 0 && old.sa_handler == SIG_DFL && !(old.sa_flags & SA_SIGINFO)) {
    struct sigaction sa {};
    sa.sa_handler = on_sigusr1;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = SA_RESTART;
    sigaction(SIGUSR1, &sa, nullptr);
  }
  r.watching = true;
  std::lock_guard<std::mutex> g(r.rings_mu);
  if (!r.watchdog_started) {
    std::thread(watch).detach();
    r.watchdog_started = true;
  }
}

void stop_flight_recorder() { rec().watching = false; }

}  // namespace dtrain::comm

namespace dtrain {

std::string dump_flight_record(const std::string& reason) { return comm::dump_flight_record(reason); }
void set_flight_recorder_enabled(bool on) { comm::rec().enabled = on; }

}  // namespace dtrain
