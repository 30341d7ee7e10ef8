// Pipeline parallelism on 2 and 4 real ranks, every schedule (one stage per rank, or 2 virtual stages
// per rank for the interleaved one; 2 stages x 2 replicas on 4).
//
// Equivalence: after 10 SGD steps, every stage's parameters equal those of one process training the
// unsplit model on the same batches (the reference runs inside every rank; pipeline_models.h), within
// 1e-6 relative in float64.
#include <chrono>

#include <torch/autograd.h>
#include <torch/nn/modules/container/functional.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>
#include <torch/utils.h>

#include "dist_main.h"
#include "dtrain/data_parallel.h"  // balance_by_size
#include "dtrain/pipeline.h"
#include "pipeline_inject.h"
#include "pipeline_models.h"
#include "test_util.h"
#include "matchers.h"

using namespace dtrain;
using namespace dtrain::test_pipeline;
using dtrain::test_util::error_of;
using torch::nn::Linear;
using torch::nn::Sequential;

namespace {

torch::optim::SGD make_opt(std::vector<at::Tensor> ps) {
  return torch::optim::SGD(ps, torch::optim::SGDOptions(0.1).momentum(0.9));
}

constexpr Schedule kAllSchedules[] = {Schedule::kGPipe, Schedule::k1F1B, Schedule::kInterleaved1F1B,
                                      Schedule::kZeroBubbleH1};

// The options of each schedule in these tests: the interleaved one with 2 virtual stages per rank (on a
// deeper model: 9 layers for up to 8 stages).
PipelineOptions options_for(Schedule schedule, int64_t chunks) {
  return PipelineOptions().chunks(chunks).schedule(schedule).virtual_stages(schedule == Schedule::kInterleaved1F1B ? 2
                                                                                                                   : 1);
}
int linears_for(Schedule schedule) { return schedule == Schedule::kInterleaved1F1B ? 5 : 3; }

// One process, the whole model, the whole batch: the reference, with its loss per step.
std::pair<Sequential, std::vector<double>> reference(int steps, int linears = 3) {
  Sequential model = make_model(linears);
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
  if (schedule == Schedule::kInterleaved1F1B && chunks % world_size() != 0)
    GTEST_SKIP() << "the interleaved schedule needs chunks a multiple of the ranks (BadInput tests the error)";
  constexpr int kSteps = 10;
  auto [ref, ref_losses] = reference(kSteps, linears_for(schedule));
  Pipeline pipe(make_model(linears_for(schedule)), options_for(schedule, chunks));
  const int p = pipe.num_stages(), s = pipe.stage(), v = pipe.virtual_stages();
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
    } else if (schedule == Schedule::k1F1B) {
      EXPECT_LE(live, p);
      EXPECT_EQ(live, std::min<int64_t>(p - s, chunks));
    } else if (schedule == Schedule::kZeroBubbleH1) {  // counted until W: at most p, as the paper's p * M_B
      EXPECT_LE(live, std::min<int64_t>(p, chunks));
      EXPECT_GE(live, std::min<int64_t>(p - s, chunks));
    } else {
      EXPECT_EQ(live, std::min<int64_t>((v - 1) * p + 2 * (p - s - 1) + 1, chunks * v));
    }
  }
  EXPECT_LT(stage_diff(pipe, ref), 1e-6) << to_string(schedule) << " chunks=" << chunks << " stage " << s;
}

INSTANTIATE_TEST_SUITE_P(SchedulesAndChunks, PipelineEquivalence,
                         ::testing::Combine(::testing::ValuesIn(kAllSchedules), ::testing::Values(1, 2, 4, 8)),
                         [](const auto& info) {
                           return to_string(std::get<0>(info.param)) + "_chunks" +
                                  std::to_string(std::get<1>(info.param));
                         });

// Registered as is and with DTRAIN_SHM=0: the boundaries between stages go over the transport the
// environment asks for (shared memory on one host, or Gloo's TCP, the path between hosts).
TEST(Pipeline, BoundariesTakeTheTransportTheEnvironmentAsks) { expect_default_group_transport_from_env(); }

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
  EXPECT_THAT(error_of([] { Pipeline bad(make_model(), PipelineOptions().balance({2, 2})); }), HasSubstr("sums to 4"));
}

// Boundary tensors larger than a shared-memory point-to-point ring (1 MB): a stage enters the
// end-of-step all-reduce with its send only partly written, and the neighbour needs the rest to
// reach that all-reduce. This hung until the collectives' waits moved point-to-point on too.
TEST(Pipeline, BoundaryTensorsLargerThanTheRingDoNotHang) {
  torch::nn::Sequential net;
  std::vector<int64_t> balance;
  for (int r = 0; r < world_size(); ++r) {
    net->push_back(torch::nn::Linear(1024, 1024));
    balance.push_back(1);
  }
  Pipeline pipe(net, PipelineOptions().chunks(1).schedule(Schedule::kGPipe).balance(balance));
  torch::optim::SGD opt(pipe.parameters(), 0.01);
  const at::Tensor x = at::randn({300, 1024}), y = at::randn({300, 1024});  // 1.2 MB per boundary
  for (int step = 0; step < 3; ++step) {
    opt.zero_grad();
    auto r = pipe.step(x, y, [](const at::Tensor& out, const at::Tensor& t) { return (out - t).pow(2).mean(); });
    EXPECT_TRUE(std::isfinite(r.loss)) << "step " << step;
    opt.step();
  }
}

