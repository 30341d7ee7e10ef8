// Pipeline parallelism on 2 and 4 real ranks (one stage per rank; 2 stages x 2 replicas on 4).
//
// Equivalence: after 10 SGD steps, every stage's parameters equal those of one process training the
// unsplit model on the same batches (the reference runs inside every rank; pipeline_models.h).
#include <chrono>

#include <torch/autograd.h>
#include <torch/nn/modules/container/functional.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>
#include <torch/utils.h>

#include "dist_main.h"
#include "dtrain/data_parallel.h"  // balance_by_size
#include "dtrain/pipeline.h"
#include "pipeline_models.h"
#include "test_util.h"

using namespace dtrain;
using namespace dtrain::test_pipeline;
using dtrain::test_util::error_of;
using torch::nn::Linear;
using torch::nn::Sequential;

namespace {

// Failure injection: the stage whose forward (or backward) throws, and on which call.
struct Injection {
  int stage = -1;
  enum Where { kForward, kBackward, kLoss } where = kForward;
  int on_call = 0;  // throw on this micro-batch call of the step (0-based)
  int calls = 0;
};
Injection g_inject;

// Identity in forward; throws in backward when armed (a failure inside autograd).
struct ThrowInBackward : torch::autograd::Function<ThrowInBackward> {
  static at::Tensor forward(torch::autograd::AutogradContext*, const at::Tensor& x) { return x.clone(); }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext*, torch::autograd::variable_list g) {
    throw std::runtime_error("injected backward failure");
    return g;
  }
};

// A layer that is the identity unless the injection targets its stage.
torch::nn::Functional injector(int stage) {
  return torch::nn::Functional([stage](at::Tensor x) {
    if (g_inject.stage != stage) return x;
    const int call = g_inject.calls++;
    if (call != g_inject.on_call) return x;
    if (g_inject.where == Injection::kForward)
      throw std::runtime_error("injected forward failure in stage " + std::to_string(stage));
    if (g_inject.where == Injection::kBackward) return ThrowInBackward::apply(x);
    return x;
  });
}

torch::optim::SGD make_opt(std::vector<at::Tensor> ps) {
  return torch::optim::SGD(ps, torch::optim::SGDOptions(0.1).momentum(0.9));
}

// One process, the whole model, the whole batch: the reference, with its loss per step.
std::pair<Sequential, std::vector<double>> reference(int steps) {
  Sequential model = make_model();
  auto opt = make_opt(model->parameters());
  std::vector<double> losses;
  for (int s = 0; s < steps; ++s) {
    auto [x, y] = batch(s);
    opt.zero_grad();
    at::Tensor loss = loss_fn(model->forward(x), y);
    loss.backward();
    opt.step();
    losses.push_back(loss.item<double>());
  }
  return {model, losses};
}

using Param = std::tuple<Schedule, int64_t>;

class PipelineEquivalence : public ::testing::TestWithParam<Param> {};

TEST_P(PipelineEquivalence, MatchesOneProcessAndCountsActivations) {
  const auto [schedule, chunks] = GetParam();
  constexpr int kSteps = 10;
  auto [ref, ref_losses] = reference(kSteps);
  Pipeline pipe(make_model(), PipelineOptions().chunks(chunks).schedule(schedule));
  const int p = pipe.num_stages(), s = pipe.stage();
  ASSERT_EQ(p, world_size());
  auto opt = make_opt(pipe.parameters());
  for (int step = 0; step < kSteps; ++step) {
    auto [x, y] = batch(step);
    opt.zero_grad();
    auto r = pipe.step(pipe.is_first() ? x : at::Tensor(), pipe.is_last() ? y : at::Tensor(), loss_fn);
    opt.step();
    EXPECT_NEAR(r.loss, ref_losses[step], 1e-9 * std::abs(ref_losses[step])) << "step " << step;
    if (pipe.is_last()) {
      EXPECT_EQ(r.output.sizes(), (std::vector<int64_t>{kBatch, kOut}));
    }
    // Activation memory, counted by the pipeline itself.
    const int64_t live = pipe.max_live_micro_batches();
    if (schedule == Schedule::kGPipe) {
      EXPECT_EQ(live, chunks);
    } else {
      EXPECT_LE(live, p);
      EXPECT_EQ(live, std::min<int64_t>(p - s, chunks));
    }
  }
  EXPECT_LT(stage_diff(pipe, ref), 1e-5) << to_string(schedule) << " chunks=" << chunks << " stage " << s;
}

