// DDP overlaps communication with backward, shown from outside DDP's own event log.
//
// The model's first layer is slow in backward, and it is the last whose gradient backward computes.
// The last layer's gradients form the first bucket. With gradient_as_bucket_view the gradient is a view
// into its bucket, which the all-reduce averages in place, so the slow layer's backward can watch that
// memory: the average must arrive there while backward is still running. A DDP that launched its
// all-reduces only at the end of backward never shows it there.
//
// The other ranks start their backward late, so rank 0's first all-reduce cannot finish before they
// join it: rank 0 must meanwhile go on with backward (fc2, fc1) and reach the slow layer before the
// average arrives. A DDP that waited for each bucket in its hook (communication without overlap)
// would reach it only afterwards.
//
// Run on 2 ranks over shared memory and over Gloo alone (DTRAIN_SHM=0, the path between hosts).
#include <chrono>
#include <cmath>
#include <functional>
#include <thread>

#include <torch/autograd.h>
#include <torch/nn/functional/linear.h>
#include <torch/nn/modules/linear.h>

#include "dist_main.h"
#include "dtrain/ddp.h"

using namespace dtrain;
using Clock = std::chrono::steady_clock;

namespace {

constexpr int kBatch = 4;
// Delays of a hundred milliseconds or more against margins of 50 ms: a loaded 2-core machine's
// scheduling delays (a few ms, rarely more) must not decide the outcome.
constexpr auto kPeerDelay = std::chrono::milliseconds(200);      // how late ranks other than 0 start backward
constexpr auto kSlowAfterSeen = std::chrono::milliseconds(100);  // the slow layer's work after the average came
constexpr auto kMargin = std::chrono::milliseconds(50);
// How long the slow layer waits for the average at most; a DDP that does not overlap fails here.
constexpr auto kPollLimit = std::chrono::seconds(5);

// Where a CallInBackward sits: on the model's output (the first node backward runs) or in front of
// fc1.weight (the last gradient backward computes).
enum Where { kOutput, kFirstLayer, kPlaces };
std::function<void()> g_in_backward[kPlaces];  // set per step; empty: pass straight through

// Identity in forward; in backward it runs g_in_backward[kWhere] before passing the gradient on, so
// everything behind it in the graph waits for it.
template <int kWhere>
struct CallInBackward : torch::autograd::Function<CallInBackward<kWhere>> {
  static at::Tensor forward(torch::autograd::AutogradContext*, const at::Tensor& x) { return x.clone(); }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext*,
                                                 torch::autograd::variable_list grads) {
    if (g_in_backward[kWhere]) g_in_backward[kWhere]();
    return {grads[0]};
  }
};

// fc1 (its weight behind the slow layer's hook) -> fc2 -> fc3 -> the output's hook. Backward reaches
// fc3 first and fc1.weight last.
struct SlowFirstLayerImpl : torch::nn::Module {
  SlowFirstLayerImpl() {
    fc1 = register_module("fc1", torch::nn::Linear(16, 64));
    fc2 = register_module("fc2", torch::nn::Linear(64, 64));
    fc3 = register_module("fc3", torch::nn::Linear(64, 8));
  }
  at::Tensor forward(const at::Tensor& x) {
    auto w1 = CallInBackward<kFirstLayer>::apply(fc1->weight);
    auto h = torch::relu(torch::nn::functional::linear(x, w1, fc1->bias));
    return CallInBackward<kOutput>::apply(fc3(torch::relu(fc2(h))));
  }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr}, fc3{nullptr};
};
TORCH_MODULE(SlowFirstLayer);

// Whether every element is within 1e-5 of `value`. The memory is written meanwhile by the
// communication thread: watching the average arrive during backward is the point of this test, so the
// read is deliberately unsynchronized (volatile: each poll reads memory). ThreadSanitizer would
// rightly report it; this one function is left uninstrumented (the build-tsan tree).
__attribute__((no_sanitize("thread"))) bool all_near(const volatile float* p, int64_t n, double value) {
  for (int64_t i = 0; i < n; ++i)
    if (std::abs(p[i] - value) > 1e-5 * value) return false;
  return true;
}

int64_t ms_between(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(b - a).count();
}

}  // namespace

TEST(DDPOverlap, DefaultGroupRunsOverTheTransportThisRunTests) { expect_default_group_transport_from_env(); }

