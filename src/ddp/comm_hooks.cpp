// Future, GradBucket and the default communication hooks (allreduce, fp16 / bf16 compression and
// their wrappers). PowerSGD is in powersgd.cpp.
#include <cstring>
#include <mutex>

#include <ATen/ATen.h>

#include "comm/capabilities.h"
#include "comm/state.h"
#include "comm/tags.h"
#include "compat/c10d_compat.h"
#include "ddp/hook_collectives.h"
#include "dtrain/comm_hooks.h"

namespace dtrain {

struct Future::State {
  std::mutex mu;
  bool done = false;
  at::Tensor value;
  std::exception_ptr error;
  Work work;                            // waited for first (may be empty)
  std::function<at::Tensor()> produce;  // then: the parent's value through the continuation
};

Future::Future(at::Tensor value) : state_(std::make_shared<State>()) {
  state_->value = std::move(value);
  state_->done = true;
}

Future::Future(Work work, at::Tensor value) : state_(std::make_shared<State>()) {
  state_->work = std::move(work);
  state_->value = std::move(value);
}

at::Tensor Future::wait() const {
  DTRAIN_CHECK(state_, "Future::wait on an empty Future: a communication hook must return the Future of its work");
  std::lock_guard<std::mutex> g(state_->mu);
  if (!state_->done) {
    // Note [Comm hook futures]: the continuation runs here, on the waiting thread.
    try {
      state_->work.wait();
      if (state_->produce) state_->value = state_->produce();
    } catch (...) {
      state_->error = std::current_exception();
    }
    state_->produce = nullptr;  // drops the parent chain
    state_->done = true;
  }
  if (state_->error) std::rethrow_exception(state_->error);
  return state_->value;
}

Future Future::chain(std::function<Future(at::Tensor)> fn) const {
  DTRAIN_CHECK(state_, "Future::then on an empty Future: chain continuations on a hook's returned Future");
  Future next;
  next.state_ = std::make_shared<State>();
  next.state_->produce = [parent = *this, fn = std::move(fn)]() mutable {
    Future f = fn(parent.wait());
    DTRAIN_CHECK(f.valid(),
                 "a Future::then continuation returned an empty Future: return a tensor or a Future "
                 "of one");
    return f.wait();
  };
  return next;
}

GradBucket::GradBucket(int index, int bucket_count, at::Tensor buffer, std::vector<at::Tensor> gradients,
                       std::vector<at::Tensor> parameters, std::vector<int> parameter_indices)
    : index_(index),
      count_(bucket_count),
      buffer_(std::move(buffer)),
      gradients_(std::move(gradients)),
      parameters_(std::move(parameters)),
      parameter_indices_(std::move(parameter_indices)) {}

namespace {

// Note [bfloat16 on Gloo 1.x]: LibTorch 1.x's ProcessGroupGloo rejects bfloat16 ("Invalid scalar
// type"), so the bfloat16 hooks would fail on the path between hosts, the one that needs them most.
// Instead of refusing, the bfloat16 bytes are all-gathered (as bytes, which Gloo takes) and every rank
// sums them in group-rank order, rounding to bfloat16 after each addition as Gloo 2.x does: every rank
// computes the same bits, and on 2 ranks as many bytes travel as in a bfloat16 all-reduce. On n ranks
// an all-gather moves (n - 1) buckets per rank where a ring all-reduce moves 2 (n - 1) / n, so the
// saving shrinks with n (none left at 4 ranks against float32). LibTorch 2.x and the shared-memory
// group reduce bfloat16 themselves.
bool needs_gathered_bf16(const at::Tensor& t, const Group& group) {
  return t.scalar_type() == at::kBFloat16 &&
         !comm::capabilities(group).unsupported(c10d::OpType::ALLREDUCE, t, c10d::ReduceOp::SUM).empty();
}

}  // namespace

namespace ddp {

Future sum_future(at::Tensor t, const Group& group) {
  if (!needs_gathered_bf16(t, group)) return Future(all_reduce(t, ReduceOp::SUM, group, /*async_op=*/true), t);
  const int64_t bytes = t.numel() * static_cast<int64_t>(t.element_size());
  at::Tensor contiguous = t.contiguous();
  at::Tensor mine = at::empty({bytes}, t.options().dtype(at::kByte));
  std::memcpy(mine.data_ptr(), contiguous.data_ptr(), static_cast<size_t>(bytes));
  std::vector<at::Tensor> all;
  for (int r = 0; r < group.size(); ++r) all.push_back(at::empty_like(mine));
  Work w = all_gather(all, mine, group, /*async_op=*/true);
  return Future(w, t).then([t, all](const at::Tensor&) mutable {
    at::NoGradGuard ng;
    at::Tensor acc = at::empty_like(t, at::MemoryFormat::Contiguous);
    for (size_t r = 0; r < all.size(); ++r) {
      at::Tensor part = at::empty_like(acc);
      std::memcpy(part.data_ptr(), all[r].data_ptr(), static_cast<size_t>(all[r].numel()));
      if (r == 0)
        acc.copy_(part);
      else
        acc.copy_(acc.to(at::kFloat).add_(part.to(at::kFloat)));  // rounds once per addition
    }
    t.copy_(acc);
    return t;
  });
}

// Note [Small sums as exchanges]: where a backend's all-reduce of a tiny tensor costs latency, not
// bytes (Gloo over TCP: a 4 KB all-reduce takes many times as long as a 4 KB send to the other rank;
// bench_allreduce, bench_p2p), a small tensor is sent to every other member and received from each,
// then summed on every rank in group-rank order: the same additions everywhere, so every rank gets
// the same bits (on 2 ranks exactly the all-reduce's sum, a + b being b + a). The backend says up to
// how many bytes of copies that pays (Capabilities::exchange_sum_bytes: 0 for the shared-memory
// group, whose all-reduce is fast already, and NCCL). The messages carry a tag of their own
// (comm/tags.h), and every rank issues its sends and receives in the same order.
Future small_sum_future(at::Tensor t, const Group& group) {
  const int64_t bytes = t.numel() * static_cast<int64_t>(t.element_size());
  const int64_t most = comm::capabilities(group).exchange_sum_bytes();
  if (most == 0 || (group.size() - 1) * bytes > most || !t.is_contiguous() || needs_gathered_bf16(t, group))
    return sum_future(t, group);
  const std::vector<int>& ranks = group.ranks();
  const int me = group.rank();
  std::vector<at::Tensor> parts(ranks.size());
  std::vector<Work> works;
  for (size_t r = 0; r < ranks.size(); ++r) {
    if (static_cast<int>(r) == me) continue;
    parts[r] = at::empty_like(t);
    works.push_back(irecv(parts[r], ranks[r], group, comm::kSmallSumTag));
    works.push_back(isend(t, ranks[r], group, comm::kSmallSumTag));
  }
  if (works.empty()) return Future(t);
  return Future(works.back(), t).then([t, me, parts, works](const at::Tensor&) mutable {
    at::NoGradGuard ng;
    for (auto& w : works) w.wait();
    at::Tensor sum = (me == 0 ? t : parts[0]).clone();
    for (size_t r = 1; r < parts.size(); ++r) sum.add_(static_cast<int>(r) == me ? t : parts[r]);
    t.copy_(sum);
    return t;
  });
}

}  // namespace ddp

Future allreduce_hook(const Group& group, GradBucket& bucket) {
  at::Tensor t = bucket.buffer();
  {
    at::NoGradGuard ng;
    t.div_(group.size());
  }
  return ddp::sum_future(t, group);
}

namespace {

Future cast_compress_hook(at::ScalarType dtype, const Group& group, GradBucket& bucket) {
  at::Tensor buffer = bucket.buffer();
  at::Tensor compressed;
  {
    at::NoGradGuard ng;
    compressed = buffer.to(dtype).div_(group.size());
  }
  return ddp::sum_future(compressed, group).then([buffer](const at::Tensor& sum) {
    at::NoGradGuard ng;
    buffer.copy_(sum);  // decompress in place: no second full-size buffer
    return buffer;
  });
}

}  // namespace

Future fp16_compress_hook(const Group& group, GradBucket& bucket) {
  return cast_compress_hook(at::kHalf, group, bucket);
}
Future bf16_compress_hook(const Group& group, GradBucket& bucket) {
  return cast_compress_hook(at::kBFloat16, group, bucket);
}

namespace detail {

Future compress_wrapped(at::ScalarType dtype, GradBucket& bucket, const std::function<Future()>& hook) {
  {
    at::NoGradGuard ng;
    bucket.set_buffer(bucket.buffer().to(dtype));
  }
  at::Tensor compressed = bucket.buffer();
  Future result = hook();
  DTRAIN_CHECK(result.valid(),
               "the hook inside a compression wrapper returned an empty Future: return the Future of "
               "its work");
  return result.then([compressed](const at::Tensor& value) {
    at::NoGradGuard ng;
    if (!value.is_same(compressed)) compressed.copy_(value);
    return compressed;  // DDP casts it back into the bucket
  });
}

}  // namespace detail
}  // namespace dtrain
