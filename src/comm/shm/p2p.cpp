#include "comm/shm/p2p.h"

#include <sched.h>

#include <algorithm>
#include <cstring>

#include "dtrain/errors.h"

namespace dtrain::shm {
// Named, not anonymous: the header is a member of P2p's op structs, and the unity build of the
// sanitizer trees puts this file beside segment.cpp, whose own constants share these names.
namespace p2p_wire {

constexpr uint64_t kMagic = 0x6470327068647231ULL;  // "dp2phdr1"
// Bytes published at a time: a large message becomes visible to the receiver in pieces, so that
// it copies out while the sender is still copying in.
constexpr uint64_t kPublishBytes = 256 << 10;

struct WireHeader {
  uint64_t magic = kMagic;
  uint64_t seq = 0;  // 1, 2, ... per channel: a check that both sides walk the ring alike
  MsgDesc desc;
};
constexpr uint64_t kHeaderBytes = 256;
static_assert(sizeof(WireHeader) <= kHeaderBytes, "the header must fit its slot in the stream");

bool same_layout(const MsgDesc& a, const MsgDesc& b) {
  return a.dtype == b.dtype && a.ndim == b.ndim && a.bytes == b.bytes && std::equal(a.sizes, a.sizes + a.ndim, b.sizes);
}

}  // namespace p2p_wire

struct P2p::Op {
  bool is_send = false;
  int peer = -1;  // local rank; -1: any source
  char* data = nullptr;
  MsgDesc desc;
  Clock::time_point posted;
  // send: the header, then how much of header + payload is in the ring, and the ring offset just
  // past the message once it is all there
  p2p_wire::WireHeader header;
  uint64_t written = 0;
  uint64_t end = 0;
  // recv
  int source = -1;
  std::atomic<bool> finishing{false};  // the first completion wins (a timeout races with progress)
  std::atomic<bool> done{false};
  std::string error;  // written before done
};

struct P2p::Outgoing {
  std::mutex mu;
  uint64_t head = 0;  // this process is the channel's only writer
  uint64_t seq = 0;
  std::deque<std::shared_ptr<Op>> unsent;    // front may be partly written
  std::deque<std::shared_ptr<Op>> inflight;  // all written, waiting for the receiver to take it
};

struct P2p::Stashed {
  int src = -1;
  MsgDesc desc;
  std::vector<char> data;
  uint64_t filled = 0;
};

struct P2p::Incoming {
  uint64_t tail = 0;  // this process is the channel's only reader
  uint64_t seq = 0;
  bool have_header = false;
  p2p_wire::WireHeader header;
  uint64_t taken = 0;  // payload bytes copied out so far
  std::shared_ptr<Op> op;
  std::shared_ptr<Stashed> stash;
};

namespace {

// Copies n bytes between a linear buffer and the ring at stream offset pos (wrapping at cap).
void to_ring(char* ring, uint64_t cap, uint64_t pos, const char* src, uint64_t n) {
  const uint64_t at = pos % cap, first = std::min(n, cap - at);
  std::memcpy(ring + at, src, first);
  if (n > first) std::memcpy(ring, src + first, n - first);
}

void from_ring(const char* ring, uint64_t cap, uint64_t pos, char* dst, uint64_t n) {
  const uint64_t at = pos % cap, first = std::min(n, cap - at);
  std::memcpy(dst, ring + at, first);
  if (n > first) std::memcpy(dst + first, ring, n - first);
}

}  // namespace

P2p::P2p(std::shared_ptr<Comm> comm, Describe describe)
    : comm_(std::move(comm)),
      seg_(comm_->segment()),
      me_(comm_->rank()),
      n_(comm_->size()),
      describe_(std::move(describe)) {
  for (int r = 0; r < n_; ++r) {
    out_.push_back(std::make_unique<Outgoing>());
    in_.push_back(std::make_unique<Incoming>());
  }
}

P2p::~P2p() {
  push_stop_.store(true);
  {
    std::lock_guard<std::mutex> lock(push_mu_);
    push_wanted_ = true;
  }
  push_cv_.notify_all();
  ring_bell(me_);  // a pusher asleep on the bell
  if (pusher_.joinable()) pusher_.join();
}

// Note [Send pusher]: a send larger than the ring's free space is written in part, and its rest
// moves only when some thread of this rank runs point-to-point code (step 4). A pipeline stage posts
// its boundary send and goes on computing the next micro-batch, so without help its receiver would
// wait for that computation (docs/benchmarks.md, pipeline, has what it cost 1F1B). The first such send
// starts this thread; each wakes it. It writes what the rings take as the receivers drain them,
// sleeping on this rank's bell (which a receiver rings when it takes bytes) in between, and sleeps
// on its condition variable again once nothing is left unsent. It only writes: completion is still
// found by the sender's own test or wait, and every failure surfaces there. A send that fits the
// ring never involves it, so small messages pay nothing. While a thread of this rank waits in
// wait(), which moves every channel on itself, the pusher stands down (it would only take turns with
// that thread on one core, each wake a context switch: a blocking 4 MB send lost a third of its
// bandwidth), and the waiter wakes it again on its way out if anything is left unsent.
void P2p::wake_pusher() {
  {
    std::lock_guard<std::mutex> lock(push_mu_);
    push_wanted_ = true;
    if (!pusher_.joinable()) pusher_ = std::thread([this] { push_loop(); });
  }
  push_cv_.notify_one();
}

bool P2p::has_unsent(int dst) {
  Outgoing& o = *out_[dst];
  std::lock_guard<std::mutex> lock(o.mu);
  return !o.unsent.empty();
}

void P2p::push_loop() noexcept {
  Counter& bell = seg_.bell(me_);
  std::unique_lock<std::mutex> lock(push_mu_);
  for (;;) {
    push_cv_.wait(lock, [&] { return push_wanted_; });
    push_wanted_ = false;
    if (push_stop_.load()) return;
    lock.unlock();
    for (;;) {
      const uint32_t v = bell.value.load(std::memory_order_seq_cst);
      bool left = false;
      for (int r = 0; r < n_; ++r) {
        if (r == me_) continue;
        try {
          progress_send(r);
          left = left || has_unsent(r);
        } catch (...) {  // progress_send allocates nothing; a failure would surface in the sender's wait
        }
      }
      if (!left || push_stop_.load() || waiters_.load() > 0) break;
      bell.sleepers.fetch_add(1, std::memory_order_seq_cst);
      if (bell.value.load(std::memory_order_seq_cst) == v) futex_wait(&bell.value, v, kSleepNs);
      bell.sleepers.fetch_sub(1, std::memory_order_seq_cst);
    }
    lock.lock();
  }
}

int P2p::source(const Op& op) { return op.source; }

std::string P2p::what(const Op& op) const {
  const auto& labels = comm_->labels();
  if (op.is_send) return detail::cat("send to rank ", labels[op.peer], " (tag ", op.desc.tag, ")");
  if (op.peer < 0) return detail::cat("recv from any rank (tag ", op.desc.tag, ")");
  return detail::cat("recv from rank ", labels[op.peer], " (tag ", op.desc.tag, ")");
}

std::string P2p::mismatch(const Op& op, int src, const MsgDesc& sent) const {
  const auto& labels = comm_->labels();
  return detail::cat("rank ", labels[me_], ": ", what(op), " expected ", describe_(op.desc), " but rank ", labels[src],
                     " sent ", describe_(sent), ": sender and receiver must pass tensors of the same dtype and shape");
}

void P2p::ring_bell(int rank) {
  Counter& b = seg_.bell(rank);
  b.value.fetch_add(1, std::memory_order_seq_cst);
  if (b.sleepers.load(std::memory_order_seq_cst) != 0) futex_wake(&b.value);
}

void P2p::break_channel(int src, int dst, const std::string& message) {
  ChanCtl& c = seg_.chan(src, dst);
  uint32_t expected = 0;
  if (c.broken.compare_exchange_strong(expected, 1)) {
    std::strncpy(c.message, message.c_str(), sizeof(c.message) - 1);
    c.broken.store(2, std::memory_order_release);
  }
  ring_bell(src);
  ring_bell(dst);
}

std::string P2p::channel_error(int src, int dst) const {
  const ChanCtl& c = seg_.chan(src, dst);
  uint32_t b = c.broken.load(std::memory_order_acquire);
  if (b == 0) return "";
  // The breaking rank is copying its message (a few hundred bytes): wait for it, boundedly.
  for (int i = 0; b == 1 && i < 1000000; ++i) {
    DTRAIN_CPU_RELAX();
    if (i > 1000) sched_yield();
    b = c.broken.load(std::memory_order_acquire);
  }
  if (b == 1) return "a point-to-point channel broke (the rank that broke it stopped before saying why)";
  return std::string(c.message, strnlen(c.message, sizeof(c.message)));
}

std::string P2p::corrupt(int src, int dst, const std::string& what) const {
  const auto& labels = comm_->labels();
  const int peer = src == me_ ? dst : src;
  return detail::cat("rank ", labels[me_], ": the point-to-point channel ", src == me_ ? "to" : "from", " rank ",
                     labels[peer], " of shared-memory segment ", seg_.name(), " is corrupt (", what,
                     "): another program wrote into the job's shared memory; restart the job");
}

void P2p::complete(Op& op, std::string error) {
  if (op.finishing.exchange(true)) return;
  op.error = std::move(error);
  op.done.store(true, std::memory_order_release);
}

std::shared_ptr<P2p::Op> P2p::send(int dst, const void* data, const MsgDesc& desc) {
  DTRAIN_ASSERT(dst >= 0 && dst < n_ && dst != me_ && desc.ndim >= 0 && desc.ndim <= kMaxDims);
  auto op = std::make_shared<Op>();
  op->is_send = true;
  op->peer = dst;
  op->data = const_cast<char*>(static_cast<const char*>(data));
  op->desc = desc;
  op->posted = Clock::now();
  Outgoing& o = *out_[dst];
  {
    std::lock_guard<std::mutex> lock(o.mu);
    op->header.seq = ++o.seq;
    op->header.desc = desc;
    o.unsent.push_back(op);
  }
  progress_send(dst);
  if (has_unsent(dst)) wake_pusher();  // Note [Send pusher]
  return op;
}

std::shared_ptr<P2p::Op> P2p::recv(int src, void* data, const MsgDesc& desc) {
  DTRAIN_ASSERT(src >= -1 && src < n_ && src != me_ && desc.ndim >= 0 && desc.ndim <= kMaxDims);
  auto op = std::make_shared<Op>();
  op->peer = src;
  op->data = static_cast<char*>(data);
  op->desc = desc;
  op->posted = Clock::now();
  {
    std::lock_guard<std::mutex> lock(in_mu_);
    if (src >= 0) {
      std::string broken = channel_error(src, me_);
      if (!broken.empty()) {
        complete(*op, broken);
        return op;
      }
    }
    if (!match_stash(op)) posted_.push_back(op);
  }
  if (src >= 0)
    progress_recv(src);
  else
    for (int r = 0; r < n_; ++r) progress_recv(r);
  return op;
}

bool P2p::match_stash(const std::shared_ptr<Op>& op) {
  auto it = std::find_if(stash_.begin(), stash_.end(), [&](const std::shared_ptr<Stashed>& s) {
    return (op->peer < 0 || s->src == op->peer) && s->desc.tag == op->desc.tag;
  });
  if (it == stash_.end()) return false;
  std::shared_ptr<Stashed> s = *it;
  stash_.erase(it);
  if (!p2p_wire::same_layout(s->desc, op->desc)) {
    std::string msg = mismatch(*op, s->src, s->desc);
    break_channel(s->src, me_, msg);
    complete(*op, msg);
    return true;
  }
  std::memcpy(op->data, s->data.data(), s->filled);
  Incoming& in = *in_[s->src];
  if (in.stash == s) {  // still arriving: the rest goes straight to the receive
    in.stash.reset();
    in.op = op;
  } else {
    op->source = s->src;
    complete(*op, "");
  }
  return true;
}

void P2p::progress_send(int dst) {
  Outgoing& o = *out_[dst];
  std::lock_guard<std::mutex> lock(o.mu);
  if (o.unsent.empty() && o.inflight.empty()) return;
  std::string broken = channel_error(me_, dst);
  if (!broken.empty()) {
    for (auto& op : o.inflight) complete(*op, broken);
    for (auto& op : o.unsent) complete(*op, broken);
    o.inflight.clear();
    o.unsent.clear();
    return;
  }
  ChanCtl& c = seg_.chan(me_, dst);
  char* ring = seg_.ring(me_, dst);
  const uint64_t cap = seg_.chan_bytes();
  uint64_t tail = c.tail.load(std::memory_order_acquire);
  // The receiver's tail lies in [head - cap, head]; any other value would make room (and the
  // completions below) from nothing.
  auto tail_ok = [&] { return o.head - tail <= cap; };
  auto fail_all = [&](const std::string& msg) {
    break_channel(me_, dst, msg);
    for (auto& op : o.inflight) complete(*op, msg);
    for (auto& op : o.unsent) complete(*op, msg);
    o.inflight.clear();
    o.unsent.clear();
  };
  auto bad_tail = [&] {
    return corrupt(me_, dst,
                   detail::cat("the receiver's tail ", tail, " is not within ", cap, " bytes below head ", o.head));
  };
  if (!tail_ok()) return fail_all(bad_tail());
  while (!o.unsent.empty()) {
    Op& op = *o.unsent.front();
    const uint64_t total = p2p_wire::kHeaderBytes + op.desc.bytes;
    uint64_t room = cap - (o.head - tail);
    if (room == 0) {
      tail = c.tail.load(std::memory_order_acquire);
      if (!tail_ok()) return fail_all(bad_tail());
      room = cap - (o.head - tail);
      if (room == 0) break;
    }
    const uint64_t n = std::min({room, total - op.written, p2p_wire::kPublishBytes});
    // The stream is the header's kHeaderBytes, then the payload.
    uint64_t done = 0;
    if (op.written < p2p_wire::kHeaderBytes) {
      const uint64_t h = std::min(n, p2p_wire::kHeaderBytes - op.written);
      char header[p2p_wire::kHeaderBytes] = {0};
      std::memcpy(header, &op.header, sizeof(op.header));
      to_ring(ring, cap, o.head, header + op.written, h);
      done = h;
    }
    if (done < n) to_ring(ring, cap, o.head + done, op.data + (op.written + done - p2p_wire::kHeaderBytes), n - done);
    o.head += n;
    op.written += n;
    c.head.store(o.head, std::memory_order_release);
    ring_bell(dst);
    if (op.written == total) {
      op.end = o.head;
      o.inflight.push_back(o.unsent.front());
      o.unsent.pop_front();
    }
  }
  tail = c.tail.load(std::memory_order_acquire);
  if (!tail_ok()) return fail_all(bad_tail());
  while (!o.inflight.empty() && tail >= o.inflight.front()->end) {
    complete(*o.inflight.front(), "");
    o.inflight.pop_front();
  }
}

void P2p::fail_incoming(int src, const std::string& message) {
  Incoming& in = *in_[src];
  if (in.op) complete(*in.op, message);
  in.op.reset();
  for (auto it = posted_.begin(); it != posted_.end();) {
    if ((*it)->peer == src) {
      complete(**it, message);
      it = posted_.erase(it);
    } else {
      ++it;
    }
  }
}

void P2p::progress_recv(int src) {
  if (src == me_) return;
  std::lock_guard<std::mutex> lock(in_mu_);
  Incoming& in = *in_[src];
  ChanCtl& c = seg_.chan(src, me_);
  const char* ring = seg_.ring(src, me_);
  const uint64_t cap = seg_.chan_bytes();
  std::string broken = channel_error(src, me_);
  if (!broken.empty()) return fail_incoming(src, broken);
  for (;;) {
    const uint64_t head = c.head.load(std::memory_order_acquire);
    // The sender's head lies in [tail, tail + cap]: more would read past the ring.
    if (head - in.tail > cap) {
      const std::string msg = corrupt(
          src, me_, detail::cat("the sender's head ", head, " is not within ", cap, " bytes above tail ", in.tail));
      break_channel(src, me_, msg);
      return fail_incoming(src, msg);
    }
    if (!in.have_header) {
      if (head - in.tail < p2p_wire::kHeaderBytes) return;
      from_ring(ring, cap, in.tail, reinterpret_cast<char*>(&in.header), sizeof(in.header));
      if (in.header.magic != p2p_wire::kMagic || in.header.seq != in.seq + 1 || in.header.desc.ndim < 0 ||
          in.header.desc.ndim > kMaxDims) {
        std::string msg = corrupt(src, me_, detail::cat("the header of message ", in.seq + 1));
        break_channel(src, me_, msg);
        return fail_incoming(src, msg);
      }
      const MsgDesc& d = in.header.desc;
      auto it = std::find_if(posted_.begin(), posted_.end(), [&](const std::shared_ptr<Op>& op) {
        return (op->peer < 0 || op->peer == src) && op->desc.tag == d.tag;
      });
      if (it != posted_.end()) {
        std::shared_ptr<Op> op = *it;
        if (!p2p_wire::same_layout(op->desc, d)) {
          // Left unread: the sender's send must not complete (step 3).
          std::string msg = mismatch(*op, src, d);
          posted_.erase(it);
          complete(*op, msg);
          break_channel(src, me_, msg);
          return fail_incoming(src, msg);
        }
        posted_.erase(it);
        in.op = op;
      } else {
        in.stash = std::make_shared<Stashed>();
        in.stash->src = src;
        in.stash->desc = d;
        try {  // the length comes from shared memory: a hostile one must not escape as bad_alloc
          in.stash->data.resize(d.bytes);
        } catch (const std::exception&) {
          const std::string msg = corrupt(src, me_, detail::cat("message ", in.seq + 1, " claims ", d.bytes, " bytes"));
          in.stash.reset();
          break_channel(src, me_, msg);
          return fail_incoming(src, msg);
        }
        stash_.push_back(in.stash);
      }
      in.have_header = true;
      in.taken = 0;
      in.seq = in.header.seq;
      in.tail += p2p_wire::kHeaderBytes;
    }
    const uint64_t remaining = in.header.desc.bytes - in.taken;
    const uint64_t n = std::min(remaining, head - in.tail);
    if (n > 0) {
      char* dst = in.op ? in.op->data : in.stash->data.data();
      from_ring(ring, cap, in.tail, dst + in.taken, n);
      in.taken += n;
      in.tail += n;
      if (in.stash) in.stash->filled = in.taken;
    }
    c.tail.store(in.tail, std::memory_order_release);
    ring_bell(src);
    if (in.taken < in.header.desc.bytes) return;
    if (in.op) {
      in.op->source = src;
      complete(*in.op, "");
    }
    in.op.reset();
    in.stash.reset();
    in.have_header = false;
  }
}

void P2p::progress_all() {
  for (int r = 0; r < n_; ++r) {
    if (r == me_) continue;
    progress_send(r);
    progress_recv(r);
  }
}

void P2p::progress() noexcept {
  try {
    progress_all();
  } catch (...) {  // a failed stash allocation surfaces in the operation's own wait()
  }
}

bool P2p::test(Op& op) {
  if (op.done.load(std::memory_order_acquire)) return true;
  try {
    progress_all();
  } catch (...) {  // progress allocates (a stash); a failure there surfaces in wait()
  }
  return op.done.load(std::memory_order_acquire);
}

// A failure that ends the wait for `op`, or "".
std::string P2p::check_failures(const Op& op, Clock::time_point start) {
  const auto& labels = comm_->labels();
  const Header& h = seg_.header();
  if (h.aborted.load(std::memory_order_acquire) == 2)
    return detail::cat("rank ", labels[me_], ": ", what(op), " over shared memory aborted: ", h.abort_message);
  if (Clock::now() - start >= comm_->timeout())
    return detail::cat("rank ", labels[me_], ": ", what(op), " over shared memory timed out after ",
                       comm_->timeout().count(), " ms",
                       op.is_send ? ": the receiver did not take the message (it is slow, hung, or receives "
                                    "with another tag or from another rank)"
                                  : ": no matching message arrived (the sender is slow, hung, or sends with "
                                    "another tag or to another rank)");
  // A dead peer ends a receive from it, a send to it, and a receive from any rank once every peer
  // is gone (another may still send).
  std::string dead;
  for (int r = 0; r < n_; ++r) {
    if (r == me_ || (op.peer >= 0 && r != op.peer)) continue;
    const int32_t pid = seg_.ctl(r).pid.load(std::memory_order_acquire);
    if (pid > 0 && seg_.ctl(r).pid_namespace == seg_.ctl(me_).pid_namespace && exited(pid)) {
      if (dead.empty())
        dead = detail::cat("rank ", labels[me_], ": ", what(op), " over shared memory: rank ", labels[r], " (pid ", pid,
                           ") exited before completing it");
    } else {
      return "";
    }
  }
  return dead;
}

void P2p::wait(Op& op) {
  // Note [Send pusher]: the pusher stands down while this thread moves the channels on.
  struct Waiting {
    P2p& p;
    explicit Waiting(P2p& p) : p(p) { p.waiters_.fetch_add(1); }
    ~Waiting() {
      p.waiters_.fetch_sub(1);
      try {
        for (int r = 0; r < p.n_; ++r)
          if (r != p.me_ && p.has_unsent(r)) {
            p.wake_pusher();
            break;
          }
      } catch (...) {  // a pusher that cannot start leaves the rest to this rank's next call
      }
    }
  } waiting(*this);
  Counter& bell = seg_.bell(me_);
  const auto start = Clock::now();
  auto next_check = start + kSpin + kYield;
  for (;;) {
    const uint32_t v = bell.value.load(std::memory_order_seq_cst);
    if (!op.done.load(std::memory_order_acquire)) progress_all();
    if (op.done.load(std::memory_order_acquire)) {
      if (!op.error.empty()) throw Error(op.error);
      return;
    }
    const auto now = Clock::now();
    if (now >= next_check) {
      // Measured from the post, as the group's timeout for a collective.
      std::string failure = check_failures(op, op.posted);
      if (!failure.empty()) progress_all();  // the message a peer wrote just before it exited
      if (!failure.empty() && !op.done.load(std::memory_order_acquire)) {
        // The channel's state is unknown now (a message may be half written or half read).
        if (op.peer >= 0) op.is_send ? break_channel(me_, op.peer, failure) : break_channel(op.peer, me_, failure);
        {
          std::lock_guard<std::mutex> lock(in_mu_);
          posted_.erase(std::remove_if(posted_.begin(), posted_.end(),
                                       [&](const std::shared_ptr<Op>& p) { return p.get() == &op; }),
                        posted_.end());
        }
        if (!op.done.load(std::memory_order_acquire)) complete(op, failure);
        continue;  // reports op's error (or its success, had it completed meanwhile)
      }
      next_check = now + kCheckPeriod;
    }
    if (now - start < kSpin) {
      for (int i = 0; i < 64; ++i) DTRAIN_CPU_RELAX();
      continue;
    }
    if (now - start < kSpin + kYield) {
      sched_yield();
      continue;
    }
    bell.sleepers.fetch_add(1, std::memory_order_seq_cst);
    if (bell.value.load(std::memory_order_seq_cst) == v) futex_wait(&bell.value, v, kSleepNs);
    bell.sleepers.fetch_sub(1, std::memory_order_seq_cst);
  }
}

}  // namespace dtrain::shm