// Note [boundary envelopes]: one message per boundary tensor once a channel's shape is agreed; a
// change of shape (a smaller last micro-batch, a new batch size) costs one more message per channel,
// and the results still equal one process's.
TEST(Pipeline, BoundaryShapesAreAgreedOnceAndAgainWhenTheyChange) {
  Sequential ref = make_model();
  auto ref_opt = make_opt(ref->parameters());
  Pipeline pipe(make_model(), PipelineOptions().chunks(4).schedule(Schedule::k1F1B));
  auto opt = make_opt(pipe.parameters());
  const int64_t channels = (pipe.is_first() ? 0 : 1) + (pipe.is_last() ? 0 : 1);
  // Batch sizes per step: 16 = 4 x 4, again, 14 = 4+4+4+2 (the last micro-batch smaller), 16 again.
  const int64_t sizes[] = {kBatch, kBatch, kBatch - 2, kBatch};
  const int64_t extra[] = {channels, 0, channels, channels};  // messages beyond one per tensor
  for (int step = 0; step < 4; ++step) {
    auto [x, y] = batch(step);
    x = x.slice(0, 0, sizes[step]);
    y = y.slice(0, 0, sizes[step]);
    ref_opt.zero_grad();
    at::Tensor ref_loss = loss_fn(ref->forward(x), y);
    ref_loss.backward();
    ref_opt.step();
    opt.zero_grad();
    auto r = pipe.step(x, y, loss_fn);
    opt.step();
    EXPECT_NEAR(r.loss, ref_loss.item<double>(), 1e-9 * std::abs(ref_loss.item<double>())) << "step " << step;
    const PipelineStepStats& st = pipe.last_step_stats();
    EXPECT_EQ(st.boundary_tensors, 4 * channels) << "step " << step;
    EXPECT_EQ(st.boundary_messages, st.boundary_tensors + extra[step]) << "step " << step;
  }
  EXPECT_LT(stage_diff(pipe, ref), 1e-6);
}

struct FailCase {
  int stage;
  Injection::Where where;
  int on_call;
};

