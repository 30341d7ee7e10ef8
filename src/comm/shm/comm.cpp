#include "comm/shm/comm.h"

#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>

#include "comm/shm/kernels.h"
#include "comm/shm/sync.h"
#include "dtrain/errors.h"

namespace dtrain::shm {
namespace {

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
    case kReduce:
      return "reduce";
    case kGather:
      return "gather";
    case kScatter:
      return "scatter";
    case kReduceScatter:
      return "reduce_scatter";
  }
  return "unknown collective";
}

// memcpy that accepts the null pointers of empty tensors when there is nothing to copy.
void shm_copy(void* dst, const void* src, size_t n) {
  if (n > 0) std::memcpy(dst, src, n);
}

// A gather whose whole output reaches this many bytes writes it with streaming stores (the own part
// and the peers'): an output this large does not stay in cache anyway, and stores that skip reading
// each destination line first made the 16 MB all-gather 10-15% faster on 2 ranks (docs/benchmarks.md).
// Below it, the output is likely read while still in cache, so it is written normally.
constexpr size_t kStreamOutputBytes = size_t{8} << 20;

// An all_reduce of at most this many bytes (and at most one slot) runs as one step in which every
// rank reduces the whole tensor (Comm::reduce_whole): one wait for the peers instead of two. Larger
// ones keep the reduction in parts, which reads fewer bytes from peers beyond 2 ranks; on 2 ranks
// 1 MB in one step was measured slower than in parts.
constexpr size_t kWholeStepBytes = size_t{64} << 10;

bool reached(uint32_t value, uint32_t target) { return static_cast<int32_t>(value - target) >= 0; }

}  // namespace

Comm::Comm(Segment segment, int rank, std::vector<int> labels, std::chrono::milliseconds timeout)
    : seg_(std::move(segment)), rank_(rank), n_(seg_.nranks()), labels_(std::move(labels)), timeout_(timeout) {
  DTRAIN_ASSERT(static_cast<int>(labels_.size()) == n_ && rank_ >= 0 && rank_ < n_);
  c_known_.assign(static_cast<size_t>(n_), 0);  // every counter starts at 0
  seg_.ctl(rank_).pid_namespace = pid_namespace();
  seg_.ctl(rank_).pid.store(static_cast<int32_t>(getpid()), std::memory_order_release);
}

std::string Comm::op_name() const { return kind_name(current_.op); }

int Comm::root_label(int32_t root) const { return root >= 0 && root < n_ ? labels_[root] : root; }

std::string Comm::describe(const OpDesc& d) const {
  switch (d.op) {
    case kAllReduce:
      return detail::cat("all_reduce of ", d.count, " ", to_string(static_cast<DType>(d.dtype)), " (",
                         to_string(static_cast<RedOp>(d.redop)), ")");
    case kBroadcast:
      return detail::cat("broadcast of ", d.count, " bytes from rank ", root_label(d.root));
    case kAllGather:
      return detail::cat("all_gather of ", d.count, " bytes");
    case kBarrier:
      return "barrier";
    case kReduce:
      return detail::cat("reduce of ", d.count, " ", to_string(static_cast<DType>(d.dtype)), " (",
                         to_string(static_cast<RedOp>(d.redop)), ") to rank ", root_label(d.root));
    case kGather:
      return detail::cat("gather of ", d.count, " bytes to rank ", root_label(d.root));
    case kScatter:
      return detail::cat("scatter of ", d.count, " bytes from rank ", root_label(d.root));
    case kReduceScatter:
      return detail::cat("reduce_scatter of ", d.count, " ", to_string(static_cast<DType>(d.dtype)), " per rank (",
                         to_string(static_cast<RedOp>(d.redop)), ")");
  }
  return "an unknown collective";
}

void Comm::check_usable() const {
  DTRAIN_CHECK(!broken_, "rank ", labels_[rank_],
               ": a previous shared-memory collective failed, so the group can no longer be used (", failure(),
               "): destroy the process group (or restart the job)");
}

std::string Comm::failure() const {
  const Header& h = seg_.header();
  if (h.aborted.load(std::memory_order_acquire) != 2) return "";
  return std::string(h.abort_message, strnlen(h.abort_message, sizeof(h.abort_message)));
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
    if (k != rank_ && !reached(c_known_[k], s - 2)) wait_for(k, C, s - 2);
  return s;
}

void Comm::signal(Phase p, uint32_t s) {
  Counter& c = seg_.ctl(rank_).phase[p];
  c.value.store(s, std::memory_order_seq_cst);
  if (c.sleepers.load(std::memory_order_seq_cst) != 0) futex_wake(&c.value);
}

