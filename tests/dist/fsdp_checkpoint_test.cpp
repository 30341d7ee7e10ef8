// Checkpoints of fully_shard'ed models across world sizes. N ranks train 4 steps, save (every rank
// its own part of the DCP folder), train 4 more and record where that leads (`fsdp_checkpoint_test save <dir>`);
// then M ranks load (`fsdp_checkpoint_test load <dir> <N>`) and train the same 4 steps. On M = N the
// continuation is bit for bit the recorded one (an exact resume); on M != N parameters and optimizer
// state are resliced onto the new layout and the continuation equals one process's on the whole
// batch within 1e-10 (float64). Also: no rank wrote the whole model (each rank's item file holds its
// rows only), the full state dict at the save equals the one-process model, a model without
// fully_shard loads the sharded checkpoint whole, and a missing item file fails the load on every
// rank, naming the file, before anything changed. Also a model sharded over subgroups (ShardedOverSubgroups): on 4
// ranks two replica groups {0, 1} and {2, 3}, on 3 ranks {0, 1} and {2} alone, on 2 the world; every
// group trains the whole batch split among its ranks, so each equals one process. Loaded on the world
// that saved with groups alike ({0, 1} and {2, 3}) it continues bit for bit; else it takes each
// rank's rows from the stored chunks that hold them and equals one process within 1e-10, parameters
// and Adam's state. Ranks that do not all shard the same parameters
// fail the save on every rank. ctest runs 3 -> 3, 3 -> 2, 4 -> 4 and 4 -> 3.
#include <torch/nn/modules/linear.h>
#include <torch/optim/adam.h>
#include <torch/optim/sgd.h>
#include <torch/serialize.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "compat/optim_compat.h"
#include "dist_main.h"
#include "dtrain/checkpoint.h"
#include "dtrain/fsdp.h"
#include "dtrain/process_group.h"
#include "fsdp_models.h"
#include "matchers.h"

using namespace dtrain;
using fsdp_models::Net;
namespace fs = std::filesystem;

namespace {

using fsdp_models::max_rel_diff;

constexpr int kStepsBefore = 4, kStepsAfter = 4;

const std::string& g_phase = phase_args().phase;
const std::string& g_dir = phase_args().dir;
const int64_t& g_saved_world = phase_args().saved_world;

std::unique_ptr<torch::optim::Optimizer> make_optimizer(const std::string& kind, std::vector<at::Tensor> params) {
  if (kind == "sgd") return std::make_unique<torch::optim::SGD>(params, torch::optim::SGDOptions(0.05).momentum(0.9));
  return std::make_unique<torch::optim::Adam>(params, torch::optim::AdamOptions(1e-2));
}

// One step: this rank's part of the batch through the model sharded over `group` (`root`), or the
// whole batch through a plain one.
void step(Net& net, FSDPModule<fsdp_models::NetImpl>* root, torch::optim::Optimizer& opt, int s,
          const Group& group = Group()) {
  auto [x, y] = fsdp_models::batch(s);
  if (root) fsdp_models::keep_this_ranks_part(x, y, group);
  opt.zero_grad();
  ((root ? (*root)(x) : net->forward(x)) - y).pow(2).mean().backward();
  opt.step();
}

// One process's model and optimizer after `steps` steps on the whole batch.
struct OneProcess {
  Net net = fsdp_models::make_net();
  std::unique_ptr<torch::optim::Optimizer> opt;
};
OneProcess one_process_run(const std::string& kind, int steps) {
  OneProcess ref;
  ref.opt = make_optimizer(kind, ref.net->parameters());
  for (int s = 0; s < steps; ++s) step(ref.net, nullptr, *ref.opt, s);
  return ref;
}
Net one_process(const std::string& kind, int steps) { return one_process_run(kind, steps).net; }

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
  const std::string mine = path.substr(0, path.size() - 3) + ".dcp/__" + std::to_string(rank()) + "_0.distcp";
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
  // A copy of the folder without the last saved rank's item files.
  const std::string copy = g_dir + "_missing", lost = "__" + std::to_string(g_saved_world - 1) + "_0.distcp";
  if (rank() == 0) {
    fs::remove_all(copy);
    fs::copy(g_dir, copy, fs::copy_options::recursive);
    for (const auto& e : fs::recursive_directory_iterator(copy))
      if (e.path().filename() == lost) fs::remove(e.path());
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
    ADD_FAILURE() << "a checkpoint without the items of rank " << g_saved_world - 1 << " loaded on rank " << rank();
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), testing::HasSubstr(lost));
  }
  for (const auto& kv : net->named_parameters())
    EXPECT_TRUE(at::equal(kv.value(), before.at(kv.key()))) << kv.key() << " changed by a failed load";
  barrier();
  if (rank() == 0) fs::remove_all(copy);
}

