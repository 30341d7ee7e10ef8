// ZeroRedundancyOptimizer on 2 and 3 real processes: parameters after 10 steps of SGD with momentum
// and of Adam (with gradient clipping) equal one process's unsharded optimizer on the whole batch;
// on a group of one rank they are bit-identical; each rank holds only its share's state; and a
// checkpoint saved mid-run resumes bit-identically (the state travels consolidated, in the
// unsharded optimizer's format). With GradScaler (an overflow injected on one rank: every rank skips
// that step) and gradient clipping it equals the unsharded optimizer with the same recipe.
// local_state_bytes() is the bytes of this rank's state tensors, at most an even share plus the
// largest parameter's.
// (ZeroRedundancyOptimizer under Join: tests/dist/join_test.cpp.)
#include <torch/nn/modules/linear.h>  // (clip_grad.h needs what it includes)
#include <torch/nn/utils/clip_grad.h>

#include <cstdlib>
#include <limits>
#include <filesystem>

#include "dist_main.h"
#include "dtrain/amp.h"
#include "dtrain/checkpoint.h"
#include "dtrain/ddp.h"
#include "dtrain/zero.h"
#include "zero_models.h"

using namespace dtrain;
namespace fs = std::filesystem;

namespace {

using zero_models::factory;
using zero_models::make_model;
std::pair<at::Tensor, at::Tensor> batch(int step) { return zero_models::batch(50, step); }

// One training step on this rank's part of the batch (the whole batch when `whole`).
void train_step(torch::nn::Module& net, const std::function<at::Tensor(const at::Tensor&)>& forward,
                torch::optim::Optimizer& opt, int step, bool whole, bool clip) {
  auto [x, y] = batch(step);
  zero_models::keep_this_ranks_part(x, y, whole);
  opt.zero_grad();
  (forward(x) - y).pow(2).mean().backward();
  if (clip) torch::nn::utils::clip_grad_norm_(net.parameters(), 0.5);
  opt.step();
}

double max_rel_diff(torch::nn::Module& a, torch::nn::Module& b) {
  double worst = 0;
  auto pa = a.parameters(), pb = b.parameters();
  for (size_t i = 0; i < pa.size(); ++i) {
    const double scale = std::max(pb[i].abs().max().item<double>(), 1e-6);
    worst = std::max(worst, (pa[i] - pb[i]).abs().max().item<double>() / scale);
  }
  return worst;
}

bool bit_identical(torch::nn::Module& a, torch::nn::Module& b) {
  auto pa = a.parameters(), pb = b.parameters();
  for (size_t i = 0; i < pa.size(); ++i)
    if (!pa[i].equal(pb[i])) return false;
  return true;
}

}  // namespace

TEST(Zero, TenStepsEqualTheUnshardedOptimizerOnTheWholeBatch) {
  for (const std::string kind : {"sgd", "adam"}) {
    const bool clip = kind == "adam";
    auto model = make_model();
    DistributedDataParallel ddp(model);
    ZeroRedundancyOptimizer opt(ddp.parameters(), factory(kind));
    if (kind == "adam") {
      // doc:begin zero
      // Each rank keeps Adam's state for its share of the parameters only; step() updates them all.
      dtrain::ZeroRedundancyOptimizer zero(
          ddp.parameters(), dtrain::optimizer_factory<torch::optim::Adam>(torch::optim::AdamOptions(1e-2)));
      // doc:end zero
      EXPECT_EQ(zero.owners(), opt.owners()) << "the partition depends on the parameters only";
    }
    auto ref = make_model();
    auto ref_opt = factory(kind)(ref->parameters());
    for (int s = 0; s < 10; ++s) {
      train_step(
          *model, [&](const at::Tensor& x) { return ddp(x); }, opt, s, false, clip);
      train_step(
          *ref, [&](const at::Tensor& x) { return ref->forward(x); }, *ref_opt, s, true, clip);
    }
    EXPECT_LE(max_rel_diff(*model, *ref), 1e-7) << kind << " on rank " << rank();
    // Step 1 of the protocol: this rank holds state for its share only, and the shares cover all.
    int64_t mine = 0;
    for (int o : opt.owners()) mine += o == Group().rank();
    EXPECT_EQ(static_cast<int64_t>(opt.local_optimizer().state().size()), mine) << kind;
    const int64_t all = all_reduce_values(std::vector<int64_t>{mine})[0];
    EXPECT_EQ(all, static_cast<int64_t>(ddp.parameters().size()));
  }
}