void Comm::wait_for(int peer, Phase p, uint32_t s) {
  await_counter(peer, p, s);
  // A peer signals A and B of step s after C of step s - 1 (every step ends with C), so the acquire
  // that saw them shows C(s - 1) as well, and begin_step need not load the peer's C line again.
  const uint32_t c = p == C ? s : s - 1;
  if (reached(c, c_known_[peer])) c_known_[peer] = c;
}

void Comm::await_counter(int peer, Phase p, uint32_t s) {
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
    if (idle_) idle_();  // see set_idle
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
  seg_.ctl(rank_).phase[A].desc[d.op_id % 2] = d;  // released by the next signal(A)
}

void Comm::check_peer(int peer, const OpDesc& mine) {
  const OpDesc& theirs = seg_.ctl(peer).phase[A].desc[mine.op_id % 2];
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
  const Piece whole{data, count};
  reduce_into(&whole, 1, count, dtype, op, -1, kAllReduce, 1.0);
}

void Comm::all_reduce_divided(const Piece* pieces, size_t npieces, DType dtype, double divisor) {
  DTRAIN_ASSERT((dtype == DType::F32 || dtype == DType::F64) && divisor > 0);
  size_t count = 0;
  for (size_t i = 0; i < npieces; ++i) count += pieces[i].count;
  reduce_into(pieces, npieces, count, dtype, RedOp::SUM, -1, kAllReduce, divisor);
}

void Comm::reduce(void* data, size_t count, DType dtype, RedOp op, int root) {
  DTRAIN_ASSERT(root >= 0 && root < n_);
  const Piece whole{data, count};
  reduce_into(&whole, 1, count, dtype, op, root, kReduce, 1.0);
}

// One reduce_into call: `pieces` hold its elements in order, one tensor or several read and written in
// place as one (all_reduce_divided). Every index below counts elements of that whole.
struct Comm::Reduction {
  const Piece* pieces;
  size_t npieces;
  DType dtype;
  RedOp op;
  size_t es;
  double divisor;
  bool divides;   // each rank's values are divided on their way in
  bool receives;  // this rank receives the result: every rank (all_reduce) or the root alone (reduce)

  // f(pointer, offset from b, length) for each piece's share of elements [b, e).
  template <class F>
  void each(size_t b, size_t e, F&& f) const {
    size_t start = 0;
    for (size_t i = 0; i < npieces && start < e; start += pieces[i].count, ++i) {
      const size_t lo = std::max(b, start), hi = std::min(e, start + pieces[i].count);
      if (lo < hi) f(static_cast<char*>(pieces[i].data) + (lo - start) * es, lo - b, hi - lo);
    }
  }
  // Elements [b, e) of the pieces into `slot` (divided on the way, when this rank's values are).
  void copy_into(char* slot, size_t b, size_t e) const {
    each(b, e, [&](char* p, size_t off, size_t n) {
      if (divides)
        divide(slot + off * es, p, n, dtype, divisor);
      else
        shm_copy(slot + off * es, p, n * es);
    });
  }
};

void Comm::reduce_into(const Piece* pieces, size_t npieces, size_t count, DType dtype, RedOp op, int root,
                       uint32_t kind, double divisor) {
  check_usable();
  const size_t es = element_size(dtype);
  current_ =
      OpDesc{++op_id_, count, static_cast<uint8_t>(kind), static_cast<uint8_t>(dtype), static_cast<uint8_t>(op), root};
  const Reduction r{pieces, npieces, dtype, op, es, divisor, divisor != 1.0, root < 0 || root == rank_};
  // The choice depends on the call alone, so every rank whose call matches makes the same one (and
  // a rank whose call differs fails the descriptor check before it reads anything).
  const bool whole = root < 0 && count * es <= std::min(seg_.slot_bytes(), kWholeStepBytes);
  const size_t chunk_elems = seg_.slot_bytes() / es;
  size_t done = 0;
  bool first = true;
  do {
    const size_t m = std::min(chunk_elems, count - done);
    const uint32_t s = begin_step();
    if (whole)
      reduce_whole(r, done, m, s, first);
    else
      reduce_parts(r, done, m, s, first);
    signal(C, s);
    done += m;
    first = false;
  } while (done < count);
}

void Comm::check_peers_once(bool first) {
  if (first)
    for (int k = 0; k < n_; ++k)
      if (k != rank_) check_peer(k, current_);
}