namespace {

// --- a model sharded over subgroups ----------------------------------------------------------------

// The group this rank shards the model over, by world size: two replica groups on 4 ranks (HSDP's
// layout), {0, 1} and {2} alone on 3, the world on any other.
Group replica_group(int world) {
  std::vector<std::vector<int>> groups;
  if (world == 4) groups = {{0, 1}, {2, 3}};
  if (world == 3) groups = {{0, 1}, {2}};
  Group mine;
  for (const auto& ranks : groups) {  // every rank creates every group, in this order
    Group g = new_group(ranks);
    if (g.is_member()) mine = g;
  }
  return mine;
}

// Where the group's continuation is recorded (each group's own: {2} alone rounds otherwise than {0, 1}).
std::string group_recorded_path(const Group& group) {
  return g_dir + "/groups_continued_" + std::to_string(group.ranks()[0]) + ".pt";
}

std::string header_line(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::string line;
  std::getline(in, line);
  return line;
}

// This rank's Adam state is its rows of one process's after kStepsBefore steps.
void expect_adam_state_of_one_process(Net& net, torch::optim::Optimizer& opt, const Group& group) {
  OneProcess ref = one_process_run("adam", kStepsBefore);
  auto ref_params = ref.net->named_parameters();
  double worst = 0;
  for (const auto& kv : net->named_parameters()) {
    const at::Tensor& whole = ref_params[kv.key()];
    const int64_t rows = whole.size(0), chunk = (rows + group.size() - 1) / group.size();
    const int64_t lo = std::min(rows, group.rank() * chunk), hi = std::min(rows, lo + chunk);
    auto it = opt.state().find(compat::optimizer_state_key(kv.value()));
    auto ref_it = ref.opt->state().find(compat::optimizer_state_key(whole));
    if (hi == lo) continue;                                             // this rank holds none of its rows
    if (ref_it == ref.opt->state().end() || it == opt.state().end()) {  // never stepped (no gradient)
      // A load may make the state of step 0 (zeros) that PyTorch's keys list for every parameter.
      const auto* here =
          it == opt.state().end() ? nullptr : static_cast<torch::optim::AdamParamState*>(it->second.get());
      EXPECT_TRUE(ref_it == ref.opt->state().end() &&
                  (!here || (here->step() == 0 && here->exp_avg().abs().max().item<double>() == 0)))
          << kv.key() << ": Adam state here or in one process only";
      continue;
    }
    const auto& mine = static_cast<torch::optim::AdamParamState&>(*it->second);
    const auto& theirs = static_cast<torch::optim::AdamParamState&>(*ref_it->second);
    EXPECT_EQ(mine.step(), theirs.step()) << kv.key();
    for (const auto& [a, b] :
         {std::pair(mine.exp_avg(), theirs.exp_avg()), std::pair(mine.exp_avg_sq(), theirs.exp_avg_sq())}) {
      const at::Tensor expected = b.narrow(0, lo, hi - lo);
      ASSERT_EQ(a.sizes(), expected.sizes()) << kv.key() << ": rows " << lo << ".." << hi;
      if (a.numel() == 0) continue;
      const double scale = std::max(b.abs().max().item<double>(), 1e-12);
      worst = std::max(worst, (a - expected).abs().max().item<double>() / scale);
    }
  }
  EXPECT_LT(worst, 1e-10) << "Adam's state, saved on " << g_saved_world << " ranks, loaded on " << world_size();
}

// Trains the model sharded over `group` (HSDP's replicas when groups are disjoint) and saves it, then
// records where 4 more steps lead.
void save_over_groups(const Group& group) {
  Net net = fsdp_models::make_net();
  auto root = fsdp_models::shard(net, FullyShardOptions().process_group(group));
  auto opt = make_optimizer("adam", net->parameters());
  for (int s = 0; s < kStepsBefore; ++s) step(net, &root, *opt, s, group);
  CheckpointManager ckpt(g_dir + "/groups", CheckpointOptions().prefix("groups"));
  TrainingState st;
  st.model = net.ptr().get();
  st.optimizer = opt.get();
  st.step = kStepsBefore;
  const std::string path = ckpt.save(st);
  // Format version 4 (the model in a DCP folder), which dtrains of the per-rank shard files refuse.
  EXPECT_EQ(header_line(path).rfind("DTRAIN-CHECKPOINT 4 ", 0), 0u) << header_line(path);
  EXPECT_TRUE(fs::exists(path.substr(0, path.size() - 3) + ".dcp/.metadata")) << path;
  EXPECT_LT(max_rel_diff(root.full_state_dict(), *one_process("adam", kStepsBefore)), 1e-10);
  for (int s = kStepsBefore; s < kStepsBefore + kStepsAfter; ++s) step(net, &root, *opt, s, group);
  auto continued = values_of(root.full_state_dict());
  if (group.rank() == 0) torch::save(continued, group_recorded_path(group));
  barrier();
}

// Loads the save into the model sharded over `group` and trains 4 more steps: bit for bit the run
// that saved when `exact` (the same groups), else one process's within 1e-10, Adam's state too.
void load_over_groups(const Group& group, bool exact) {
  Net net = fsdp_models::make_net();
  auto root = fsdp_models::shard(net, FullyShardOptions().process_group(group));
  auto opt = make_optimizer("adam", net->parameters());
  CheckpointManager ckpt(g_dir + "/groups", CheckpointOptions().prefix("groups"));
  TrainingState st;
  st.model = net.ptr().get();
  st.optimizer = opt.get();
  ASSERT_TRUE(ckpt.load_latest(st).has_value());
  ASSERT_EQ(st.saved_world_size, g_saved_world);
  if (!exact) expect_adam_state_of_one_process(net, *opt, group);
  for (int s = kStepsBefore; s < kStepsBefore + kStepsAfter; ++s) step(net, &root, *opt, s, group);
  const auto whole = root.full_state_dict();
  if (exact) {
    std::vector<at::Tensor> recorded;
    torch::load(recorded, group_recorded_path(group));
    ASSERT_EQ(recorded.size(), whole.size());
    for (size_t i = 0; i < whole.size(); ++i)
      EXPECT_TRUE(at::equal(whole[i].second, recorded[i]))
          << whole[i].first << " differs from the run that saved (exact resume over the group of " << group.size()
          << ")";
    return;
  }
  const double worst = max_rel_diff(whole, *one_process("adam", kStepsBefore + kStepsAfter));
  if (rank() == 0)
    std::printf("subgroups, %lld ranks -> groups of %d of %d ranks: max relative difference %.3g\n",
                static_cast<long long>(g_saved_world), group.size(), world_size(), worst);
  EXPECT_LT(worst, 1e-10) << "saved over subgroups on " << g_saved_world << " ranks, resumed over a group of "
                          << group.size() << " of " << world_size();
}

}  // namespace

