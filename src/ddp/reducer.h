// The reducer: gradient buckets, readiness hooks and the overlapped all-reduce.
//
// Per synchronized iteration:
//   1. prepare_for_backward(unused): called after a forward under sync. Records which parameters
//      will get no gradient (find_unused_parameters / static_graph) and arms the hooks.
//   2. The first hook to fire in backward marks the unused parameters ready (their bucket slots
//      hold what their .grad() kept from no_sync backwards, or zeros, as PyTorch's) and queues
//      finalize() to run at the end of this backward.
//   3. Each parameter's hook (after AccumulateGrad) writes .grad() divided by the group size into
//      its bucket slot, one pass for the copy and the division (divided in place when the gradient
//      already is the slot: gradient_as_bucket_view), and counts the bucket down. A bucket at zero
//      is ready; ready buckets are launched strictly in bucket order: the flat buffer is
//      all-reduced (SUM): asynchronously, except the last bucket, which has nothing left to
//      overlap with and is reduced on this thread, in the gradients themselves where it can be
//      (Note [Last bucket in place]: its slots are then never filled). With a communication hook
//      the slots are filled undivided, and the hook gets the bucket instead and returns a Future.
//   4. finalize(): every bucket must have been launched — otherwise the parameters that got no
//      gradient are named in the error (PyTorch's message, with the find_unused_parameters
//      remedy). With unused-parameter tracking, a small MAX all-reduce tells which parameters were
//      used on some rank (got a gradient since the last synchronized backward, as PyTorch counts). Then all works (or
//      hook futures, in bucket order: Note [Comm hook futures]) are waited for bucket by bucket, a hook's result copied
//      into its bucket and the bucket's averaged values written back (.grad() = the slot view with
//      gradient_as_bucket_view, else copied into .grad()). Parameters unused on every rank keep their .grad()
//      untouched, as in PyTorch.
#pragma once

#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "compat/autograd_compat.h"
#include "dtrain/ddp.h"

namespace dtrain::ddp {

struct Bucket {
  std::vector<int> params;        // parameter indices, in the order they sit in the buffer
  at::Tensor buffer;              // flat, dtype/device of its parameters
  std::vector<at::Tensor> views;  // views[k] is params[k]'s slot, shaped like the parameter
  int pending = 0;                // gradients not yet ready this iteration
  bool launched = false;
  bool in_place = false;  // reduced in the gradients themselves (Note [Last bucket in place])
  Work work;
  Future future;                            // with a communication hook, instead of work
  std::shared_ptr<GradBucket> grad_bucket;  // what the hook got: alive until its future is waited for
  // Set by the work's completion callback (0 until then); a fresh one per launch, so a late
  // callback never lands in the next iteration.
  std::shared_ptr<std::atomic<int64_t>> done_ns;
};

class Reducer {
 public:
  // pytorch_peers: Note [DDP with PyTorch peers] (src/ddp/pytorch_peers.h); static_graph matters only there.
  Reducer(std::vector<at::Tensor> params, std::vector<std::string> names,
          std::vector<std::vector<int>> bucket_assignment, Group group, bool gradient_as_bucket_view, bool track_unused,
          bool pytorch_peers = false, bool static_graph = false);
  ~Reducer();

  // Step 1. unused: per parameter, true when this forward will give it no gradient.
  void prepare_for_backward(std::vector<bool> unused);
  // Once, before the first synchronized backward.
  void set_comm_hook(CommHook hook);
  // Forwards without sync (no_sync) or outside DDP disarm the hooks.
  void disarm() { armed_ = false; }
  // What DDP's own all-reduce divides the summed gradients by (the group's size, or under Join
  // the ranks active in this iteration; set before each synchronized forward).
  void set_divisor(int divisor);
  // A joined rank's backward (Join): every bucket's collective in bucket order with zeros as this
  // rank's gradients, the unused-parameter exchange, then the results become .grad() as in step 4,
  // so this rank ends with the active ranks' averaged gradients.
  void shadow_backward();

  // The order in which the last synchronized backward made the gradients ready, parameters it did not
  // use last (Python's rebuilt_params); empty until one backward recorded every parameter.
  std::vector<int> ready_order() const;
  // Stops recording the order (the buckets were rebuilt: Python rebuilds once).
  void stop_recording_order() { record_order_ = false; }
  // A joined rank's backward under Python's Join: every bucket's all-reduce of zeros in bucket order,
  // then (find_unused_parameters) the used map's; the results are dropped, as Python drops them.
  void python_shadow_backward(bool find_unused_parameters);
  // Python's _push_all_rebuilt_params: a joined rank offers the registration order for the rebuild.
  void python_offer_registration_order();
  // New buckets (between iterations): gradients that are bucket views move into their new slots.
  void set_buckets(std::vector<std::vector<int>> assignment);