// A step of an all_reduce small enough for one step: every rank copies its whole chunk into its slot
// and reduces all of it from the slots, in rank order, into its tensor. One wait for the peers instead
// of reduce_parts' two: the reads from peers are the same bytes for 2 ranks (the peer's whole chunk,
// instead of two halves), and the bits are reduce_parts' (the same operations on the same operands).
void Comm::reduce_whole(const Reduction& r, size_t done, size_t m, uint32_t s, bool first) {
  const int buf = static_cast<int>(s % 2);
  char* my_slot = seg_.slot(rank_, buf);
  r.copy_into(my_slot, done, done + m);
  if (first) publish(current_);
  signal(A, s);
  wait_all(A, s);
  check_peers_once(first);
  // Ranks 0 and 1 take their own values from the tensor, not yet overwritten when their operand's
  // pass comes (the first), divided as they enter it; a higher rank's tensor holds the partial result
  // by then, so it takes its values from its slot (divided already).
  const bool own_raw = rank_ <= 1;
  r.each(done, done + m, [&](char* mine, size_t off, size_t len) {
    auto src = [&](int k) -> const void* {
      if (k == rank_ && own_raw) return mine;
      return seg_.slot(k, buf) + off * r.es;
    };
    if (n_ == 1 && r.divides) divide(mine, mine, len, r.dtype, r.divisor);
    for (int k = 1; k < n_; ++k) {
      Divided d{r.divisor, k == 1 && rank_ == 0};
      const Divided* dv = r.divides && own_raw && (d.first || k == rank_) ? &d : nullptr;
      combine(mine, k == 1 ? src(0) : mine, src(k), len, r.dtype, r.op, dv);
    }
  });
}

// A step of the reduction in parts (reduce-scatter, then all-gather), `m` elements from `done`:
//   1. scatter: copy the parts that the other ranks reduce into my slot; A = s.
//   2. reduce part `rank_` in rank order, reading the peers' parts straight from their slots, into my
//      tensor and my slot; B = s.
//   3. gather the other ranks' reduced parts from their slots into my tensor.
void Comm::reduce_parts(const Reduction& r, size_t done, size_t m, uint32_t s, bool first) {
  const int buf = static_cast<int>(s % 2);
  const size_t es = r.es;
  // Parts start on 64-byte boundaries of the chunk, so every rank's reduction loop and copies run
  // on whole cache lines of its slot.
  const size_t align = std::max<size_t>(1, 64 / es);
  auto part_begin = [&](int k) { return k == n_ ? m : m * k / n_ / align * align; };
  char* my_slot = seg_.slot(rank_, buf);
  for (int k = 0; k < n_; ++k) {
    if (k == rank_) continue;
    const size_t b = part_begin(k);
    r.copy_into(my_slot + b * es, done + b, done + part_begin(k + 1));
  }
  if (first) publish(current_);
  signal(A, s);
  wait_all(A, s);
  check_peers_once(first);
  const size_t b = part_begin(rank_);
  r.each(done + b, done + part_begin(rank_ + 1), [&](char* mine, size_t off, size_t len) {
    auto src = [&](int k) -> const void* {
      return k == rank_ ? static_cast<const void*>(mine) : static_cast<const void*>(seg_.slot(k, buf) + (b + off) * es);
    };
    void* acc = my_slot + (b + off) * es;
    // One rank alone has nothing to combine: the loop does not run.
    if (n_ == 1 && r.divides) divide(mine, mine, len, r.dtype, r.divisor);
    // The last pass writes my tensor and streams the result into my slot for the other ranks; a
    // rank that does not receive the result leaves its tensor as it was. My own contribution is
    // divided where it enters: as the first operand of the first pass, or the second of pass `rank_`.
    for (int k = 1; k < n_; ++k) {
      const void* lhs = k == 1 ? src(0) : acc;
      Divided d{r.divisor, k == 1 && rank_ == 0};
      const Divided* dv = r.divides && (d.first || k == rank_) ? &d : nullptr;
      if (k == n_ - 1 && r.receives)
        combine_streaming(mine, acc, lhs, src(k), len, r.dtype, r.op, dv);
      else
        combine(acc, lhs, src(k), len, r.dtype, r.op, dv);
    }
  });
  signal(B, s);
  if (!r.receives) return;
  wait_all(B, s);
  for (int k = 0; k < n_; ++k) {
    if (k == rank_) continue;
    const size_t pb = part_begin(k);
    r.each(done + pb, done + part_begin(k + 1),
           [&](char* p, size_t off, size_t n) { shm_copy(p, seg_.slot(k, buf) + (pb + off) * es, n * es); });
  }
}

