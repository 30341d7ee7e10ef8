#include "comm/shm/comm.h"

#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>

#include "comm/shm/sync.h"
#include "dtrain/errors.h"

namespace dtrain::shm {
namespace {

enum OpKind : uint32_t { kAllReduce = 1, kBroadcast = 2, kAllGather = 3, kBarrier = 4 };

const char* kind_name(uint32_t k) {
  switch (k) {
    case kAllReduce:
      return "all_reduce";
    case kBroadcast:
      return "broadcast";
    case kAllGather:
      return "all_gather";
    case kBarrier:
      return "barrier";
  }
  return "unknown collective";
}

bool reached(uint32_t value, uint32_t target) { return static_cast<int32_t>(value - target) >= 0; }

}  // namespace

Comm::Comm(Segment segment, int rank, std::vector<int> labels, std::chrono::milliseconds timeout)
    : seg_(std::move(segment)), rank_(rank), n_(seg_.nranks()), labels_(std::move(labels)), timeout_(timeout) {
  DTRAIN_ASSERT(static_cast<int>(labels_.size()) == n_ && rank_ >= 0 && rank_ < n_);
  seg_.ctl(rank_).pid_namespace = pid_namespace();
  seg_.ctl(rank_).pid.store(static_cast<int32_t>(getpid()), std::memory_order_release);
}

std::string Comm::op_name() const { return kind_name(current_.op); }

std::string Comm::describe(const OpDesc& d) const {
  switch (d.op) {
    case kAllReduce:
      return detail::cat("all_reduce of ", d.count, " ", to_string(static_cast<DType>(d.dtype)), " (",
                         to_string(static_cast<RedOp>(d.redop)), ")");
    case kBroadcast:
      return detail::cat("broadcast of ", d.count, " bytes from rank ",
                         d.root >= 0 && d.root < n_ ? labels_[d.root] : d.root);
    case kAllGather:
      return detail::cat("all_gather of ", d.count, " bytes");
    case kBarrier:
      return "barrier";
  }
  return "an unknown collective";
}

void Comm::check_usable() const {
  DTRAIN_CHECK(!broken_, "rank ", labels_[rank_],
               ": a previous shared-memory collective failed, so the group can no longer be used: "
               "destroy the process group (or restart the job)");
}

void Comm::fail(const std::string& message) {
  abort(message);
  throw Error(message);
}

void Comm::abort(const std::string& message) {
  broken_ = true;
  Header& h = seg_.header();
  uint32_t expected = 0;
  if (h.aborted.compare_exchange_strong(expected, 1)) {
    std::strncpy(h.abort_message, message.c_str(), sizeof(h.abort_message) - 1);
    h.aborted.store(2, std::memory_order_release);
    // Wake every sleeper so the other ranks see the abort at once.
    for (int r = 0; r < n_; ++r)
      for (auto& c : seg_.ctl(r).phase) futex_wake(&c.value);
    for (int r = 0; r < n_; ++r) {  // and point-to-point waiters (p2p.h), which check the flag too
      seg_.bell(r).value.fetch_add(1, std::memory_order_seq_cst);
      futex_wake(&seg_.bell(r).value);
    }
  }
}

uint32_t Comm::begin_step() {
  const uint32_t s = ++seq_;
  for (int k = 0; k < n_; ++k)
    if (k != rank_) wait_for(k, C, s - 2);
  return s;
}

void Comm::signal(Phase p, uint32_t s) {
  Counter& c = seg_.ctl(rank_).phase[p];
  c.value.store(s, std::memory_order_seq_cst);
  if (c.sleepers.load(std::memory_order_seq_cst) != 0) futex_wake(&c.value);
}

void Comm::wait_for(int peer, Phase p, uint32_t s) {
  Counter& c = seg_.ctl(peer).phase[p];
  if (reached(c.value.load(std::memory_order_acquire), s)) return;
  const auto start = Clock::now();
  auto now = start;
  unsigned spins = 0;
  while (now - start < kSpin) {
    for (int i = 0; i < 64; ++i) {
      DTRAIN_CPU_RELAX();
      if (reached(c.value.load(std::memory_order_acquire), s)) return;
    }
    if (++spins % 4 == 0) now = Clock::now();
  }
  const auto deadline = start + timeout_;
  auto next_check = now;
  for (;;) {
    if (reached(c.value.load(std::memory_order_acquire), s)) return;
    now = Clock::now();
    if (now >= next_check) {
      Header& h = seg_.header();
      if (h.aborted.load(std::memory_order_acquire) == 2) {
        broken_ = true;
        throw Error(detail::cat("rank ", labels_[rank_], ": ", op_name(),
                                " over shared memory aborted by another rank: ", h.abort_message));
      }
      if (now >= deadline && !reached(c.value.load(std::memory_order_acquire), s))
        fail(detail::cat("rank ", labels_[rank_], ": ", op_name(), " over shared memory timed out after ",
                         std::chrono::duration_cast<std::chrono::milliseconds>(timeout_).count(),
                         " ms waiting for rank ", labels_[peer],
                         " (it did not reach this collective: it is slow, hung, or called a different "
                         "sequence of collectives)"));
      int32_t pid = seg_.ctl(peer).pid.load(std::memory_order_acquire);
      // The peer may have signalled and exited since the load above: only a missing signal counts.
      if (pid > 0 && seg_.ctl(peer).pid_namespace == seg_.ctl(rank_).pid_namespace && exited(pid) &&
          !reached(c.value.load(std::memory_order_acquire), s))
        fail(detail::cat("rank ", labels_[rank_], ": ", op_name(), " over shared memory: rank ", labels_[peer],
                         " (pid ", pid, ") exited before completing it"));
      next_check = now + kCheckPeriod;
    }
    if (now - start < kSpin + kYield) {
      sched_yield();
      continue;
    }
    c.sleepers.fetch_add(1, std::memory_order_seq_cst);
    uint32_t v = c.value.load(std::memory_order_seq_cst);
    if (!reached(v, s)) futex_wait(&c.value, v, kSleepNs);
    c.sleepers.fetch_sub(1, std::memory_order_seq_cst);
  }
}

void Comm::wait_all(Phase p, uint32_t s) {
  for (int k = 0; k < n_; ++k)
    if (k != rank_) wait_for(k, p, s);
}

void Comm::publish(const OpDesc& d) {
  seg_.ctl(rank_).desc[d.op_id % 2] = d;  // released by the next signal(A)
}

void Comm::check_peer(int peer, const OpDesc& mine) {
  const OpDesc& theirs = seg_.ctl(peer).desc[mine.op_id % 2];
  if (theirs.op_id == mine.op_id && theirs.op == mine.op && theirs.count == mine.count && theirs.dtype == mine.dtype &&
      theirs.redop == mine.redop && theirs.root == mine.root)
    return;
  fail(detail::cat("rank ", labels_[rank_], ": mismatched collectives over shared memory: rank ", labels_[rank_],
                   " called ", describe(mine), " but rank ", labels_[peer], " called ",
                   theirs.op_id == mine.op_id ? describe(theirs) : std::string("a different number of collectives"),
                   ": every rank must call the same collectives in the same order with the same "
                   "shapes and dtypes"));
}

void Comm::all_reduce(void* data, size_t count, DType dtype, RedOp op) {
  check_usable();
  const size_t es = element_size(dtype);
  current_ = OpDesc{++op_id_, count, kAllReduce, static_cast<uint32_t>(dtype), static_cast<uint32_t>(op), -1};
  const size_t chunk_elems = seg_.slot_bytes() / es;
  char* base = static_cast<char*>(data);
  size_t done = 0;
  bool first = true;
  do {
    const size_t m = std::min(chunk_elems, count - done);
    char* mine = base + done * es;
    const uint32_t s = begin_step();
    const int buf = static_cast<int>(s % 2);
    auto part_begin = [&](int k) { return m * k / n_; };
    // 1. scatter: the parts the other ranks reduce.
    char* my_slot = seg_.slot(rank_, buf);
    for (int k = 0; k < n_; ++k) {
      if (k == rank_) continue;
      size_t b = part_begin(k), e = part_begin(k + 1);
      std::memcpy(my_slot + b * es, mine + b * es, (e - b) * es);
    }
    if (first) publish(current_);
    signal(A, s);
    // 2. reduce part `rank_` in rank order into my slot and my tensor.
    wait_all(A, s);
    if (first)
      for (int k = 0; k < n_; ++k)
        if (k != rank_) check_peer(k, current_);
    {
      const size_t b = part_begin(rank_), e = part_begin(rank_ + 1), len = e - b;
      auto src = [&](int k) -> const void* {
        return k == rank_ ? static_cast<const void*>(mine + b * es)
                          : static_cast<const void*>(seg_.slot(k, buf) + b * es);
      };
      void* acc = my_slot + b * es;
      // One rank alone has nothing to combine: the loop does not run.
      // The last pass writes my tensor and streams the result into my slot for the other ranks.
      for (int k = 1; k < n_ && len > 0; ++k) {
        const void* lhs = k == 1 ? src(0) : acc;
        if (k == n_ - 1)
          combine_streaming(mine + b * es, acc, lhs, src(k), len, dtype, op);
        else
          combine(acc, lhs, src(k), len, dtype, op);
      }
    }
    signal(B, s);
    // 3. gather the other ranks' reduced parts.
    wait_all(B, s);
    for (int k = 0; k < n_; ++k) {
      if (k == rank_) continue;
      size_t b = part_begin(k), e = part_begin(k + 1);
      std::memcpy(mine + b * es, seg_.slot(k, buf) + b * es, (e - b) * es);
    }
    signal(C, s);
    done += m;
    first = false;
  } while (done < count);
}

void Comm::broadcast(void* data, size_t bytes, int root) {
  check_usable();
  DTRAIN_ASSERT(root >= 0 && root < n_);
  current_ = OpDesc{++op_id_, bytes, kBroadcast, 0, 0, root};
  char* base = static_cast<char*>(data);
  size_t done = 0;
  bool first = true;
  do {
    const size_t m = std::min(seg_.slot_bytes(), bytes - done);
    const uint32_t s = begin_step();
    const int buf = static_cast<int>(s % 2);
    if (rank_ == root) {
      std::memcpy(seg_.slot(root, buf), base + done, m);
      if (first) publish(current_);
      signal(A, s);
      signal(B, s);
    } else {
      if (first) publish(current_);
      signal(A, s);
      signal(B, s);
      wait_for(root, A, s);
      if (first) check_peer(root, current_);
      std::memcpy(base + done, seg_.slot(root, buf), m);
    }
    signal(C, s);
    done += m;
    first = false;
  } while (done < bytes);
}

void Comm::all_gather(const void* in, size_t bytes, void* const* outs) {
  check_usable();
  current_ = OpDesc{++op_id_, bytes, kAllGather, 0, 0, -1};
  const char* src = static_cast<const char*>(in);
  size_t done = 0;
  bool first = true;
  do {
    const size_t m = std::min(seg_.slot_bytes(), bytes - done);
    const uint32_t s = begin_step();
    const int buf = static_cast<int>(s % 2);
    std::memcpy(seg_.slot(rank_, buf), src + done, m);
    if (first) publish(current_);
    signal(A, s);
    signal(B, s);
    wait_all(A, s);
    if (first)
      for (int k = 0; k < n_; ++k)
        if (k != rank_) check_peer(k, current_);
    for (int k = 0; k < n_; ++k) {
      char* dst = static_cast<char*>(outs[k]) + done;
      const char* from = k == rank_ ? src + done : seg_.slot(k, buf);
      if (dst != from) std::memcpy(dst, from, m);
    }
    signal(C, s);
    done += m;
    first = false;
  } while (done < bytes);
}

void Comm::barrier() {
  check_usable();
  current_ = OpDesc{++op_id_, 0, kBarrier, 0, 0, -1};
  const uint32_t s = begin_step();
  publish(current_);
  signal(A, s);
  signal(B, s);
  wait_all(A, s);
  for (int k = 0; k < n_; ++k)
    if (k != rank_) check_peer(k, current_);
  signal(C, s);
}

}  // namespace dtrain::shm
