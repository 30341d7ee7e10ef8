// Join: training on uneven inputs (torch.distributed.algorithms.Join in C++).
//
//   dtrain::DistributedDataParallel ddp(model);
//   dtrain::ZeroRedundancyOptimizer opt(ddp.parameters(), factory);
//   {
//     dtrain::Join join({&ddp, &opt});               // joinables in the order they communicate
//     for (auto& batch : my_batches) { ...forward, backward, opt.step()... }   // any count per rank
//     join.join();                                   // shadow the others until every rank is done
//   }
//   // or: dtrain::join({&ddp, &opt}, dtrain::JoinOptions(), [&] { for (...) {...} });
//
// Without Join a rank that runs out of batches leaves the loop while the others wait in their next
// collective forever. Protocol (PyTorch's, with the counts and roots folded into one exchange):
//   1. Every iteration of an active rank, the first joinable (DDP's forward, ZeRO's step) calls
//      Join::notify_join_context: one all-reduce in which each member contributes a nonzero tag at
//      its own group rank (a vector of group-size tags and zeros). Every rank gets the iteration's
//      active set.
//   1b. A later joinable whose collectives do not come once per iteration of the first (ZeRO's
//      step: once per optimizer step, after any number of DDP forwards, or none when GradScaler
//      skips it) calls Join::notify_own_round before them: the same all-reduce, its tag naming that
//      joinable, so that a joined rank learns whether they follow from the exchange it is already
//      posting. The active ranks of one exchange must be at the same call (the same tag); when they
//      are not, every rank throws naming who was where.
//   2. A rank out of batches calls join(): it loops, contributing 0 to that same all-reduce, and
//      while anyone is still active runs, for an iteration, every joinable's JoinHook::main_hook,
//      which issues the collectives the active ranks' iteration issues (DDP: its gradient
//      all-reduces with zeros, buffers), in joinable order; for a joinable's own round, that
//      joinable's main_hook alone (ZeRO: its step and share broadcasts).
//   3. When the all-reduce comes back all zeros, every rank has joined: each hook's post_hook runs
//      (DDP: the model of the lowest rank active in the last iteration is broadcast to everyone).
//   With throw_on_early_termination, the first all-reduce with a zero makes every rank throw
//      dtrain::Error naming the rank(s) that ran out and the iteration; nobody shadows anything.
// The active set tells every rank the same thing without extra collectives: who is left (DDP divides
// by it with divide_by_initial_world_size(false)) and which rank is authoritative (the lowest active).
//
// With PyTorch peers (InitOptions::pytorch_peers: some ranks are Python programs) Join follows
// Python's Join instead, so that Python's and dtrain's ranks join together: step 1 is an all-reduce of 1 (plus one of
// 0 to learn of an early termination, with throw_on_early_termination), step 2 an all-reduce of 0
// whose sum is the number of active ranks, followed by a 1 and an error with
// throw_on_early_termination; every rank learns only the count, and joinables agree on ranks with
// collectives of their own (DDP: Python's). These tensors have the default dtype, as Python's
// torch.ones(1) (float32, unless both sides set another: at::set_default_dtype). A joinable's own
// round (step 1b) is refused there.
//
// Note [Authoritative rank under Join]: DDP takes buffers (each iteration) and the final model (at
// the end) from one active rank. PyTorch picks the highest; dtrain the lowest, so that while rank 0
// is active it is rank 0, as without Join: even inputs under Join then give the same model, buffers
// included, bit for bit. Any active rank holds a model that saw every iteration so far.
#pragma once

#include <functional>
#include <memory>
#include <vector>

#include "dtrain/detail/arg.h"
#include "dtrain/process_group.h"