// Steps 1 and 2 of a copy-only collective: this rank's part is in its slot (if it has one).
void Comm::announce(uint32_t s, bool first) {
  if (first) publish(current_);
  signal(A, s);
  signal(B, s);
}

// A non-root rank's step of broadcast and scatter: announce, then copy `m` bytes at `offset` of the
// root's slot.
void Comm::take_from_root(int root, uint32_t s, bool first, char* dst, size_t offset, size_t m) {
  announce(s, first);
  wait_for(root, A, s);
  if (first) check_peer(root, current_);
  shm_copy(dst, seg_.slot(root, static_cast<int>(s % 2)) + offset, m);
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
      shm_copy(seg_.slot(root, buf), base + done, m);
      announce(s, first);
    } else {
      take_from_root(root, s, first, base + done, 0, m);
    }
    signal(C, s);
    done += m;
    first = false;
  } while (done < bytes);
}

void Comm::all_gather(const void* in, size_t bytes, void* const* outs) { gather_into(in, bytes, outs, -1, kAllGather); }

void Comm::gather(const void* in, size_t bytes, void* const* outs, int root) {
  DTRAIN_ASSERT(root >= 0 && root < n_);
  gather_into(in, bytes, outs, root, kGather);
}

void Comm::gather_into(const void* in, size_t bytes, void* const* outs, int root, uint32_t kind) {
  check_usable();
  current_ = OpDesc{++op_id_, bytes, static_cast<uint8_t>(kind), 0, 0, root};
  const bool receives = root < 0 || root == rank_;
  const bool stream = receives && bytes * static_cast<size_t>(n_) >= kStreamOutputBytes;
  auto copy_out = [stream](void* dst, const void* from, size_t m) {
    if (stream)
      stream_copy(dst, from, m);
    else
      shm_copy(dst, from, m);
  };
  const char* src = static_cast<const char*>(in);
  size_t done = 0;
  bool first = true;
  do {
    const size_t m = std::min(seg_.slot_bytes(), bytes - done);
    const uint32_t s = begin_step();
    const int buf = static_cast<int>(s % 2);
    shm_copy(seg_.slot(rank_, buf), src + done, m);
    announce(s, first);
    if (receives) {
      // The own part needs no peer: copied while they fill their slots, the chunk still in cache
      // (after the first step: no output changes before the peers' calls were checked).
      char* own = static_cast<char*>(outs[rank_]) + done;
      const bool copy_own = own != src + done;
      if (copy_own && !first) copy_out(own, src + done, m);
      wait_all(A, s);
      if (first)
        for (int k = 0; k < n_; ++k)
          if (k != rank_) check_peer(k, current_);
      if (copy_own && first) copy_out(own, src + done, m);
      for (int k = 0; k < n_; ++k)
        if (k != rank_) copy_out(static_cast<char*>(outs[k]) + done, seg_.slot(k, buf), m);
    } else if (first) {
      // The root checks everyone; checking the root here too means that a rank whose root called
      // something else fails as well, instead of completing a gather that never happened.
      wait_for(root, A, s);
      check_peer(root, current_);
    }
    signal(C, s);
    done += m;
    first = false;
  } while (done < bytes);
  // The streamed output is complete before the caller hands it to another thread.
  if (stream) store_fence();
}

void Comm::scatter(const void* const* ins, size_t bytes, void* out, int root) {
  check_usable();
  DTRAIN_ASSERT(root >= 0 && root < n_);
  current_ = OpDesc{++op_id_, bytes, kScatter, 0, 0, root};
  // The root's slot holds one part per rank side by side, so a step moves a slot's n-th part of each.
  const size_t part = std::max<size_t>(seg_.slot_bytes() / static_cast<size_t>(n_) / 64 * 64, 1);
  char* dst = static_cast<char*>(out);
  size_t done = 0;
  bool first = true;
  do {
    const size_t m = std::min(part, bytes - done);
    const uint32_t s = begin_step();
    const int buf = static_cast<int>(s % 2);
    if (rank_ == root) {
      for (int k = 0; k < n_; ++k)
        shm_copy(seg_.slot(root, buf) + k * part, static_cast<const char*>(ins[k]) + done, m);
      announce(s, first);
      shm_copy(dst + done, static_cast<const char*>(ins[rank_]) + done, m);
    } else {
      take_from_root(root, s, first, dst + done, rank_ * part, m);
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
  announce(s, /*first=*/true);
  wait_all(A, s);
  for (int k = 0; k < n_; ++k)
    if (k != rank_) check_peer(k, current_);
  signal(C, s);
}

}  // namespace dtrain::shm