// Saved by every world rank, each sharding over its own group; loaded over this world's groups (the
// same as the save's on the same world), over the world, and into a model without fully_shard: each
// rank's rows from the stored chunks that hold them. DCP stores one copy of rows that several ranks
// hold: replicas cut alike (HSDP's {0, 1} and {2, 3}) compute the same bits, and resume bit for bit;
// on 3 ranks {2} alone rounds otherwise than {0, 1}, whose chunks stand for its whole tensor (Note
// [Replicas cut unlike]), so it resumes within 1e-10 of one process.
TEST(FsdpCheckpoint, ShardedOverSubgroups) {
  const Group group = replica_group(world_size());
  if (g_phase == "save") {
    save_over_groups(group);
    return;
  }
  load_over_groups(group, g_saved_world == world_size() && world_size() != 3);
  if (group.size() != world_size()) load_over_groups(Group(), false);
  // A model without fully_shard loads it whole.
  Net plain = fsdp_models::make_net();
  auto opt = make_optimizer("adam", plain->parameters());
  CheckpointManager ckpt(g_dir + "/groups", CheckpointOptions().prefix("groups"));
  TrainingState st;
  st.model = plain.ptr().get();
  st.optimizer = opt.get();
  ASSERT_TRUE(ckpt.load_latest(st).has_value());
  for (int s = kStepsBefore; s < kStepsBefore + kStepsAfter; ++s) step(plain, nullptr, *opt, s);
  std::vector<std::pair<std::string, at::Tensor>> params;
  for (const auto& kv : plain->named_parameters()) params.emplace_back(kv.key(), kv.value());
  EXPECT_LT(max_rel_diff(params, *one_process("adam", kStepsBefore + kStepsAfter)), 1e-10) << "unsharded";
}