namespace dtrain {

struct JoinOptions {
  // false: Join does nothing (no collective per iteration; uneven inputs hang again).
  DTRAIN_ARG(bool, enable, true)
  // Every rank throws as soon as any rank runs out (instead of shadowing it); the error names that
  // rank and the iteration.
  DTRAIN_ARG(bool, throw_on_early_termination, false)
  // Read by DistributedDataParallel: true (PyTorch's default) divides the summed gradients by the
  // group's size even when ranks have joined (joined ranks count as zeros, like a smaller batch);
  // false divides by the number of ranks active in that iteration. Only DDP's own all-reduce divides:
  // a communication hook averages as it sees fit.
  DTRAIN_ARG(bool, divide_by_initial_world_size, true)
};

// One iteration as every rank saw it: its index (0 for the first iteration inside the Join) and the
// group ranks that were still active (sorted). Hooks see the iteration they shadow.
struct JoinIteration {
  int64_t index = -1;
  std::vector<int> active;  // group ranks
  // Which call started this exchange: 0, the first joinable's (an iteration); k > 0, joinable #k's
  // own round (step 1b) inside iteration `index`.
  int joinable = 0;
  // With PyTorch peers only the count of active ranks is exchanged (Python's protocol):
  // `active` is then empty and this holds the count.
  int python_active_count = -1;
  int active_count() const { return python_active_count >= 0 ? python_active_count : static_cast<int>(active.size()); }
  // The global rank whose state counts in this iteration: the lowest active rank; the group's first
  // rank when nobody was active (Note [Authoritative rank under Join]).
  int authoritative_rank(const Group& group) const;
};

// What a joined rank runs in place of the iterations it no longer has.
class JoinHook {
 public:
  virtual ~JoinHook() = default;
  // Once per iteration that some rank is still running: issue that iteration's collectives. Also once
  // per round that this hook's own joinable starts (iteration.joinable is then its position), when
  // it is the only hook called.
  virtual void main_hook(const JoinIteration& /*iteration*/) {}
  // Once, when every rank has joined. is_last_joiner: this rank was active in the last iteration.
  // last: the last iteration any rank ran (index -1 and no ranks when nobody ran one).
  virtual void post_hook(bool /*is_last_joiner*/, const JoinIteration& /*last*/) {}
};

namespace detail {
struct JoinContext;
}

// A class whose per-iteration collectives a joined rank can shadow (DistributedDataParallel,
// ZeroRedundancyOptimizer, or your own). It calls Join::notify_join_context(*this) at the start of
// each iteration's communication, and its join_hook() returns the shadow.
class Joinable {
 public:
  Joinable() = default;
  virtual ~Joinable();
  // Copying would put the copy in the original's Join; moving is for construction only (a Join
  // keeps pointers to its joinables: do not move one while it is inside a Join).
  Joinable(const Joinable&) = delete;
  Joinable& operator=(const Joinable&) = delete;
  Joinable(Joinable&&) = default;
  Joinable& operator=(Joinable&&) = default;

  virtual std::unique_ptr<JoinHook> join_hook(const JoinOptions& options) = 0;
  // The group whose collectives the hook shadows (every joinable of a Join uses the same one).
  virtual Group join_process_group() const = 0;

  // Inside an enabled Join: the latest iteration this rank knows (nullptr outside a Join, or before
  // the first notification).
  const JoinIteration* join_iteration() const;
  // Inside an enabled Join and the first of its joinables (the one that notifies).
  bool is_first_joinable() const;
  // Inside an enabled Join: this joinable's position in the Join's list (0: the first); -1 otherwise.
  int join_position() const;

 private:
  friend class Join;
  std::shared_ptr<detail::JoinContext> context_;
  int position_ = -1;
};

class Join {
 public:
  // Enters the scope: every joinable's hook is made now (so option errors appear before training).
  // All joinables share one group; the first one notifies (list them in the order they communicate).
  Join(std::vector<Joinable*> joinables, JoinOptions options = JoinOptions());
  // If join() was not called and no exception is unwinding, joins here (and may throw, like join()).
  ~Join() noexcept(false);
  Join(const Join&) = delete;
  Join& operator=(const Join&) = delete;

  // Steps 2-3: this rank has no more inputs. Returns when every rank has joined.
  void join();

  // Step 1, called by a joinable each iteration. Does the collective when `joinable` is the first of
  // an enabled Join and this rank has not joined; returns the iteration (nullopt when it did nothing).
  // Throws on every rank with throw_on_early_termination once a rank has run out.
  static const JoinIteration* notify_join_context(Joinable& joinable);
  // Step 1b, called by a joinable before collectives of its own that the first joinable's iterations
  // do not announce (for the first joinable: notify_join_context). Does the collective when
  // `joinable` is in an enabled Join and this rank has not joined; returns null otherwise.
  static const JoinIteration* notify_own_round(Joinable& joinable);
  // Whether this process is inside an enabled Join (not yet joined) whose group shares a rank other
  // than this one with `group`: collectives over `group` that no joinable announces could then wait
  // for a rank that has joined (GradScaler's process_group refuses to run there).
  static bool could_strand(const Group& group);

 private:
  void shadow_until_all_joined();
  void leave();  // the joinables are in no Join any more

  std::vector<Joinable*> joinables_;
  std::vector<std::unique_ptr<JoinHook>> hooks_;
  std::shared_ptr<detail::JoinContext> context_;
  JoinOptions options_;
  bool joined_ = false;
  int uncaught_at_entry_;
};

// The callable form: runs fn (the loop over this rank's batches) inside a Join, then joins.
void join(std::vector<Joinable*> joinables, const JoinOptions& options, const std::function<void()>& fn);

}  // namespace dtrain