TEST(PipelineFailure, AStageThatThrowsFailsEveryRankAndThePipelineRecovers) {
  const int p = world_size();
  for (Schedule schedule : kAllSchedules) {
    const int v = schedule == Schedule::kInterleaved1F1B ? 2 : 1, last = p * v - 1;
    Pipeline pipe(injectable_stages(p * v, linears_for(schedule)), options_for(schedule, 4));
    std::vector<FailCase> cases = {{0, Injection::kForward, 0}, {last, Injection::kForward, 2},
                                   {1, Injection::kForward, 3}, {0, Injection::kBackward, 1},
                                   {last, Injection::kLoss, 1}, {last, Injection::kBackward, 3},
                                   {0, Injection::kWeight, 1},  {last, Injection::kWeight, 2}};
    if (v > 1) {  // the ring's wrap: the last rank's first chunk feeds rank 0's second
      cases.push_back({p, Injection::kForward, 1});
      cases.push_back({p, Injection::kBackward, 2});
    }
    for (const FailCase& c : cases) {
      auto [x, y] = batch(0);
      auto run = [&, &x = x, &y = y] {  // structured bindings: captured by name
        g_inject.calls = 0;
        int loss_calls = 0;
        return pipe.step(x, y, [&](const at::Tensor& out, const at::Tensor& t) {
          if (g_inject.where == Injection::kLoss && g_inject.stage == last && loss_calls++ == c.on_call)
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
                               : c.where == Injection::kWeight   ? "injected weight gradient failure"
                                                                 : "injected loss failure";
      SCOPED_TRACE(to_string(schedule) + " stage " + std::to_string(c.stage) + " " + what);
      EXPECT_THAT(err, HasSubstr(what)) << err;
      EXPECT_THAT(
          err, HasSubstr("stage " + std::to_string(c.stage) + " (rank " + std::to_string(c.stage % p) + ") failed in"))
          << err;
      if (c.where == Injection::kWeight) {  // ZB-H1 computes weight gradients in W, the others in backward
        const bool zb = schedule == Schedule::kZeroBubbleH1;
        EXPECT_THAT(err,
                    HasSubstr(zb ? "failed in weight gradient of micro-batch" : "failed in backward of micro-batch"))
            << err;
      }
      EXPECT_THAT(err, HasSubstr("rank " + std::to_string(rank()) + ": pipeline step")) << err;
      EXPECT_LT(took, 20.0 * dtrain::test_util::kTimeScale)
          << "the failure took " << took << " s to reach rank " << rank();
      // The channels were emptied: the next step works.
      g_inject = Injection{};
      auto r = run();
      EXPECT_TRUE(std::isfinite(r.loss));
    }
  }
}

// Bad options: one line naming the value and the remedy, on every rank, before any step.
TEST(PipelineFailure, BadScheduleOptionsAreOneClearError) {
  const int p = world_size();
  EXPECT_EQ(error_of([&] { Pipeline bad(make_model(5), options_for(Schedule::kInterleaved1F1B, p + 1)); }),
            "PipelineOptions: Interleaved1F1B needs chunks to be a multiple of the " + std::to_string(p) +
                " pipeline ranks, got chunks=" + std::to_string(p + 1) + ": use chunks=" + std::to_string(2 * p));
  EXPECT_EQ(
      error_of([&] { Pipeline bad(make_model(5), options_for(Schedule::kInterleaved1F1B, p).virtual_stages(0)); }),
      "PipelineOptions: virtual_stages must be >= 1, got 0");
  EXPECT_THAT(error_of([&] { Pipeline bad(make_model(), options_for(Schedule::kZeroBubbleH1, 2).virtual_stages(2)); }),
              HasSubstr("virtual_stages=2 needs Schedule::kInterleaved1F1B"));
  EXPECT_THAT(error_of([&] { Pipeline bad(injectable_stages(p), options_for(Schedule::kInterleaved1F1B, p)); }),
              HasSubstr(std::to_string(p) + " stage modules given but the pipeline has " + std::to_string(2 * p) +
                        " stages (" + std::to_string(p) + " ranks x 2 virtual stages)"));
  Pipeline pipe(make_model(5), options_for(Schedule::kInterleaved1F1B, p));
  EXPECT_EQ(pipe.stage_modules().size(), 2u);
  EXPECT_THAT(error_of([&] { pipe.stage_module(); }), HasSubstr("use stage_modules()"));
}

TEST(PipelineFailure, BoundaryShapeMismatchNamesBothStages) {
  const int p = world_size();
  torch::manual_seed(0);
  std::vector<Sequential> stages = {Sequential(Linear(kIn, kHidden)), Sequential(Linear(kHidden + 1, kOut))};
  for (int s = 2; s < p; ++s) stages.push_back(Sequential(Linear(kOut, kOut)));
  Pipeline pipe(stages, PipelineOptions().chunks(2));
  auto x = at::randn({8, kIn}), y = at::randint(0, kOut, {8});
  const std::string err = error_of([&] { pipe.step(x, y, loss_fn); });
  EXPECT_THAT(err, HasSubstr("pipeline boundary mismatch: stage 0 (rank 0) outputs [4, 24]")) << err;
  EXPECT_THAT(err, HasSubstr("stage 1 (rank 1, layers 1..1) cannot take it")) << err;
}

// 2D: 2 stages x 2 replicas on 4 ranks, DDP inside each stage group; equals one process on the whole
// batch (each replica takes half of it).
TEST(Pipeline2D, TwoStagesTimesTwoReplicasMatchOneProcess) {
  if (world_size() != 4) GTEST_SKIP() << "4 ranks";
  constexpr int kSteps = 10;
  for (Schedule schedule : kAllSchedules) {
    auto [ref, ref_losses] = reference(kSteps, linears_for(schedule));
    Pipeline pipe(make_model(linears_for(schedule)), options_for(schedule, 2).replicas(2));
    ASSERT_EQ(pipe.num_stages(), 2);
    EXPECT_EQ(pipe.stage(), rank() % 2);
    EXPECT_EQ(pipe.replica(), rank() / 2);
    EXPECT_EQ(pipe.stage_group().ranks(), (std::vector<int>{pipe.stage(), pipe.stage() + 2}));
    EXPECT_EQ(pipe.stage_group().uses_shared_memory(), !shm_disabled_by_env());
    auto opt = make_opt(pipe.parameters());
    for (int step = 0; step < kSteps; ++step) {
      auto [x, y] = batch(step);
      opt.zero_grad();
      auto r = pipe.step(x.chunk(2)[pipe.replica()], y.chunk(2)[pipe.replica()], loss_fn);
      opt.step();
      EXPECT_NEAR(r.loss, ref_losses[step], 1e-9 * std::abs(ref_losses[step]));
    }
    EXPECT_LT(stage_diff(pipe, ref), 1e-6) << to_string(schedule);
  }
}

TEST(Pipeline2D, AFailureInOneReplicaFailsAllRanks) {
  if (world_size() != 4) GTEST_SKIP() << "4 ranks";
  // Rank 1 = stage 1 of replica 0 throws; rank 3 (stage 1 of replica 1) must not wait in DDP.
  std::vector<Sequential> stages = injectable_stages(2);  // 2 stages of 2 replicas
  Pipeline pipe(stages, PipelineOptions().chunks(2).replicas(2));
  auto [x, y] = batch(0);
  g_inject = Injection{rank() == 1 ? 1 : -1, Injection::kForward, 0, 0};
  const std::string err = error_of([&, &x = x, &y = y] { pipe.step(x.chunk(2)[0], y.chunk(2)[0], loss_fn); });
  g_inject = Injection{};
  EXPECT_THAT(err, HasSubstr("stage 1 (rank 1) failed in forward of micro-batch 0: injected forward failure")) << err;
}

}  // namespace

DTRAIN_DIST_TEST_MAIN()
