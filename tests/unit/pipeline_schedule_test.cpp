// Pipeline schedules without ranks: every rank's action list of every schedule is run in a simulated
// pipeline (FIFO channels between ranks, as Gloo's per-pair-and-tag order) that checks each message is
// the one its reader expects, that nothing deadlocks, that every micro-batch gets its F, B (and W)
// exactly once on every stage, the stored activations the schedules promise, and, with unit costs,
// the step times of the papers. Also the split backward (B then W) against the full one.
#include <algorithm>
#include <deque>
#include <map>
#include <sstream>
#include <string>
#include <tuple>

#include <gtest/gtest.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/linear.h>

#include "dtrain/pipeline.h"
#include "pipeline/split_backward.h"
#include "matchers.h"

using dtrain::Schedule;
using dtrain::pipeline::Action;
using dtrain::pipeline::make_schedule;

namespace {

std::string str(const std::vector<Action>& actions) {
  std::string out;
  for (const auto& a : actions) out += to_string(a) + " ";
  return out;
}

struct SimResult {
  bool completed = false;
  std::string error;                    // the first violation
  double makespan = 0;                  // with the given action costs
  std::vector<int64_t> max_unfinished;  // per rank: most (stage, micro-batch) between F and their last action
  std::vector<int64_t> max_before_b;    // per rank: most between F and B
};

// Runs the p ranks' schedules. Costs are per action of one stage (a rank's chunk).
SimResult simulate(Schedule schedule, int p, int v, int64_t m, double f, double b, double w) {
  const int stages = p * v;
  const bool split = schedule == Schedule::kZeroBubbleH1;
  std::vector<std::vector<Action>> plan(p);
  for (int r = 0; r < p; ++r) plan[r] = make_schedule(schedule, p, r, m, v);
  // Channels: (from rank, to rank, 0 activation / 1 gradient) -> queue of (stage, micro-batch, arrival).
  std::map<std::tuple<int, int, int>, std::deque<std::tuple<int, int64_t, double>>> chan;
  std::map<std::tuple<char, int, int64_t>, int> done;  // (kind, stage, micro-batch) -> count
  std::vector<size_t> pc(p, 0);
  std::vector<double> clock(p, 0);
  std::vector<int64_t> unfinished(p, 0), before_b(p, 0);
  SimResult res;
  res.max_unfinished.assign(p, 0);
  res.max_before_b.assign(p, 0);
  auto fail = [&](const std::string& e) {
    if (res.error.empty()) res.error = e;
  };
  for (bool progress = true; progress && res.error.empty();) {
    progress = false;
    for (int r = 0; r < p; ++r) {
      while (pc[r] < plan[r].size() && res.error.empty()) {
        const Action& a = plan[r][pc[r]];
        const int k = a.stage;
        const int64_t i = a.micro_batch;
        const std::string where = "rank " + std::to_string(r) + " " + to_string(a) + "@" + std::to_string(k);
        if (k % p != r) fail(where + ": stage not held by this rank");
        double ready = clock[r];
        if (a.kind == Action::kForward && k > 0) {
          auto& q = chan[{(k - 1) % p, r, 0}];
          if (q.empty()) break;
          if (std::get<0>(q.front()) != k - 1 || std::get<1>(q.front()) != i) fail(where + ": activation out of order");
          ready = std::max(ready, std::get<2>(q.front()));
          q.pop_front();
        }
        if (a.kind == Action::kBackward && k < stages - 1) {
          auto& q = chan[{(k + 1) % p, r, 1}];
          if (q.empty()) break;
          if (std::get<0>(q.front()) != k + 1 || std::get<1>(q.front()) != i) fail(where + ": gradient out of order");
          ready = std::max(ready, std::get<2>(q.front()));
          q.pop_front();
        }
        if (a.kind == Action::kBackward && !done.count({'F', k, i})) fail(where + ": backward before forward");
        if (a.kind == Action::kWeight && !done.count({'B', k, i})) fail(where + ": W before B");
        if (a.kind == Action::kWeight && !split) fail(where + ": W in a schedule without split backward");
        const char kind = a.kind == Action::kForward ? 'F' : a.kind == Action::kBackward ? 'B' : 'W';
        if (++done[{kind, k, i}] > 1) fail(where + ": twice");
        clock[r] = ready + (kind == 'F' ? f : kind == 'B' ? b : w);
        if (kind == 'F' && k < stages - 1) chan[{r, (k + 1) % p, 0}].emplace_back(k, i, clock[r]);
        if (kind == 'B' && k > 0) chan[{r, (k - 1) % p, 1}].emplace_back(k, i, clock[r]);
        if (kind == 'F') ++unfinished[r], ++before_b[r];
        if (kind == 'B') --before_b[r];
        if ((kind == 'B' && !split) || kind == 'W') --unfinished[r];
        res.max_unfinished[r] = std::max(res.max_unfinished[r], unfinished[r]);
        res.max_before_b[r] = std::max(res.max_before_b[r], before_b[r]);
        ++pc[r];
        progress = true;
      }
    }
  }
  for (int r = 0; r < p && res.error.empty(); ++r)
    if (pc[r] < plan[r].size()) fail("deadlock: rank " + std::to_string(r) + " waits at " + to_string(plan[r][pc[r]]));
  for (int k = 0; k < stages && res.error.empty(); ++k)
    for (int64_t i = 0; i < m; ++i)
      for (char kind : std::string(split ? "FBW" : "FB"))
        if (done[{kind, k, i}] != 1) {
          // A stream, not std::string's operator+: GCC 12 sees a false overflow in that concatenation.
          std::ostringstream what;
          what << kind << " missing for stage " << k;
          fail(what.str());
        }
  res.completed = res.error.empty();
  res.makespan = *std::max_element(clock.begin(), clock.end());
  return res;
}

TEST(PipelineSchedule, KnownOrders) {
  EXPECT_EQ(str(make_schedule(Schedule::k1F1B, 4, 0, 6)), "F0 F1 F2 F3 B0 F4 B1 F5 B2 B3 B4 B5 ");
  EXPECT_EQ(str(make_schedule(Schedule::kGPipe, 2, 1, 3)), "F0 F1 F2 B2 B1 B0 ");
  // ZB-H1 on 2 stages: the last stage holds one W back, the first runs each W right after its B.
  EXPECT_EQ(str(make_schedule(Schedule::kZeroBubbleH1, 2, 0, 4)), "F0 F1 B0 W0 F2 B1 W1 F3 B2 W2 B3 W3 ");
  EXPECT_EQ(str(make_schedule(Schedule::kZeroBubbleH1, 2, 1, 4)), "F0 B0 F1 B1 W0 F2 B2 W1 F3 B3 W2 W3 ");
  // Interleaved, 2 ranks x 2 chunks, 4 micro-batches: rank 0 warms up with (2-1)*2 + 2*(2-0-1) = 4
  // forwards: chunk 0 (stage 0) takes micro-batches 0, 1, then chunk 1 (stage 2) takes them.
  auto a = make_schedule(Schedule::kInterleaved1F1B, 2, 0, 4, 2);
  std::string got;
  for (const auto& x : a) got += to_string(x) + "@" + std::to_string(x.stage) + " ";
  EXPECT_EQ(got, "F0@0 F1@0 F0@2 F1@2 F2@0 B0@2 F3@0 B1@2 F2@2 B0@0 F3@2 B1@0 B2@2 B3@2 B2@0 B3@0 ");
}

using Case = std::tuple<Schedule, int, int, int64_t>;  // schedule, ranks, virtual stages, micro-batches

std::vector<Case> all_cases() {
  std::vector<Case> out;
  for (int p : {1, 2, 3, 4})
    for (int64_t m : {1, 2, 3, 4, 6, 8, 12}) {
      out.emplace_back(Schedule::kGPipe, p, 1, m);
      out.emplace_back(Schedule::k1F1B, p, 1, m);
      out.emplace_back(Schedule::kZeroBubbleH1, p, 1, m);
      if (p >= 2 && m % p == 0)
        for (int v : {1, 2, 3}) out.emplace_back(Schedule::kInterleaved1F1B, p, v, m);
    }
  return out;
}

TEST(PipelineSchedule, EveryScheduleRunsEveryActionOnceInAValidOrderWithinItsMemoryBound) {
  for (const auto& [schedule, p, v, m] : all_cases()) {
    SCOPED_TRACE(to_string(schedule) + " p=" + std::to_string(p) + " v=" + std::to_string(v) +
                 " m=" + std::to_string(m));
    const SimResult res = simulate(schedule, p, v, m, 1, 1, 1);
    ASSERT_TRUE(res.completed) << res.error;
    for (int r = 0; r < p; ++r) {
      const int64_t one_f_one_b = std::min<int64_t>(p - r, m);
      switch (schedule) {
        case Schedule::kGPipe:
          EXPECT_EQ(res.max_unfinished[r], m);
          break;
        case Schedule::k1F1B:
          EXPECT_EQ(res.max_unfinished[r], one_f_one_b);
          break;
        case Schedule::kZeroBubbleH1:
          // B as early as 1F1B's backward; B or W pending for at most p micro-batches (the paper's p * M_B).
          EXPECT_EQ(res.max_before_b[r], one_f_one_b);
          EXPECT_LE(res.max_unfinished[r], std::min<int64_t>(p, m));
          break;
        case Schedule::kInterleaved1F1B:
          EXPECT_EQ(res.max_unfinished[r], std::min<int64_t>((v - 1) * p + 2 * (p - r - 1) + 1, m * v));
          break;
      }
    }
  }
}

// Unit costs: a stage's forward 1, its whole backward 2 (B 1 + W 1); a chunk's cost is 1/v of that.
TEST(PipelineSchedule, StepTimesOfThePapers) {
  for (int p : {2, 3, 4})
    for (int64_t m : {4, 8, 12}) {
      SCOPED_TRACE("p=" + std::to_string(p) + " m=" + std::to_string(m));
      const double one_f_one_b = simulate(Schedule::k1F1B, p, 1, m, 1, 2, 0).makespan;
      EXPECT_DOUBLE_EQ(one_f_one_b, 3.0 * (m + p - 1));
      EXPECT_DOUBLE_EQ(simulate(Schedule::kGPipe, p, 1, m, 1, 2, 0).makespan, 3.0 * (m + p - 1));
      // ZB-H1: bubble (p-1)(F + B - W) = p - 1 instead of 3(p - 1).
      EXPECT_DOUBLE_EQ(simulate(Schedule::kZeroBubbleH1, p, 1, m, 1, 1, 1).makespan, 3.0 * m + p - 1);
      if (m % p == 0)
        for (int v : {2, 3}) {
          // Megatron: the bubble (p-1)(F + B) divided by v.
          const double t = simulate(Schedule::kInterleaved1F1B, p, v, m, 1.0 / v, 2.0 / v, 0).makespan;
          EXPECT_NEAR(t, 3.0 * m + 3.0 * (p - 1) / v, 1e-9) << "v=" << v;
        }
    }
}

TEST(PipelineSchedule, BadInputIsOneClearError) {
  auto error_of = [](auto f) {
    try {
      f();
    } catch (const std::exception& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_EQ(error_of([] { make_schedule(Schedule::kInterleaved1F1B, 4, 0, 6, 2); }),
            "PipelineOptions: Interleaved1F1B needs chunks to be a multiple of the 4 pipeline ranks, got chunks=6: "
            "use chunks=8");
  EXPECT_EQ(error_of([] { make_schedule(Schedule::kInterleaved1F1B, 2, 0, 4, 0); }),
            "PipelineOptions: virtual_stages must be >= 1, got 0");
  EXPECT_EQ(error_of([] { make_schedule(Schedule::k1F1B, 2, 0, 4, 2); }),
            "PipelineOptions: virtual_stages=2 needs Schedule::kInterleaved1F1B; 1F1B runs one stage per rank: use "
            "virtual_stages(1) or the interleaved schedule");
  EXPECT_EQ(error_of([] { make_schedule(Schedule::kInterleaved1F1B, 1, 0, 4, 2); }),
            "PipelineOptions: Interleaved1F1B needs at least 2 pipeline ranks, got 1: use Schedule::k1F1B");
  EXPECT_EQ(error_of([] { make_schedule(Schedule::kZeroBubbleH1, 2, 0, 0); }), "pipeline: chunks must be >= 1, got 0");
}

// B then W gives the full backward's gradients, for the input and every parameter.
TEST(PipelineSplitBackward, InputThenWeightEqualsTheFullBackward) {
  using namespace dtrain::pipeline;
  torch::manual_seed(1);
  torch::nn::Sequential stage(torch::nn::Linear(5, 7), torch::nn::ReLU(), torch::nn::Linear(7, 7), torch::nn::Tanh(),
                              torch::nn::Linear(7, 3));
  stage->to(at::kDouble);
  const at::Tensor x0 = at::randn({4, 5}, at::kDouble), g = at::randn({4, 3}, at::kDouble);
  at::Tensor x = x0.clone().requires_grad_(true);
  stage->forward(x).backward(g);
  std::vector<at::Tensor> want;
  for (const auto& p : stage->parameters()) want.push_back(p.grad().clone());
  const at::Tensor want_x = x.grad().clone();
  for (auto& p : stage->parameters()) p.mutable_grad().reset();

  at::Tensor x2 = x0.clone().requires_grad_(true);
  std::vector<WeightPart> parts;
  at::Tensor out = forward_recording(stage, x2, parts);
  EXPECT_EQ(parts.size(), 3u);  // the three Linears
  at::Tensor gx = backward_input(out, g, x2, parts);
  for (const auto& p : stage->parameters()) EXPECT_FALSE(p.grad().defined()) << "B computed a weight gradient";
  EXPECT_TRUE(at::allclose(gx, want_x));
  backward_weight(parts);
  EXPECT_TRUE(parts.empty());
  const auto params = stage->parameters();
  for (size_t k = 0; k < params.size(); ++k) EXPECT_TRUE(at::allclose(params[k].grad(), want[k])) << "param " << k;
}

TEST(PipelineSplitBackward, ASharedParameterIsRefused) {
  torch::nn::Linear shared(4, 4);
  torch::nn::Sequential stage(shared, torch::nn::ReLU(), shared);
  try {
    dtrain::pipeline::check_split_backward(stage, 3);
    FAIL() << "no error";
  } catch (const std::exception& e) {
    EXPECT_THAT(std::string(e.what()), HasSubstr("stage 3 uses one parameter in its layers 0 and 2")) << e.what();
  }
}

}  // namespace
