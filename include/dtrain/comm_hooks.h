// Communication hooks for DistributedDataParallel: torch.distributed's DDP comm hooks in C++.
//
//   dtrain::DistributedDataParallel ddp(model);
//   ddp.register_comm_hook(dtrain::Group(), dtrain::bf16_compress_hook);       // half the bytes
//   // or PowerSGD (Vogels et al. 2019), rank 2, plain all-reduce for the first 1000 iterations:
//   dtrain::PowerSGDState state(dtrain::PowerSGDOptions().matrix_approximation_rank(2));
//   ddp.register_comm_hook(state, dtrain::powerSGD_hook);
//
// A hook replaces DDP's averaging all-reduce of a bucket. DDP calls hook(state, bucket) when the
// bucket's gradients are all in its flat buffer (in bucket order, on the thread that runs backward)
// and waits for the returned Future at the end of backward; the Future's tensor (bucket.buffer()'s
// size; any floating dtype) becomes the bucket's gradients. DDP does not divide by the world size
// when a hook is registered: the hook averages. Every rank must issue the same collectives in the
// same order, as with any collective code.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

#include "dtrain/detail/arg.h"
#include "dtrain/process_group.h"

namespace dtrain {

// Note [Comm hook futures]: a Future's continuations (then) run when the Future is waited for, on the
// waiting thread, not when its collective completes on the backend's thread. A continuation may issue
// collectives (PowerSGD's second and third all-reduce), and collectives must be issued in the same
// order on every rank: completion order differs between ranks, program order does not. DDP waits for
// the buckets' futures in bucket order at the end of backward, so every rank runs the hooks (bucket
// order, during backward) and then the continuations (bucket order, at the end) in one order. The
// price: work in a continuation does not overlap backward. Hooks therefore start everything that
// needs only local data before returning (PowerSGD starts its P all-reduce there, beside the
// uncompressed tensors', where PyTorch starts it in a continuation; the values are the same), and a
// hook may advance an earlier bucket's pending work, since hooks too run in one order on every rank
// (PowerSGD starts the previous bucket's Q all-reduce there: Note [PowerSGD pipeline]).
// Waiting twice returns the same tensor; a continuation runs once.
class Future {
 public:
  Future() = default;  // empty: valid() is false
  // A value that is already there.
  explicit Future(at::Tensor value);
  // `value` once `work` is done (e.g. the tensor an asynchronous all_reduce writes).
  Future(Work work, at::Tensor value);

  bool valid() const { return state_ != nullptr; }
  // Runs the pending continuations (in the order they were chained) and returns the value;
  // rethrows a collective's or a continuation's failure.
  at::Tensor wait() const;
  // A Future of fn(this future's value); fn returns a tensor, or a Future (to chain a collective).
  template <typename Fn>
  Future then(Fn fn) const {
    using R = std::decay_t<std::invoke_result_t<Fn&, at::Tensor>>;
    if constexpr (std::is_same_v<R, Future>) {
      return chain(std::function<Future(at::Tensor)>(std::move(fn)));
    } else {
      static_assert(std::is_convertible_v<R, at::Tensor>, "a continuation returns at::Tensor or dtrain::Future");
      return chain([fn = std::move(fn)](at::Tensor v) mutable { return Future(at::Tensor(fn(std::move(v)))); });
    }
  }

 private:
  Future chain(std::function<Future(at::Tensor)> fn) const;
  struct State;
  std::shared_ptr<State> state_;
};

// What a hook receives: one bucket of DDP (PyTorch's GradBucket).
class GradBucket {
 public:
  GradBucket(int index, int bucket_count, at::Tensor buffer, std::vector<at::Tensor> gradients,
             std::vector<at::Tensor> parameters, std::vector<int> parameter_indices);
  int index() const { return index_; }
  // The last bucket of the iteration: DDP calls its hook last (PowerSGD counts iterations here).
  bool is_last() const { return index_ == count_ - 1; }
  // The flat tensor of the bucket's gradients (1-D; every parameter's gradient, in the order of
  // parameter_indices()). A hook may reduce it in place and return it.
  const at::Tensor& buffer() const { return buffer_; }
  // Replaces what buffer() returns from now on (the compression wrappers hand a cast copy to the
  // hook they wrap); gradients() keep viewing the original.
  void set_buffer(at::Tensor buffer) { buffer_ = std::move(buffer); }
  // Per parameter, a view into the original buffer shaped like the parameter.
  const std::vector<at::Tensor>& gradients() const { return gradients_; }
  const std::vector<at::Tensor>& parameters() const { return parameters_; }
  // Indices into DistributedDataParallel::parameters() (registration order).
  const std::vector<int>& parameter_indices() const { return parameter_indices_; }