  const std::vector<Bucket>& buckets() const { return buckets_; }
  std::vector<DDPEvent> events() const;
  void set_event_hook(DDPEventHook hook);

 private:
  void rehook_replaced_parameters();
  void on_grad_ready(int index);  // steps 2-3
  void fill_slot(int index);      // .grad() into its bucket slot, divided unless a comm hook takes it
  bool defers_last_bucket() const;
  bool reduce_last_in_place(Bucket& b);
  void mark_ready(int index);
  void launch_ready_buckets();
  void launch_with_comm_hook(Bucket& b, size_t index);
  void take_hook_result(Bucket& b, size_t index);
  void finalize();                                                             // step 4
  void write_grads(const std::vector<int64_t>& used_anywhere, size_t bucket);  // its parameters' .grad()
  void reset_iteration();
  void abandon_iteration();  // waits for what was launched (ignoring failures), then resets
  void record(DDPEvent::Kind kind, int index, int64_t time_ns = 0);  // 0: now
  // With PyTorch peers (src/ddp/reducer_pytorch_peers.cpp).
  bool python_before_hook(int index);   // true: this hook does nothing more
  bool python_counted_down(int index);  // static_graph_after_first_iteration: the parameter's last hook of the backward
  void python_launch_delayed();         // static_graph's first backward, at its end
  std::vector<int64_t> python_used_anywhere();
  void begin_backward();  // step 2

  // What the mode and the iteration mean for a step (named as PyTorch's reducer names them).
  // Every call is Python DDP's (Note [DDP with PyTorch peers]).
  bool follows_python_ddp() const { return pytorch_peers_; }
  // Python's reducer multiplies each gradient by 1/size on its way into the bucket (dtrain's divides).
  bool scales_by_reciprocal() const { return pytorch_peers_; }
  // gradient_as_bucket_view: Python leaves an undefined gradient undefined instead of making it its slot.
  bool leaves_undefined_grads() const { return pytorch_peers_; }
  // Python rebuilds the buckets once, in the order the first backward made the gradients ready.
  bool should_rebuild_buckets() const { return pytorch_peers_ && (static_graph_ || !track_unused_); }
  // find_unused_parameters without static_graph: the used map is exchanged after every backward.
  bool dynamic_graph_find_unused() const { return track_unused_ && !static_graph_; }
  // static_graph's first backward only counts the hooks, and reduces everything at its end.
  bool static_graph_first_iteration() const { return static_graph_ && iterations_ == 1; }
  // Afterwards a parameter is ready at the last of the hooks the first backward counted.
  bool static_graph_after_first_iteration() const { return static_graph_ && iterations_ > 1; }

  std::vector<at::Tensor> params_;
  std::vector<std::string> names_;
  std::vector<compat::NodePtr> accumulators_;  // kept alive: the hooks live on them
  std::vector<uintptr_t> hook_keys_;
  std::vector<Bucket> buckets_;
  std::vector<int> bucket_of_;  // param -> bucket
  std::vector<int> slot_of_;    // param -> index inside its bucket
  Group group_;
  int group_size_;
  int divisor_;
  at::Tensor divisor_tensor_;     // divisor_ as a wrapped number: each slot is divided as it is filled
  at::Tensor reciprocal_tensor_;  // 1.0 / divisor_ (double), as Python's reducer multiplies
  bool as_view_;
  bool track_unused_;
  CommHook comm_hook_;
  bool ever_started_ = false;  // a synchronized backward has begun (no hook may be registered after)

  // With PyTorch peers only.
  bool pytorch_peers_;
  bool static_graph_;          // only with pytorch_peers_
  int iterations_ = 0;         // synchronized forwards (Python's num_iterations_)
  at::Tensor local_used_;      // int32: a gradient was produced since the last synchronized backward
  at::Tensor local_used_dev_;  // the map as last all-reduced, in place (Python's local_used_map_dev_)
  Work used_work_;             // static_graph's first backward: the used map's all-reduce
  bool used_in_flight_ = false;
  std::vector<int> hook_counts_;  // static_graph: hooks per parameter in the first backward
  std::vector<int> hooks_left_;   // ... left in this one
  std::vector<int> static_unused_;
  bool record_order_ = false;
  std::vector<int> order_;

  // Per-iteration state (the autograd engine runs CPU hooks on the thread that called backward;
  // a mutex keeps it safe for device threads too).
  std::mutex mu_;
  bool armed_ = false;
  bool started_ = false;  // a hook fired in this backward
  std::vector<bool> ready_;
  std::vector<bool> unused_;
  size_t next_to_launch_ = 0;
  int64_t waiting_since_ns_ = 0;  // when the last bucket was launched (as a blocking call)
  std::vector<DDPEvent> events_;
  DDPEventHook hook_;
  std::exception_ptr error_;
};

}  // namespace dtrain::ddp
