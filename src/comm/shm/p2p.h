// Point-to-point messages between the ranks of one host, over the segment's channels (torch-free;
// ShmProcessGroup maps send/recv/recvAnysource onto it).
//
// Note [Shared-memory point-to-point]
// Every ordered pair (src, dst) has a byte ring in the segment (segment.h). A message is a header
// (sequence number, tag, dtype, shape, bytes) followed by its payload; the sender writes what the
// ring has room for and publishes `head`, the receiver copies out and publishes `tail`, so a
// message larger than the ring streams through it with both ranks copying at once.
//   1. send: the message queues behind earlier sends to the same peer and is written as far as the
//      ring allows. It completes when the receiver has taken every byte (`tail` passed its end), so
//      the receiver's check (3) can still fail it.
//   2. recv: posted receives are matched, in the order they were posted, against each peer's
//      messages in the order it sent them, by source (or any source) and tag, as in Gloo and MPI.
//      A message that no posted receive matches is copied into a private stash, which later
//      receives search first. So two ranks that both send before they receive do not deadlock.
//   3. check: a matched message whose dtype or shape differs from the receive's fails the receive
//      and breaks the channel with one line naming both sides; the send (still waiting for its
//      bytes to be taken) and every later operation between the two ranks fail with that line.
//      (A message first stashed and matched later fails the receive; the sender, already done,
//      fails at its next operation towards that rank.)
//   4. progress: posting an operation moves its channel on; waiting for any operation moves every
//      channel of this rank on (sends written, incoming messages taken or stashed), so a rank
//      blocked in one operation still lets its peers finish theirs. So does a rank waiting in one
//      of the segment's collectives (Comm::set_idle): a pipeline stage enters its end-of-step
//      all-reduce with a send larger than the ring still in flight, and the neighbour needs the
//      rest of it before it can reach that all-reduce. Only a send that the ring could not take
//      whole wakes a thread (the pusher, Note [Send pusher]): otherwise the rest of it would wait
//      for this rank's next point-to-point call, and a stage that sends and then computes would
//      leave its receiver idle for that whole computation.
//   5. waiting: spin, yield, then sleep on this rank's bell, which a peer bumps whenever a channel
//      to or from this rank changes; a sleeper wakes every ~10 ms to check the timeout, whether the
//      peer's process still exists, and the segment's abort flag (a failed collective).
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "comm/shm/comm.h"
#include "comm/shm/sync.h"

namespace dtrain::shm {

constexpr int kMaxDims = 24;

// What a message carries besides its bytes; sender and receiver must agree on all of it.
struct MsgDesc {
  int64_t tag = 0;
  int32_t dtype = 0;  // the caller's dtype code, compared and named through P2p's describer
  int32_t ndim = 0;   // at most kMaxDims
  int64_t sizes[kMaxDims] = {};
  uint64_t bytes = 0;
};

class P2p {
 public:
  // How to name a message's dtype and shape in errors ("float32 [4, 5]").
  using Describe = std::function<std::string(const MsgDesc&)>;
  struct Op;

  // Uses comm's segment, rank, labels (global ranks, for messages) and timeout.
  P2p(std::shared_ptr<Comm> comm, Describe describe);
  ~P2p();
  P2p(const P2p&) = delete;
  P2p& operator=(const P2p&) = delete;

  // Start an operation; `data` must stay valid until it completes. Neither blocks.
  std::shared_ptr<Op> send(int dst, const void* data, const MsgDesc& desc);
  std::shared_ptr<Op> recv(int src, void* data, const MsgDesc& desc);  // src -1: any source
  // Blocks until `op` completes; throws dtrain::Error naming this rank, the operation and the cause.
  void wait(Op& op);
  // Moves every channel on once; whether `op` has completed (successfully or not). Never throws.
  bool test(Op& op);
  // Moves every channel on once (for waits outside point-to-point, Comm::set_idle). Never throws.
  void progress() noexcept;
  // The local rank a completed receive's message came from.
  static int source(const Op& op);

 private:
  struct Outgoing;
  struct Incoming;
  struct Stashed;

  void progress_send(int dst);  // every progress_* call is non-blocking; callers hold no lock
  bool has_unsent(int dst);
  void wake_pusher();
  void push_loop() noexcept;
  void progress_recv(int src);
  void progress_all();
  bool match_stash(const std::shared_ptr<Op>& op);          // under in_mu_
  void fail_incoming(int src, const std::string& message);  // under in_mu_: in.op and receives from src
  void ring_bell(int rank);
  void break_channel(int src, int dst, const std::string& message);
  std::string channel_error(int src, int dst) const;  // "" while the channel is sound
  // The error of a channel (src -> dst) whose shared state is impossible, naming this rank, the peer
  // and the segment, and `what` was wrong.
  std::string corrupt(int src, int dst, const std::string& what) const;
  void complete(Op& op, std::string error);
  std::string what(const Op& op) const;
  std::string mismatch(const Op& op, int src, const MsgDesc& sent) const;  // step 3's line
  std::string check_failures(const Op& op, Clock::time_point start);

  std::shared_ptr<Comm> comm_;
  const Segment& seg_;
  int me_;
  int n_;
  Describe describe_;

  std::vector<std::unique_ptr<Outgoing>> out_;  // per destination

  // Note [Send pusher]: started by the first send the ring could not take whole.
  std::mutex push_mu_;
  std::condition_variable push_cv_;
  bool push_wanted_ = false;  // under push_mu_
  std::atomic<bool> push_stop_{false};
  std::atomic<int> waiters_{0};  // threads inside wait(), which move every channel on themselves
  std::thread pusher_;

  std::mutex in_mu_;                            // everything below
  std::vector<std::unique_ptr<Incoming>> in_;   // per source
  std::deque<std::shared_ptr<Op>> posted_;      // receives not yet matched, in post order
  std::deque<std::shared_ptr<Stashed>> stash_;  // messages not yet matched, in arrival order
};

}  // namespace dtrain::shm
