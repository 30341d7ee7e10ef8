// ZeroRedundancyOptimizer across world sizes: N ranks train 5 steps and save a checkpoint
// (`zero_reshard_test save <dir>`), then M ranks load it (`zero_reshard_test load <dir> <N>`), check
// that each holds the state of the new partition's share, and train 5 more steps. The parameters then
// equal one process's unsharded optimizer after 10 steps on the whole batch (float64, 1e-7 relative):
// the consolidated state was repartitioned over the new world. ctest runs 2 -> 3 and 3 -> 2.

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "dist_main.h"
#include "dtrain/checkpoint.h"
#include "dtrain/ddp.h"
#include "dtrain/zero.h"
#include "zero_models.h"

using namespace dtrain;

namespace {

constexpr int kStepsBefore = 5, kStepsAfter = 5;

const std::string& g_phase = phase_args().phase;
const std::string& g_dir = phase_args().dir;
const int64_t& g_saved_world = phase_args().saved_world;

using zero_models::factory;
using zero_models::make_model;
std::pair<at::Tensor, at::Tensor> batch(int step) { return zero_models::batch(70, step); }

// One step on this rank's part of the batch (the whole batch when `whole`).
void train_step(const std::function<at::Tensor(const at::Tensor&)>& forward, torch::optim::Optimizer& opt, int step,
                bool whole) {
  auto [x, y] = batch(step);
  zero_models::keep_this_ranks_part(x, y, whole);
  opt.zero_grad();
  (forward(x) - y).pow(2).mean().backward();
  opt.step();
}

}  // namespace

TEST(ZeroReshard, StateSavedOnNRanksIsRepartitionedOnM) {
  ASSERT_TRUE(g_phase == "save" || g_phase == "load") << "usage: zero_reshard_test save|load <dir> [<saved world>]";
  if (g_phase == "save") {  // a folder of its own: nothing of an earlier run is left in it
    if (rank() == 0) std::filesystem::remove_all(g_dir);
    barrier();
  }
  for (const std::string kind : {"sgd", "adam"}) {
    auto model = make_model();
    DistributedDataParallel ddp(model);
    ZeroRedundancyOptimizer opt(ddp.parameters(), factory(kind));
    CheckpointManager ckpt(g_dir, CheckpointOptions().prefix(kind));
    TrainingState st;
    st.model = model.ptr().get();
    st.optimizer = &opt;
    if (g_phase == "save") {
      for (int s = 0; s < kStepsBefore; ++s) train_step([&](const at::Tensor& x) { return ddp(x); }, opt, s, false);
      st.step = kStepsBefore;
      ckpt.save(st);
      continue;
    }
    ASSERT_TRUE(ckpt.load_latest(st).has_value()) << kind << ": no checkpoint in " << g_dir;
    ASSERT_EQ(st.step, kStepsBefore);
    ASSERT_EQ(st.saved_world_size, g_saved_world);
    ASSERT_NE(g_saved_world, world_size()) << "this test is about another world size";
    // This rank holds the state of exactly its share of the new partition; the shares cover all.
    int64_t mine = 0;
    for (int o : opt.owners()) mine += o == Group().rank();
    EXPECT_EQ(static_cast<int64_t>(opt.local_optimizer().state().size()), mine) << kind;
    EXPECT_EQ(all_reduce_values(std::vector<int64_t>{mine})[0], static_cast<int64_t>(ddp.parameters().size()));
    for (int s = kStepsBefore; s < kStepsBefore + kStepsAfter; ++s)
      train_step([&](const at::Tensor& x) { return ddp(x); }, opt, s, false);

    auto ref = make_model();
    auto ref_opt = factory(kind)(ref->parameters());
    for (int s = 0; s < kStepsBefore + kStepsAfter; ++s)
      train_step([&](const at::Tensor& x) { return ref->forward(x); }, *ref_opt, s, true);
    double worst = 0;
    auto pa = model->parameters(), pb = ref->parameters();
    for (size_t i = 0; i < pa.size(); ++i) {
      const double scale = std::max(pb[i].abs().max().item<double>(), 1e-6);
      worst = std::max(worst, (pa[i] - pb[i]).abs().max().item<double>() / scale);
    }
    if (rank() == 0)
      std::printf("%s, %lld -> %d ranks: max relative difference %.3g\n", kind.c_str(),
                  static_cast<long long>(g_saved_world), world_size(), worst);
    EXPECT_LE(worst, 1e-7) << kind << " on rank " << rank() << ": saved on " << g_saved_world << " ranks, resumed on "
                           << world_size();
  }
}

// A rank beyond the saved world has no RNG state of its own: it draws a stream seeded from rank 0's
// saved state and its rank, unlike any saved rank's (which here all equal rank 0's, each rank seeded
// the same before training) and the same at every load of the same checkpoint.
TEST(ZeroReshard, ARankBeyondTheSavedWorldDrawsItsOwnReproducibleStream) {
  if (g_phase != "load") GTEST_SKIP() << "checked when loading";
  std::vector<at::Tensor> draws;  // [load] -> every rank's 4 numbers, rank by rank
  for (int load = 0; load < 2; ++load) {
    auto model = make_model();
    TrainingState st;
    st.model = model.ptr().get();
    CheckpointManager ckpt(g_dir, CheckpointOptions().prefix("sgd"));
    ASSERT_TRUE(ckpt.load_latest(st).has_value()) << "no checkpoint in " << g_dir;
    at::Tensor mine = at::rand({4}, at::kDouble);
    std::vector<at::Tensor> all;
    for (int r = 0; r < world_size(); ++r) all.push_back(at::empty_like(mine));
    all_gather(all, mine);
    draws.push_back(at::stack(all));
  }
  EXPECT_TRUE(at::equal(draws[0], draws[1])) << "two loads of one checkpoint gave rank(s) different streams";
  for (int r = static_cast<int>(g_saved_world); r < world_size(); ++r)
    for (int q = 0; q < r; ++q)
      EXPECT_FALSE(at::equal(draws[0][r], draws[0][q])) << "rank " << r << " draws what rank " << q << " draws";
}

DTRAIN_DIST_PHASE_TEST_MAIN()