INSTANTIATE_TEST_SUITE_P(SchedulesAndChunks, PipelineEquivalence,
                         ::testing::Combine(::testing::Values(Schedule::kGPipe, Schedule::k1F1B),
                                            ::testing::Values(1, 2, 4, 8)),
                         [](const auto& info) {
                           return to_string(std::get<0>(info.param)) + "_chunks" +
                                  std::to_string(std::get<1>(info.param));
                         });

TEST(Pipeline, ScheduleShapes) {
  using pipeline::Action;
  // 1F1B on the first of 4 stages with 6 micro-batches: 3 warm-up forwards, then alternate.
  auto a = pipeline::make_schedule(Schedule::k1F1B, 4, 0, 6);
  std::string got;
  for (const auto& x : a) got += (x.kind == Action::kForward ? "F" : "B") + std::to_string(x.micro_batch) + " ";
  EXPECT_EQ(got, "F0 F1 F2 F3 B0 F4 B1 F5 B2 B3 B4 B5 ");
  auto g = pipeline::make_schedule(Schedule::kGPipe, 2, 1, 3);
  got.clear();
  for (const auto& x : g) got += (x.kind == Action::kForward ? "F" : "B") + std::to_string(x.micro_batch) + " ";
  EXPECT_EQ(got, "F0 F1 F2 B2 B1 B0 ");
}

TEST(Pipeline, AutomaticBalanceByParameterCount) {
  Pipeline pipe(make_model(), PipelineOptions().chunks(2));
  int64_t total = 0;
  for (auto b : pipe.balance()) total += b;
  EXPECT_EQ(total, 5);
  EXPECT_EQ(pipe.balance(),
            balance_by_size({kIn * kHidden + kHidden, 0, kHidden * kHidden + kHidden, 0, kHidden * kOut + kOut},
                            world_size()));
}

TEST(Pipeline, ExplicitBalance) {
  if (world_size() != 2) GTEST_SKIP() << "2 ranks";
  Pipeline pipe(make_model(), PipelineOptions().balance({1, 4}));
  EXPECT_EQ(pipe.balance(), (std::vector<int64_t>{1, 4}));
  EXPECT_EQ(pipe.stage_module()->size(), pipe.stage() == 0 ? 1u : 4u);
  EXPECT_EQ(pipe.first_layer(), pipe.stage() == 0 ? 0 : 1);
  EXPECT_NE(error_of([] {
              Pipeline bad(make_model(), PipelineOptions().balance({2, 2}));
            }).find("sums to 4"),
            std::string::npos);
}

// Stages given one module each, with an injector after the first layer of every stage.
std::vector<Sequential> injectable_stages(int p) {
  Sequential whole = make_model();
  // Split 5 layers over p stages the same way as balance_by_size does for the test's sizes.
  std::vector<int64_t> bal = p == 2 ? std::vector<int64_t>{3, 2} : std::vector<int64_t>{1, 2, 1, 1};
  std::vector<Sequential> stages;
  int64_t k = 0;
  for (int s = 0; s < p; ++s) {
    Sequential st;
    for (int64_t j = 0; j < bal[s]; ++j, ++k) {
      st->push_back(*(whole->begin() + k));
      if (j == 0) st->push_back(injector(s));
    }
    stages.push_back(st);
  }
  return stages;
}

struct FailCase {
  int stage;
  Injection::Where where;
  int on_call;
};

TEST(PipelineFailure, AStageThatThrowsFailsEveryRankAndThePipelineRecovers) {
  const int p = world_size();
  for (Schedule schedule : {Schedule::kGPipe, Schedule::k1F1B}) {
    Pipeline pipe(injectable_stages(p), PipelineOptions().chunks(4).schedule(schedule));
    std::vector<FailCase> cases = {{0, Injection::kForward, 0},  {p - 1, Injection::kForward, 2},
                                   {1, Injection::kForward, 3},  {0, Injection::kBackward, 1},
                                   {p - 1, Injection::kLoss, 1}, {p - 1, Injection::kBackward, 3}};
    for (const FailCase& c : cases) {
      auto [x, y] = batch(0);
      auto run = [&] {
        g_inject.calls = 0;
        int loss_calls = 0;
        return pipe.step(x, y, [&](const at::Tensor& out, const at::Tensor& t) {
          if (g_inject.where == Injection::kLoss && g_inject.stage == pipe.stage() && loss_calls++ == c.on_call)
            throw std::runtime_error("injected loss failure");
          return loss_fn(out, t);
        });
      };
      g_inject = Injection{c.stage, c.where, c.on_call, 0};
      const auto t0 = std::chrono::steady_clock::now();
      const std::string err = error_of([&] { run(); });
      const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      const std::string what = c.where == Injection::kForward    ? "injected forward failure"
                               : c.where == Injection::kBackward ? "injected backward failure"
                                                                 : "injected loss failure";
      SCOPED_TRACE(to_string(schedule) + " stage " + std::to_string(c.stage) + " " + what);
      EXPECT_NE(err.find(what), std::string::npos) << err;
      EXPECT_NE(err.find("stage " + std::to_string(c.stage) + " (rank " + std::to_string(c.stage) + ") failed in"),
                std::string::npos)
          << err;
      EXPECT_NE(err.find("rank " + std::to_string(rank()) + ": pipeline step"), std::string::npos) << err;
      EXPECT_LT(took, 20.0) << "the failure took " << took << " s to reach rank " << rank();
      // The channels were emptied: the next step works.
      g_inject = Injection{};
      auto r = run();
      EXPECT_TRUE(std::isfinite(r.loss));
    }
  }
}

