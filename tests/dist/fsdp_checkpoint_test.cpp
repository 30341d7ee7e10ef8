// Checkpoints of fully_shard'ed models across world sizes. N ranks train 4 steps, save (every rank
// its own shard file), train 4 more and record where that leads (`fsdp_checkpoint_test save <dir>`);
// then M ranks load (`fsdp_checkpoint_test load <dir> <N>`) and train the same 4 steps. On M = N the
// continuation is bit for bit the recorded one (an exact resume); on M != N parameters and optimizer
// state are resliced onto the new layout and the continuation equals one process's on the whole
// batch within 1e-10 (float64). Also: no rank wrote the whole model (each shard file holds its rows
// only), the full state dict at the save equals the one-process model, a model without fully_shard
// loads the sharded checkpoint whole, and a missing shard file fails the load on every rank, naming
// the file, before anything changed. ctest runs 3 -> 3 and 3 -> 2.
#include <torch/nn/modules/linear.h>
#include <torch/optim/adam.h>
#include <torch/optim/sgd.h>
#include <torch/serialize.h>

#include <cstdlib>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "compat/optim_compat.h"
#include "dist_main.h"
#include "dtrain/checkpoint.h"
#include "dtrain/fsdp.h"
#include "fsdp_models.h"
#include "matchers.h"

using namespace dtrain;
using fsdp_models::Net;
namespace fs = std::filesystem;

namespace {

constexpr int kStepsBefore = 4, kStepsAfter = 4;

const std::string& g_phase = phase_args().phase;
const std::string& g_dir = phase_args().dir;
const int64_t& g_saved_world = phase_args().saved_world;

std::unique_ptr<torch::optim::Optimizer> make_optimizer(const std::string& kind, std::vector<at::Tensor> params) {
  if (kind == "sgd") return std::make_unique<torch::optim::SGD>(params, torch::optim::SGDOptions(0.05).momentum(0.9));
  return std::make_unique<torch::optim::Adam>(params, torch::optim::AdamOptions(1e-2));
}

// One step: this rank's part of the batch through the sharded model (`root`), or the whole batch
// through a plain one.
void step(Net& net, FSDPModule<fsdp_models::NetImpl>* root, torch::optim::Optimizer& opt, int s) {
  auto [x, y] = fsdp_models::batch(s);
  if (root) fsdp_models::keep_this_ranks_part(x, y);
  opt.zero_grad();
  ((root ? (*root)(x) : net->forward(x)) - y).pow(2).mean().backward();
  opt.step();
}

// One process's model after `steps` steps on the whole batch.
Net one_process(const std::string& kind, int steps) {
  Net ref = fsdp_models::make_net();
  auto opt = make_optimizer(kind, ref->parameters());
  for (int s = 0; s < steps; ++s) step(ref, nullptr, *opt, s);
  return ref;
}

double max_rel_diff(const std::vector<std::pair<std::string, at::Tensor>>& whole, torch::nn::Module& ref) {
  std::map<std::string, at::Tensor> mine(whole.begin(), whole.end());
  double worst = 0;
  for (const auto& kv : ref.named_parameters()) {
    const at::Tensor& t = mine.at(kv.key());
    EXPECT_EQ(t.sizes(), kv.value().sizes()) << kv.key();
    const double scale = std::max(kv.value().abs().max().item<double>(), 1e-6);
    worst = std::max(worst, (t - kv.value()).abs().max().item<double>() / scale);
  }
  return worst;
}

std::string recorded_path(const std::string& kind) { return g_dir + "/" + kind + "_continued.pt"; }

// The full state dict as a list of tensors in named_parameters order (what the save records).
std::vector<at::Tensor> values_of(const std::vector<std::pair<std::string, at::Tensor>>& named) {
  std::vector<at::Tensor> out;
  for (const auto& kv : named) out.push_back(kv.second);
  return out;
}

void save_phase(const std::string& kind) {
  Net net = fsdp_models::make_net();
  auto root = fsdp_models::shard(net);
  auto opt = make_optimizer(kind, net->parameters());
  for (int s = 0; s < kStepsBefore; ++s) step(net, &root, *opt, s);
  CheckpointManager ckpt(g_dir, CheckpointOptions().prefix(kind));
  TrainingState st;
  st.model = net.ptr().get();
  st.optimizer = opt.get();
  st.step = kStepsBefore;
  const std::string path = ckpt.save(st);

  // The full state dict is one process's model.
  Net ref = one_process(kind, kStepsBefore);
  EXPECT_LT(max_rel_diff(root.full_state_dict(), *ref), 1e-10) << kind;
  for (int s = kStepsBefore; s < kStepsBefore + kStepsAfter; ++s) step(net, &root, *opt, s);
  auto continued = values_of(root.full_state_dict());
  if (rank() == 0) torch::save(continued, recorded_path(kind));
  barrier();
}

void load_phase(const std::string& kind) {
  Net net = fsdp_models::make_net();
  auto root = fsdp_models::shard(net);
  auto opt = make_optimizer(kind, net->parameters());
  CheckpointManager ckpt(g_dir, CheckpointOptions().prefix(kind));
  TrainingState st;
  st.model = net.ptr().get();
  st.optimizer = opt.get();
  ASSERT_TRUE(ckpt.load_latest(st).has_value()) << kind << ": no checkpoint in " << g_dir;
  ASSERT_EQ(st.step, kStepsBefore);
  ASSERT_EQ(st.saved_world_size, g_saved_world);
  // The state of each shard has the shard's shape on the new layout.
  if (kind == "adam")
    for (const auto& p : net->parameters()) {
      auto it = opt->state().find(compat::optimizer_state_key(p));
      if (it == opt->state().end()) continue;
      EXPECT_EQ(static_cast<torch::optim::AdamParamState&>(*it->second).exp_avg().sizes(), p.sizes());
    }
  for (int s = kStepsBefore; s < kStepsBefore + kStepsAfter; ++s) step(net, &root, *opt, s);
  const auto whole = root.full_state_dict();
  if (g_saved_world == world_size()) {
    std::vector<at::Tensor> recorded;
    torch::load(recorded, recorded_path(kind));
    ASSERT_EQ(recorded.size(), whole.size());
    for (size_t i = 0; i < whole.size(); ++i)
      EXPECT_TRUE(at::equal(whole[i].second, recorded[i]))
          << kind << ": " << whole[i].first << " differs from the run that saved (exact resume)";
  } else {
    Net ref = one_process(kind, kStepsBefore + kStepsAfter);
    const double worst = max_rel_diff(whole, *ref);
    if (rank() == 0)
      std::printf("%s, %lld -> %d ranks: max relative difference %.3g\n", kind.c_str(),
                  static_cast<long long>(g_saved_world), world_size(), worst);
    EXPECT_LT(worst, 1e-10) << kind << ": saved on " << g_saved_world << " ranks, resumed on " << world_size();
  }
}

}  // namespace