TEST(DDPOverlap, FirstBucketIsAveragedWhileTheSlowFirstLayerIsStillInBackward) {
  SlowFirstLayer model;
  // Buckets (reverse registration order): {fc3.bias, fc3.weight} (2 KiB > first cap 1 KiB),
  // {fc2.bias, fc2.weight} (16 KiB > cap 10 KiB), {fc1.bias, fc1.weight}.
  DistributedDataParallel ddp(
      model, DDPOptions().first_bucket_cap_mb(0.001).bucket_cap_mb(0.01).gradient_as_bucket_view(true));
  ASSERT_EQ(ddp.bucket_param_indices(), (std::vector<std::vector<int>>{{5, 4}, {3, 2}, {1, 0}}));
  // With gradient_as_bucket_view, fc3.bias's gradient is its slot in bucket 0, whatever .grad() is
  // later set to; watch that memory.
  const at::Tensor slot = model->fc3->bias.grad();
  ASSERT_TRUE(slot.defined());
  // loss = sum(out * 2^rank): fc3.bias's local gradient is kBatch * 2^rank in every element, and the
  // average kBatch * (2^N - 1) / N, which is neither a rank's own value nor that divided by N.
  const int n = world_size();
  const double average = kBatch * (std::pow(2.0, n) - 1) / n;
  auto averaged = [&] { return all_near(slot.data_ptr<float>(), slot.numel(), average); };

  std::vector<DDPEvent> events;  // as they happen, on this (the backward) thread
  ddp.set_event_hook([&](const DDPEvent& e) { events.push_back(e); });
  auto launched = [&](int bucket) {
    for (const auto& e : events)
      if (e.kind == DDPEvent::Kind::kBucketLaunched && e.index == bucket) return true;
    return false;
  };

  for (int step = 0; step < 3; ++step) {
    for (auto& p : model->parameters()) p.grad().zero_();  // (keeps the bucket views)
    events.clear();
    bool in_slow = false, seen = false, first_launched = false, last_launched = true;
    Clock::time_point entered_slow, seen_at;
    if (rank() != 0) g_in_backward[kOutput] = [] { std::this_thread::sleep_for(kPeerDelay); };
    g_in_backward[kFirstLayer] = [&] {
      in_slow = true;
      entered_slow = Clock::now();
      first_launched = launched(0);
      last_launched = launched(2);  // fc1.weight's gradient does not exist yet
      const auto limit = entered_slow + kPollLimit;
      while (!(seen = averaged()) && Clock::now() < limit) std::this_thread::sleep_for(std::chrono::milliseconds(1));
      seen_at = Clock::now();
      if (seen) std::this_thread::sleep_for(kSlowAfterSeen);
    };
    auto out = ddp(at::randn({kBatch, 16}));
    (out * std::pow(2.0, rank())).sum().backward();
    const auto backward_returned = Clock::now();
    for (auto& f : g_in_backward) f = nullptr;

    ASSERT_TRUE(in_slow) << "the slow layer's backward never ran";
    EXPECT_TRUE(first_launched) << "step " << step << ": bucket 0 was not launched before the slow layer";
    EXPECT_FALSE(last_launched) << "step " << step << ": the last bucket launched before its gradient existed";
    ASSERT_TRUE(seen) << "step " << step << ": bucket 0's average never reached its gradient while the slow "
                      << "layer held backward for " << kPollLimit.count() << " s: DDP did not overlap "
                      << "the all-reduce with backward";
    if (rank() == 0) {  // the others joined the all-reduce late: rank 0 computed on in the meantime
      EXPECT_GE(ms_between(entered_slow, seen_at), kMargin.count())
          << "step " << step << ": rank 0 reached the slow layer only once bucket 0 was done, though the "
          << "other ranks started backward " << kPeerDelay.count() << " ms late: DDP waited for the "
          << "all-reduce inside backward instead of overlapping it";
    }
    EXPECT_GE(ms_between(seen_at, backward_returned), kMargin.count()) << "step " << step;
    EXPECT_TRUE(averaged()) << "step " << step << ": backward returned another gradient";

    // DDP's own log must agree: bucket 0 done (its completion time) well before backward ended.
    int64_t done_ns = -1, end_ns = -1;
    for (const auto& e : ddp.last_backward_events()) {
      if (e.kind == DDPEvent::Kind::kBucketDone && e.index == 0) done_ns = e.time_ns;
      if (e.kind == DDPEvent::Kind::kBackwardEnd) end_ns = e.time_ns;
    }
    ASSERT_GE(done_ns, 0);
    ASSERT_GE(end_ns, 0);
    EXPECT_GE((end_ns - done_ns) / 1000000, kMargin.count())
        << "step " << step << ": DDP's log puts bucket 0's completion " << (end_ns - done_ns) / 1000000
        << " ms before the end of backward";
  }
}

DTRAIN_DIST_TEST_MAIN()