// Ranks that do not shard alike fail the save on every rank, naming the rank, and leave no file: the
// last rank's model not sharded at all, then sharding fewer parameters than the others, then the last
// rank alone saying its model is a part of the whole (TrainingState::model_part).
TEST(FsdpCheckpoint, RanksThatShardUnlikeFailTheSaveOnEveryRank) {
  const int n = world_size();
  std::vector<int> others;
  for (int r = 0; r + 1 < n; ++r) others.push_back(r);
  const Group a = new_group(others), b = new_group({n - 1});  // every rank creates both, in this order
  const bool last = rank() == n - 1;
  const std::string dir = g_dir + "_unlike";
  auto expect_refused = [&](Net& net, const std::string& part, bool model_part = false) {
    CheckpointManager ckpt(dir);
    TrainingState st;
    st.model = net.ptr().get();
    st.model_part = model_part;
    try {
      ckpt.save(st);
      ADD_FAILURE() << "saved on rank " << rank() << " (" << part << ")";
    } catch (const Error& e) {
      EXPECT_THAT(e.what(), testing::HasSubstr(part));
      EXPECT_THAT(e.what(), testing::HasSubstr("rank " + std::to_string(n - 1)));
    }
    barrier();
    EXPECT_TRUE(!fs::exists(dir) || fs::is_empty(dir)) << dir << " holds files of a failed save";
    barrier();
  };
  {
    Net net = fsdp_models::make_net();
    if (!last) fsdp_models::shard(net, FullyShardOptions().process_group(a));
    expect_refused(net, "is not sharded");
  }
  {
    Net net = fsdp_models::make_net();
    if (last)
      dtrain::fully_shard(net->inner.module()->b, FullyShardOptions().process_group(b));
    else
      fsdp_models::shard(net, FullyShardOptions().process_group(a));
    expect_refused(net, "are not those of rank 0");
  }
  {
    Net net = fsdp_models::make_net();
    expect_refused(net, "TrainingState::model_part is set on rank", /*model_part=*/last);
  }
  if (rank() == 0) fs::remove_all(dir);
}

DTRAIN_DIST_PHASE_TEST_MAIN()