 private:
  int index_, count_;
  at::Tensor buffer_;
  std::vector<at::Tensor> gradients_, parameters_;
  std::vector<int> parameter_indices_;
};

// A hook with its state bound (what DDP stores).
using CommHook = std::function<Future(GradBucket&)>;

namespace detail {
struct PowerSGDStateImpl;  // the memories, the generator and the pipeline (the library's own)
struct PowerSGDAccess;     // the hooks' way to a PowerSGDState's PowerSGDStateImpl
template <typename T>
T& comm_hook_state(T& s) {
  return s;
}
template <typename T>
T& comm_hook_state(std::reference_wrapper<T>& s) {
  return s.get();
}
// The state is kept by value; std::ref(s) keeps the caller's. PowerSGDState and Group are handles,
// so their copies share everything.
template <typename State, typename Hook>
CommHook bind_comm_hook(State state, Hook hook) {
  return [state = std::move(state), hook = std::move(hook)](GradBucket& bucket) mutable -> Future {
    return hook(comm_hook_state(state), bucket);
  };
}
// The compression wrappers: bucket.set_buffer(buffer cast to dtype), run the wrapped hook, copy its
// result into that cast buffer.
Future compress_wrapped(at::ScalarType dtype, GradBucket& bucket, const std::function<Future()>& hook);
}  // namespace detail

// --- built-in hooks (state: the group to average over; Group() is the world) ----------------------
// Averages like DDP without a hook (divide by the group size, SUM all-reduce): the same bits.
Future allreduce_hook(const Group& group, GradBucket& bucket);
// Casts to float16 (bfloat16), divides by the group size, all-reduces (SUM) in that type and copies
// the result back into the bucket: half the bytes. PyTorch's order (divide before the sum, so the
// sum cannot overflow float16).
Future fp16_compress_hook(const Group& group, GradBucket& bucket);
// On Gloo of LibTorch 1.x, which cannot all-reduce bfloat16, the bfloat16 values are all-gathered
// instead and summed on every rank in rank order, rounding after each addition: the same bytes as
// a bfloat16 all-reduce on 2 ranks, (n - 1) x the bucket on n ranks (Note [bfloat16 on Gloo 1.x]).
Future bf16_compress_hook(const Group& group, GradBucket& bucket);

// hook(state, bucket) run on the bucket cast to float16 (bfloat16); the result is cast back.
//   ddp.register_comm_hook(state, dtrain::fp16_compress_wrapper(dtrain::powerSGD_hook));
template <typename Hook>
auto fp16_compress_wrapper(Hook hook) {
  return [hook = std::move(hook)](auto& state, GradBucket& bucket) -> Future {
    return detail::compress_wrapped(at::kHalf, bucket, [&] { return Future(hook(state, bucket)); });
  };
}
template <typename Hook>
auto bf16_compress_wrapper(Hook hook) {
  return [hook = std::move(hook)](auto& state, GradBucket& bucket) -> Future {
    return detail::compress_wrapped(at::kBFloat16, bucket, [&] { return Future(hook(state, bucket)); });
  };
}

// --- PowerSGD (Vogels, Karimireddy, Jaggi 2019), as PyTorch's powerSGD_hook.py -------------------
struct PowerSGDOptions {
  // The group to average over (default: the world).
  DTRAIN_ARG(Group, process_group, Group())
  // r: each compressed gradient matrix M (n x m) travels as P (n x r) and Q (m x r).
  DTRAIN_ARG(int64_t, matrix_approximation_rank, 1)
  // Plain all-reduce for the first iterations (synchronized backwards), then PowerSGD.
  DTRAIN_ARG(int64_t, start_powerSGD_iter, 1000)
  // A matrix is compressed only when (n + m) * r * min_compression_rate < n * m; the others (and
  // every 1-D tensor) are all-reduced uncompressed, together.
  DTRAIN_ARG(double, min_compression_rate, 2)
  // Adds the previous step's compression error to the gradient before compressing.
  DTRAIN_ARG(bool, use_error_feedback, true)
  // Starts each step's power iteration from the previous step's Q instead of a random one.
  DTRAIN_ARG(bool, warm_start, true)
  // Added to the column norms in Gram-Schmidt (0: none), against division by zero.
  DTRAIN_ARG(double, orthogonalization_epsilon, 0)
  // Seeds the generator of the random initial Qs (the same on every rank).
  DTRAIN_ARG(uint32_t, random_seed, 0)
  // Multiplies same-shaped matrices of a bucket as one batch (PyTorch's batch_tensors_with_same_shape).
  DTRAIN_ARG(bool, batch_tensors_with_same_shape, false)
  // Not in PyTorch. On the CPU each compressed matrix is processed in blocks of rows of about this
  // many bytes, so that a block read from memory stays in a core's L2 cache for all the work of its
  // pass (PowerSGD there is bound by memory traffic); 0: the whole matrix as one block. Results
  // differ from one block only in the order of floating-point additions.
  DTRAIN_ARG(int64_t, cpu_block_bytes, 256 << 10)
};

// PowerSGD's options and its memory across iterations. A handle: copies share the state, so the one
// registered with DDP and the caller's are the same (as a Python object).
class PowerSGDState {
 public:
  // Throws on a bad option (one line naming it), e.g. start_powerSGD_iter <= 1 with error feedback
  // or warm start (PyTorch's rule).
  explicit PowerSGDState(PowerSGDOptions options = PowerSGDOptions());
  const PowerSGDOptions& options() const;
  // Synchronized iterations counted so far (the last bucket's hook counts them).
  int64_t iter() const;
  // Per bucket index (undefined tensors before PowerSGD first ran on that bucket): the error-feedback
  // memory, and the flat P and Q factors of the last step.
  at::Tensor error(int bucket) const;
  at::Tensor p_memory(int bucket) const;
  at::Tensor q_memory(int bucket) const;
  // Elements before and after compression over all PowerSGD steps so far, and their ratio.
  struct CompressionStats {
    double rate = 0;
    int64_t numel_before = 0, numel_after = 0;
  };
  CompressionStats compression_stats() const;

 private:
  friend struct detail::PowerSGDAccess;
  std::shared_ptr<detail::PowerSGDStateImpl> impl_;
};

// Layer-wise PowerSGD: each gradient of a bucket viewed as a matrix (first dimension x the rest) and
// compressed when worth it (min_compression_rate); the rest all-reduced as they are.
Future powerSGD_hook(PowerSGDState& state, GradBucket& bucket);
// The whole bucket as one square matrix (zero-padded): faster, usually less accurate (PyTorch's
// advice: only with rank 1).
Future batched_powerSGD_hook(PowerSGDState& state, GradBucket& bucket);

}  // namespace dtrain