TEST(Zero, LocalStateBytesAreTheBytesOfTheShareStateTensors) {
  // SGD with momentum keeps one tensor per parameter (its momentum buffer), Adam two (exp_avg,
  // exp_avg_sq), each of the parameter's size; the step counter is no tensor.
  for (const auto& [kind, tensors] : {std::make_pair(std::string("sgd"), 1), std::make_pair(std::string("adam"), 2)}) {
    auto model = make_model();
    DistributedDataParallel ddp(model);
    ZeroRedundancyOptimizer opt(ddp.parameters(), factory(kind));
    train_step(
        *model, [&](const at::Tensor& x) { return ddp(x); }, opt, 0, false, false);
    const auto params = ddp.parameters();
    int64_t want = 0, all = 0, largest = 0;
    for (size_t i = 0; i < params.size(); ++i) {
      const int64_t bytes = tensors * params[i].numel() * static_cast<int64_t>(params[i].element_size());
      all += bytes;
      largest = std::max(largest, bytes);
      if (opt.owners()[i] == Group().rank()) want += bytes;
    }
    const int64_t mine = opt.local_state_bytes();
    EXPECT_EQ(mine, want) << kind << " on rank " << rank();
    const int64_t total = all_reduce_values(std::vector<int64_t>{mine})[0];
    EXPECT_EQ(total, all) << kind;
    // What sharding promises: at most an even share plus one parameter's state.
    EXPECT_LE(mine, total / world_size() + largest) << kind << " on rank " << rank();
  }
}

TEST(Zero, OnAGroupOfOneRankItIsTheWrappedOptimizerBitForBit) {
  std::vector<Group> singles;
  for (int r = 0; r < world_size(); ++r) singles.push_back(new_group({r}));  // every rank, same order
  for (const std::string kind : {"sgd", "adam"}) {
    auto model = make_model(), ref = make_model();
    ZeroRedundancyOptimizer opt(model->parameters(), factory(kind), ZeroOptions().process_group(singles[rank()]));
    auto ref_opt = factory(kind)(ref->parameters());
    for (int s = 0; s < 10; ++s) {
      train_step(
          *model, [&](const at::Tensor& x) { return model->forward(x); }, opt, s, true, false);
      train_step(
          *ref, [&](const at::Tensor& x) { return ref->forward(x); }, *ref_opt, s, true, false);
    }
    EXPECT_TRUE(bit_identical(*model, *ref)) << kind << ": " << max_rel_diff(*model, *ref);
  }
}