TEST(FsdpCheckpoint, SavedOnNRanksResumesOnM) {
  ASSERT_TRUE(g_phase == "save" || g_phase == "load") << "usage: fsdp_checkpoint_test save|load <dir> [<saved world>]";
  if (g_phase == "save") {  // a folder of its own: nothing of an earlier run is left in it
    if (rank() == 0) fs::remove_all(g_dir);
    barrier();
  }
  for (const std::string kind : {"sgd", "adam"}) {
    if (g_phase == "save")
      save_phase(kind);
    else
      load_phase(kind);
  }
}

TEST(FsdpCheckpoint, EachRankWritesItsOwnRowsOnly) {
  if (g_phase != "save") GTEST_SKIP() << "checked when saving";
  // 1.9 MB of float64 parameters, all in the root unit: a file that held them whole would show.
  torch::manual_seed(3);
  auto big = std::make_shared<torch::nn::LinearImpl>(torch::nn::LinearOptions(400, 600).bias(false));
  big->to(at::kDouble);
  dtrain::fully_shard(big);
  CheckpointManager ckpt(g_dir + "/big");
  TrainingState st;
  st.model = big.get();
  const std::string path = ckpt.save(st);
  const std::string mine = path.substr(0, path.size() - 3) + ".shard" + std::to_string(rank()) + "-of-" +
                           std::to_string(world_size()) + ".pt";
  const int64_t rows_bytes = big->weight.numel() * 8, whole_bytes = 600 * 400 * 8;
  ASSERT_TRUE(fs::exists(mine)) << mine;
  EXPECT_LT(static_cast<int64_t>(fs::file_size(mine)), rows_bytes + 65536) << mine << " holds more than its rows";
  EXPECT_LT(static_cast<int64_t>(fs::file_size(path)), 65536) << path << " holds rows (whole: " << whole_bytes << " B)";
  barrier();
}

TEST(FsdpCheckpoint, AModelWithoutFullyShardLoadsItWhole) {
  if (g_phase != "load") GTEST_SKIP() << "checked when loading";
  Net plain = fsdp_models::make_net();
  auto opt = make_optimizer("adam", plain->parameters());
  CheckpointManager ckpt(g_dir, CheckpointOptions().prefix("adam"));
  TrainingState st;
  st.model = plain.ptr().get();
  st.optimizer = opt.get();
  ASSERT_TRUE(ckpt.load_latest(st).has_value());
  // The whole model and the whole optimizer state: one process continues as it would have.
  for (int s = kStepsBefore; s < kStepsBefore + kStepsAfter; ++s) step(plain, nullptr, *opt, s);
  Net ref = one_process("adam", kStepsBefore + kStepsAfter);
  std::vector<std::pair<std::string, at::Tensor>> mine;
  for (const auto& kv : plain->named_parameters()) mine.emplace_back(kv.key(), kv.value());
  EXPECT_LT(max_rel_diff(mine, *ref), 1e-10);
}

TEST(FsdpCheckpoint, AMissingShardFailsTheLoadOnEveryRank) {
  if (g_phase != "load") GTEST_SKIP() << "checked when loading";
  // A copy of the folder without the last saved rank's shard files.
  const std::string copy = g_dir + "_missing";
  if (rank() == 0) {
    fs::remove_all(copy);
    fs::copy(g_dir, copy);
    for (const auto& e : fs::directory_iterator(copy))
      if (e.path().filename().string().find(".shard" + std::to_string(g_saved_world - 1) + "-of-") != std::string::npos)
        fs::remove(e.path());
  }
  barrier();
  Net net = fsdp_models::make_net();
  fsdp_models::shard(net);
  std::map<std::string, at::Tensor> before;
  for (const auto& kv : net->named_parameters()) before[kv.key()] = kv.value().detach().clone();
  CheckpointManager ckpt(copy, CheckpointOptions().prefix("sgd"));
  TrainingState st;
  st.model = net.ptr().get();
  try {
    ckpt.load_latest(st);
    ADD_FAILURE() << "a checkpoint without the shard of rank " << g_saved_world - 1 << " loaded on rank " << rank();
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), testing::HasSubstr(".shard" + std::to_string(g_saved_world - 1) + "-of-"));
    EXPECT_THAT(e.what(), testing::HasSubstr("must be one they share"));
  }
  for (const auto& kv : net->named_parameters())
    EXPECT_TRUE(at::equal(kv.value(), before.at(kv.key()))) << kv.key() << " changed by a failed load";
  barrier();
  if (rank() == 0) fs::remove_all(copy);
}

DTRAIN_DIST_PHASE_TEST_MAIN()