TEST(PipelineFailure, BoundaryShapeMismatchNamesBothStages) {
  const int p = world_size();
  torch::manual_seed(0);
  std::vector<Sequential> stages = {Sequential(Linear(kIn, kHidden)), Sequential(Linear(kHidden + 1, kOut))};
  for (int s = 2; s < p; ++s) stages.push_back(Sequential(Linear(kOut, kOut)));
  Pipeline pipe(stages, PipelineOptions().chunks(2));
  auto x = at::randn({8, kIn}), y = at::randint(0, kOut, {8});
  const std::string err = error_of([&] { pipe.step(x, y, loss_fn); });
  EXPECT_NE(err.find("pipeline boundary mismatch: stage 0 (rank 0) outputs [4, 24]"), std::string::npos) << err;
  EXPECT_NE(err.find("stage 1 (rank 1, layers 1..1) cannot take it"), std::string::npos) << err;
}

// 2D: 2 stages x 2 replicas on 4 ranks, DDP inside each stage group; equals one process on the whole
// batch (each replica takes half of it).
TEST(Pipeline2D, TwoStagesTimesTwoReplicasMatchOneProcess) {
  if (world_size() != 4) GTEST_SKIP() << "4 ranks";
  constexpr int kSteps = 10;
  auto [ref, ref_losses] = reference(kSteps);
  for (Schedule schedule : {Schedule::kGPipe, Schedule::k1F1B}) {
    Pipeline pipe(make_model(), PipelineOptions().chunks(2).schedule(schedule).replicas(2));
    ASSERT_EQ(pipe.num_stages(), 2);
    EXPECT_EQ(pipe.stage(), rank() % 2);
    EXPECT_EQ(pipe.replica(), rank() / 2);
    EXPECT_EQ(pipe.stage_group().ranks(), (std::vector<int>{pipe.stage(), pipe.stage() + 2}));
    auto opt = make_opt(pipe.parameters());
    for (int step = 0; step < kSteps; ++step) {
      auto [x, y] = batch(step);
      opt.zero_grad();
      auto r = pipe.step(x.chunk(2)[pipe.replica()], y.chunk(2)[pipe.replica()], loss_fn);
      opt.step();
      EXPECT_NEAR(r.loss, ref_losses[step], 1e-9 * std::abs(ref_losses[step]));
    }
    EXPECT_LT(stage_diff(pipe, ref), 1e-5) << to_string(schedule);
  }
}

TEST(Pipeline2D, AFailureInOneReplicaFailsAllRanks) {
  if (world_size() != 4) GTEST_SKIP() << "4 ranks";
  // Rank 1 = stage 1 of replica 0 throws; rank 3 (stage 1 of replica 1) must not wait in DDP.
  std::vector<Sequential> stages = injectable_stages(2);
  Pipeline pipe(stages, PipelineOptions().chunks(2).replicas(2));
  auto [x, y] = batch(0);
  g_inject = Injection{rank() == 1 ? 1 : -1, Injection::kForward, 0, 0};
  const std::string err = error_of([&] { pipe.step(x.chunk(2)[0], y.chunk(2)[0], loss_fn); });
  g_inject = Injection{};
  EXPECT_NE(err.find("stage 1 (rank 1) failed in forward of micro-batch 0: injected forward failure"),
            std::string::npos)
      << err;
}

}  // namespace

DTRAIN_DIST_TEST_MAIN()