TEST(Zero, ACheckpointSavedMidRunResumesExactly) {
  const char* port = std::getenv("MASTER_PORT");
  const fs::path dir = fs::temp_directory_path() / (std::string("dtrain_zero_ckpt_") + (port ? port : "0"));
  if (rank() == 0) fs::remove_all(dir);
  barrier();
  // Uninterrupted: 10 steps.
  auto straight = make_model();
  DistributedDataParallel ddp_a(straight);
  ZeroRedundancyOptimizer opt_a(ddp_a.parameters(), factory("adam"));
  for (int s = 0; s < 10; ++s)
    train_step(
        *straight, [&](const at::Tensor& x) { return ddp_a(x); }, opt_a, s, false, false);

  // 5 steps, a checkpoint, then a fresh model and optimizer resume from it for 5 more.
  {
    auto first = make_model();
    DistributedDataParallel ddp(first);
    ZeroRedundancyOptimizer opt(ddp.parameters(), factory("adam"));
    for (int s = 0; s < 5; ++s)
      train_step(
          *first, [&](const at::Tensor& x) { return ddp(x); }, opt, s, false, false);
    TrainingState st;
    st.model = first.ptr().get();
    st.optimizer = &opt;
    st.step = 5;
    CheckpointManager(dir.string()).save(st);
  }
  auto resumed = make_model();
  DistributedDataParallel ddp_b(resumed);
  ZeroRedundancyOptimizer opt_b(ddp_b.parameters(), factory("adam"));
  TrainingState st;
  st.model = resumed.ptr().get();
  st.optimizer = &opt_b;
  ASSERT_TRUE(CheckpointManager(dir.string()).load_latest(st).has_value());
  ASSERT_EQ(st.step, 5);
  for (int s = 5; s < 10; ++s)
    train_step(
        *resumed, [&](const at::Tensor& x) { return ddp_b(x); }, opt_b, s, false, false);
  EXPECT_TRUE(bit_identical(*resumed, *straight)) << "resumed run differs: " << max_rel_diff(*resumed, *straight);

  // The file holds the unsharded optimizer's state: a plain Adam loads it, with state for every parameter.
  auto plain_model = make_model();
  torch::optim::Adam plain(plain_model->parameters(), torch::optim::AdamOptions(1e-2));
  TrainingState pst;
  pst.model = plain_model.ptr().get();
  pst.optimizer = &plain;
  ASSERT_TRUE(CheckpointManager(dir.string()).load_latest(pst).has_value());
  EXPECT_EQ(plain.state().size(), plain_model->parameters().size());
  barrier();
  if (rank() == 0) fs::remove_all(dir);
}

TEST(Zero, WithGradScalerAndClippingEqualsTheUnshardedOptimizer) {
  // The AMP recipe: scale, backward, unscale_, clip, step (skipped after an overflow), update. float32:
  // the scaler's unscale kernel takes what AMP produces.
  constexpr int kOverflowStep = 2;
  auto model = make_model(), ref = make_model();
  model->to(at::kFloat);
  ref->to(at::kFloat);
  DistributedDataParallel ddp(model);
  ZeroRedundancyOptimizer opt(ddp.parameters(), factory("sgd"));
  auto ref_opt = factory("sgd")(ref->parameters());
  const auto options = GradScalerOptions().init_scale(1024).growth_interval(3);
  GradScaler scaler(options), ref_scaler(options);
  std::vector<int> stepped, ref_stepped;
  auto step = [&](torch::nn::Module& net, const std::function<at::Tensor(const at::Tensor&)>& forward,
                  torch::optim::Optimizer& o, GradScaler& sc, int s, bool whole) {
    auto [x, y] = batch(s);
    x = x.to(at::kFloat);
    y = y.to(at::kFloat);
    zero_models::keep_this_ranks_part(x, y, whole);
    o.zero_grad();
    at::Tensor loss = (forward(x) - y).pow(2).mean();
    // An overflow on one rank only: DDP's average spreads it, so every rank must skip.
    if (s == kOverflowStep && (whole || rank() == world_size() - 1))
      loss = loss * std::numeric_limits<float>::infinity();
    sc.scale(loss).backward();
    sc.unscale_(o);
    torch::nn::utils::clip_grad_norm_(net.parameters(), 0.5);
    const bool did = sc.step(o);
    sc.update();
    return did ? 1 : 0;
  };
  for (int s = 0; s < 8; ++s) {
    stepped.push_back(step(
        *model, [&](const at::Tensor& x) { return ddp(x); }, opt, scaler, s, false));
    ref_stepped.push_back(step(
        *ref, [&](const at::Tensor& x) { return ref->forward(x); }, *ref_opt, ref_scaler, s, true));
  }
  EXPECT_EQ(stepped, (std::vector<int>{1, 1, 0, 1, 1, 1, 1, 1}));
  EXPECT_EQ(stepped, ref_stepped);
  EXPECT_DOUBLE_EQ(scaler.get_scale(), ref_scaler.get_scale());
  EXPECT_LE(max_rel_diff(*model, *ref), 1e-5) << "rank " << rank();
}

DTRAIN_DIST_TEST_MAIN()
