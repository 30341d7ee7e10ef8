// Checkpoints of a tensor-parallel model (an MLP block, w1 Colwise: dim 0, w2 Rowwise: dim 1, on a
// {dp, tp} mesh with tp = 2; on 4 ranks the two dp rows hold equal parts):
//   - CheckpointManager: every rank writes its own part; loaded back onto the TP layout, parameters
//     and Adam's state are bit-identical to what was saved, and the run continues bit for bit;
//   - the same checkpoint loads into the unsharded model on every rank: its parameters and Adam's
//     state are the parts put together (bit-identical), and one more Adam step of it equals the TP
//     model's within 1e-10;
//   - onto another tp size (2 saved, the world loading, and the world saved, 2 and the unsharded
//     model loading): each rank's part of the same whole;
//   - dcp::save of the TP model writes each part as a chunk of the whole; dcp::load reads it back
//     into the TP model and into the unsharded model, bit-identical; over a subgroup (each tp group
//     its own folder), each replica gets its own back;
//   - TP inside fully_shard (2-D: a {dp 2, tp 2} mesh on 4 ranks, {dp 1, tp 2} on 2): the specs
//     compose TP's cut and fully_shard's; dcp::save then dcp::load into a fresh 2-D model is
//     bit-identical (parameters, Adam's state, training on); the folder loads resharded onto
//     {dp 1, tp 2}, {dp 2, tp 1} and the unsharded model with the saver's whole parameters; the
//     whole state equals the unsharded model trained alike; CheckpointManager saves it, resumes
//     bit for bit on the same mesh and reshards as dcp does;
//   - CheckpointManager's save_async stages each rank's chunks; rotation removes a rotated
//     checkpoint's DCP folder, and a folder rewritten after its main file makes load_latest fall back.
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/optim/adam.h>

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "compat/optim_compat.h"  // Adam's state of a parameter
#include "dist_main.h"
#include "matchers.h"
#include "dtrain/checkpoint.h"
#include "dtrain/dcp.h"
#include "dtrain/device_mesh.h"
#include "dtrain/fsdp.h"
#include "dtrain/shard_spec.h"
#include "dtrain/tensor_parallel.h"
#include "tp_compare.h"
#include "tp_models.h"

using namespace dtrain;
namespace fs = std::filesystem;
using tp_compare::part_of;
using tp_compare::rel_diff;

namespace {

constexpr int64_t kDim = 8, kHidden = 16;

std::string fresh_dir(const std::string& name) {
  const std::string dir = "/tmp/dtrain_tp_ckpt_" + std::to_string(getppid()) + "_" + name;
  if (rank() == 0) fs::remove_all(dir);
  barrier();
  return dir;
}

void remove_dir(const std::string& dir) {
  barrier();
  if (rank() == 0) fs::remove_all(dir);
}

tp_models::MLP make_mlp(int seed) {
  torch::manual_seed(seed);
  tp_models::MLP m(kDim, kHidden);
  m->to(at::kDouble);
  return m;
}

// Adam steps on batches every rank draws alike.
void train(tp_models::MLP& m, torch::optim::Optimizer& opt, int steps, int seed) {
  torch::manual_seed(seed);
  for (int s = 0; s < steps; ++s) {
    at::Tensor x = at::randn({4, kDim}, at::kDouble), y = at::randn({4, kDim}, at::kDouble);
    opt.zero_grad();
    (m(x) - y).pow(2).mean().backward();
    opt.step();
  }
}

torch::optim::AdamParamState& adam_state(torch::optim::Adam& opt, const at::Tensor& p) {
  return static_cast<torch::optim::AdamParamState&>(*opt.state().at(compat::optimizer_state_key(p)));
}

// Every parameter of `tp` and its Adam state, against their parts of `whole`'s: bit-identical.
void expect_parts_of(tp_models::MLP& tp, torch::optim::Adam& tp_opt, tp_models::MLP& whole,
                     torch::optim::Adam& whole_opt, const Group& g) {
  auto w = whole->named_parameters();
  for (const auto& p : tp->named_parameters()) {
    const at::Tensor& q = w[p.key()];
    EXPECT_TRUE(at::equal(p.value(), part_of(q, p.value(), g))) << p.key();
    auto &a = adam_state(tp_opt, p.value()), &b = adam_state(whole_opt, q);
    EXPECT_EQ(a.step(), b.step()) << p.key();
    EXPECT_TRUE(at::equal(a.exp_avg(), part_of(b.exp_avg(), a.exp_avg(), g))) << p.key() << " exp_avg";
    EXPECT_TRUE(at::equal(a.exp_avg_sq(), part_of(b.exp_avg_sq(), a.exp_avg_sq(), g))) << p.key() << " exp_avg_sq";
  }
}

struct Trained {
  DeviceMesh mesh;
  tp_models::MLP model = make_mlp(3);
  std::unique_ptr<torch::optim::Adam> opt;
};

// A TP model after 2 Adam steps.
Trained trained_tp() {
  Trained t;
  t.mesh = init_device_mesh({world_size() / 2, 2}, {"dp", "tp"});
  parallelize_module(*t.model, t.mesh["tp"], tp_models::mlp_plan());
  t.opt = std::make_unique<torch::optim::Adam>(t.model->parameters(), torch::optim::AdamOptions(1e-2));
  train(t.model, *t.opt, 2, 10);
  return t;
}

TrainingState state_of(tp_models::MLP& m, torch::optim::Optimizer& opt, int64_t step) {
  TrainingState st;
  st.model = m.get();
  st.optimizer = &opt;
  st.step = step;
  return st;
}

}  // namespace

TEST(TensorParallelCheckpoint, LoadsBackOntoTheTPLayoutBitIdentical) {
  Trained t = trained_tp();
  const std::string dir = fresh_dir("back");
  CheckpointManager ckpt(dir);
  ckpt.save(state_of(t.model, *t.opt, 2));
  // Each rank wrote its own part into the DCP folder (format version 4), Rowwise weights as columns.
  const std::string part = dir + "/checkpoint_0000000002.dcp/__" + std::to_string(rank()) + "_0.distcp";
  ASSERT_TRUE(fs::exists(part)) << part;
  {
    std::ifstream in(dir + "/checkpoint_0000000002.pt");
    std::string line;
    std::getline(in, line);
    EXPECT_EQ(line.rfind("DTRAIN-CHECKPOINT 4 ", 0), 0u) << line;
  }

  tp_models::MLP loaded = make_mlp(99);  // other weights until loaded
  parallelize_module(*loaded, t.mesh["tp"], tp_models::mlp_plan());
  torch::optim::Adam opt(loaded->parameters(), torch::optim::AdamOptions(1e-2));
  TrainingState st = state_of(loaded, opt, 0);
  ASSERT_TRUE(ckpt.load_latest(st).has_value());
  EXPECT_EQ(st.step, 2);
  expect_parts_of(loaded, opt, t.model, *t.opt, Group());  // same shapes: compared whole

  train(t.model, *t.opt, 2, 20);  // the exact resume continues bit for bit
  train(loaded, opt, 2, 20);
  expect_parts_of(loaded, opt, t.model, *t.opt, Group());
  remove_dir(dir);
}

// Rotation removes a rotated checkpoint's DCP folder with its main file; a folder rewritten after
// its main file (a later save of the same step that failed half-way) makes that checkpoint unusable,
// and load_latest falls back to the previous one rather than mix two saves.
TEST(TensorParallelCheckpoint, RotationAndARewrittenFolder) {
  Trained t = trained_tp();
  const std::string dir = fresh_dir("rotate");
  CheckpointManager ckpt(dir, CheckpointOptions().keep(2));
  for (int64_t step : {1, 2, 3}) ckpt.save(state_of(t.model, *t.opt, step));
  barrier();
  EXPECT_FALSE(fs::exists(dir + "/checkpoint_0000000001.dcp")) << "the rotated checkpoint's folder is left";
  EXPECT_TRUE(fs::exists(dir + "/checkpoint_0000000002.dcp/.metadata"));
  barrier();
  if (rank() == 0) std::ofstream(dir + "/checkpoint_0000000003.dcp/.metadata", std::ios::app) << "x";
  barrier();
  tp_models::MLP loaded = make_mlp(99);
  parallelize_module(*loaded, t.mesh["tp"], tp_models::mlp_plan());
  torch::optim::Adam opt(loaded->parameters(), torch::optim::AdamOptions(1e-2));
  TrainingState st = state_of(loaded, opt, 0);
  ::testing::internal::CaptureStderr();
  const auto path = ckpt.load_latest(st);
  const std::string err = ::testing::internal::GetCapturedStderr();
  ASSERT_TRUE(path.has_value());
  EXPECT_EQ(*path, dir + "/checkpoint_0000000002.pt");
  EXPECT_EQ(st.step, 2);
  if (rank() == 0) {
    EXPECT_THAT(err, ::testing::HasSubstr("was rewritten after it")) << err;
  }
  remove_dir(dir);
}

// save_async of a sharded model: every rank stages its chunks, so the steps taken while its thread
// writes do not reach the checkpoint; the checkpoint exists once wait() wrote the folder's metadata
// and the main file, and loads the parameters as they were at the save, bit for bit.
TEST(TensorParallelCheckpoint, SaveAsyncStagesTheChunks) {
  // Parts of 8 MB, so that the thread is still writing when the parameters change in place.
  auto make = [](int seed) {
    torch::manual_seed(seed);
    torch::nn::Sequential m(ParallelLinear(1024, 2048));
    m->to(at::kDouble);
    parallelize_module(*m, Group(), {{"0", ColwiseParallel()}});
    return m;
  };
  torch::nn::Sequential model = make(3);
  torch::optim::Adam opt(model->parameters(), torch::optim::AdamOptions(1e-2));
  const auto at_save = full_state_dict(*model);
  const std::string dir = fresh_dir("async");
  CheckpointManager ckpt(dir);
  TrainingState st;
  st.model = model.ptr().get();
  st.optimizer = &opt;
  st.step = 2;
  const std::string path = ckpt.save_async(st);
  {
    at::NoGradGuard no_grad;
    for (auto& p : model->parameters()) p.fill_(7.0);  // at once, while the thread writes
  }
  barrier();
  EXPECT_FALSE(fs::exists(path)) << "the main file before the folder's metadata";
  ckpt.wait();
  ASSERT_TRUE(fs::exists(path));
  torch::nn::Sequential loaded = make(99);
  torch::optim::Adam loaded_opt(loaded->parameters(), torch::optim::AdamOptions(1e-2));
  TrainingState back;
  back.model = loaded.ptr().get();
  back.optimizer = &loaded_opt;
  ASSERT_TRUE(ckpt.load_latest(back).has_value());
  const auto now = full_state_dict(*loaded);
  ASSERT_EQ(now.size(), at_save.size());
  for (size_t i = 0; i < now.size(); ++i)
    EXPECT_TRUE(at::equal(now[i].second, at_save[i].second)) << now[i].first << ": not as it was at save_async";
  remove_dir(dir);
}

TEST(TensorParallelCheckpoint, LoadsIntoTheUnshardedModel) {
  Trained t = trained_tp();
  const std::string dir = fresh_dir("whole");
  CheckpointManager ckpt(dir);
  ckpt.save(state_of(t.model, *t.opt, 2));

  tp_models::MLP whole = make_mlp(99);
  torch::optim::Adam opt(whole->parameters(), torch::optim::AdamOptions(1e-2));
  TrainingState st = state_of(whole, opt, 0);
  ASSERT_TRUE(ckpt.load_latest(st).has_value());
  EXPECT_EQ(whole->w2->weight.sizes(), (std::vector<int64_t>{kDim, kHidden}));
  const Group tp = t.mesh.get_group("tp");
  expect_parts_of(t.model, *t.opt, whole, opt, tp);

  train(t.model, *t.opt, 1, 30);  // one more step on each: the same parameters
  train(whole, opt, 1, 30);
  auto w = whole->named_parameters();
  for (const auto& p : t.model->named_parameters())
    EXPECT_LT(rel_diff(p.value(), part_of(w[p.key()], p.value(), tp)), 1e-10) << p.key() << " after a step";
  remove_dir(dir);
}

// Saved (by save_async) with tp = 2, loaded with tp over the whole world (4 ranks: each part is
// half a saved part, resliced with its Adam state; 2 ranks: the same layout): the parts of what the
// unsharded model loads.
TEST(TensorParallelCheckpoint, LoadsOntoAnotherTPSize) {
  Trained t = trained_tp();
  const std::string dir = fresh_dir("resize");
  CheckpointManager ckpt(dir);
  ckpt.save_async(state_of(t.model, *t.opt, 2));  // for a sharded model, as save() does
  ckpt.wait();
  tp_models::MLP whole = make_mlp(99), wide = make_mlp(98);
  const Group world;
  parallelize_module(*wide, world, tp_models::mlp_plan());
  torch::optim::Adam whole_opt(whole->parameters(), torch::optim::AdamOptions(1e-2));
  torch::optim::Adam wide_opt(wide->parameters(), torch::optim::AdamOptions(1e-2));
  TrainingState a = state_of(whole, whole_opt, 0), b = state_of(wide, wide_opt, 0);
  ASSERT_TRUE(ckpt.load_latest(a).has_value());
  ASSERT_TRUE(ckpt.load_latest(b).has_value());
  EXPECT_EQ(wide->w2->weight.size(1), kHidden / world_size());
  expect_parts_of(wide, wide_opt, whole, whole_opt, world);
  remove_dir(dir);
}

// The other way: saved with tp over the whole world (4 ranks: 4 parts), loaded with tp = 2 (each part
// two saved parts put together, Adam's state too) and into the unsharded model (all of them).
TEST(TensorParallelCheckpoint, LoadsOntoASmallerTPSizeAndUnsharded) {
  const Group world;
  tp_models::MLP wide = make_mlp(3);
  parallelize_module(*wide, world, tp_models::mlp_plan());
  torch::optim::Adam wide_opt(wide->parameters(), torch::optim::AdamOptions(1e-2));
  train(wide, wide_opt, 2, 10);
  const std::string dir = fresh_dir("shrink");
  CheckpointManager ckpt(dir);
  ckpt.save(state_of(wide, wide_opt, 2));

  tp_models::MLP whole = make_mlp(99);
  torch::optim::Adam whole_opt(whole->parameters(), torch::optim::AdamOptions(1e-2));
  TrainingState a = state_of(whole, whole_opt, 0);
  ASSERT_TRUE(ckpt.load_latest(a).has_value());
  EXPECT_EQ(whole->w2->weight.sizes(), (std::vector<int64_t>{kDim, kHidden}));
  expect_parts_of(wide, wide_opt, whole, whole_opt, world);  // the saved parts, each where it belongs

  DeviceMesh mesh = init_device_mesh({world_size() / 2, 2}, {"dp", "tp"});
  tp_models::MLP narrow = make_mlp(98);
  parallelize_module(*narrow, mesh["tp"], tp_models::mlp_plan());
  torch::optim::Adam narrow_opt(narrow->parameters(), torch::optim::AdamOptions(1e-2));
  TrainingState b = state_of(narrow, narrow_opt, 0);
  ASSERT_TRUE(ckpt.load_latest(b).has_value());
  EXPECT_EQ(narrow->w2->weight.size(1), kHidden / 2);
  expect_parts_of(narrow, narrow_opt, whole, whole_opt, mesh.get_group("tp"));
  remove_dir(dir);
}

// dcp over a subgroup: each tp group (a dp replica of the mesh: {0, 1} and {2, 3} on 4 ranks) saves
// its own model, made different from the other replica's, to its own folder over its own group, and
// loads it back over that group alone: each gets its own bits, and the other replica's folder is
// never touched (a save or load that reached outside its group would mix or hang).
TEST(TensorParallelCheckpoint, DcpOverASubgroupSavesAndLoadsEachReplicasOwn) {
  Trained t = trained_tp();
  const Group tp = t.mesh.get_group("tp");
  const int64_t replica = t.mesh.get_local_rank("dp");
  {
    at::NoGradGuard no_grad;
    for (auto& p : t.model->parameters()) p.add_(static_cast<double>(replica));
  }
  const std::string dir = fresh_dir("dcp_subgroup") + "/replica" + std::to_string(replica);
  dcp::StateDict sd = dcp::get_state_dict(*t.model, t.opt.get());
  dcp::save(sd, dir, tp);
  EXPECT_TRUE(fs::exists(dir + "/.metadata"));
  EXPECT_TRUE(fs::exists(dir + "/__" + std::to_string(tp.rank()) + "_0.distcp"))
      << "files are named by the rank in the group";

  tp_models::MLP loaded = make_mlp(99);
  parallelize_module(*loaded, t.mesh["tp"], tp_models::mlp_plan());
  torch::optim::Adam opt(loaded->parameters(), torch::optim::AdamOptions(1e-2));
  dcp::StateDict back = dcp::get_state_dict(*loaded, &opt);
  dcp::load(back, dir, tp);
  dcp::set_state_dict(*loaded, &opt, back);
  expect_parts_of(loaded, opt, t.model, *t.opt, Group());  // same shapes: compared whole
  remove_dir(dir.substr(0, dir.rfind('/')));
}

TEST(TensorParallelCheckpoint, DcpChunksLoadIntoTheTPAndTheUnshardedModel) {
  Trained t = trained_tp();
  const std::string dir = fresh_dir("dcp");
  dcp::StateDict sd = dcp::get_state_dict(*t.model, t.opt.get());
  for (const dcp::Entry& e : sd) {  // the parts are chunks of the whole, PyTorch's Shard(0) / Shard(1)
    if (e.key() == "model.w1.weight") {
      EXPECT_EQ(e.global_shape, (std::vector<int64_t>{kHidden, kDim}));
      EXPECT_EQ(e.offsets, (std::vector<int64_t>{t.mesh.get_local_rank("tp") * kHidden / 2, 0}));
    }
    if (e.key() == "model.w2.weight") {
      EXPECT_EQ(e.global_shape, (std::vector<int64_t>{kDim, kHidden}));
      EXPECT_EQ(e.offsets, (std::vector<int64_t>{0, t.mesh.get_local_rank("tp") * kHidden / 2}));
    }
    if (e.key() == "model.w2.bias") {
      EXPECT_TRUE(e.global_shape.empty()) << "replicated: whole";
    }
  }
  dcp::save(sd, dir);

  auto load_into = [&](tp_models::MLP& m, torch::optim::Adam& opt) {
    dcp::StateDict into = dcp::get_state_dict(*m, &opt);
    dcp::load(into, dir);
    dcp::set_state_dict(*m, &opt, into);
  };
  tp_models::MLP back = make_mlp(99);
  parallelize_module(*back, t.mesh["tp"], tp_models::mlp_plan());
  torch::optim::Adam back_opt(back->parameters(), torch::optim::AdamOptions(1e-2));
  load_into(back, back_opt);
  expect_parts_of(back, back_opt, t.model, *t.opt, Group());

  tp_models::MLP whole = make_mlp(99);
  torch::optim::Adam whole_opt(whole->parameters(), torch::optim::AdamOptions(1e-2));
  load_into(whole, whole_opt);
  expect_parts_of(t.model, *t.opt, whole, whole_opt, t.mesh.get_group("tp"));
  remove_dir(dir);
}

namespace {

// ---- TP inside fully_shard (2-D) -------------------------------------------------------------------

// The MLP's TP parts over mesh["tp"], cut again on dim 0 by fully_shard over mesh["dp"] (one unit:
// the MLP calls its layers itself), trained with Adam, each dp row on its part of the batch.
// Meshes of fewer ranks than the world add a leading "rep" dimension: each replica the same model.
struct TwoD {
  DeviceMesh mesh;
  tp_models::MLP model;
  std::optional<FSDPModule<tp_models::MLPImpl>> fsdp;
  std::unique_ptr<torch::optim::Adam> opt;
  Group dp() const { return mesh.get_group("dp"); }
  Group tp() const { return mesh.get_group("tp"); }
};

DeviceMesh dp_tp_mesh(int64_t dp, int64_t tp) {
  const int64_t rep = world_size() / (dp * tp);
  return rep == 1 ? init_device_mesh({dp, tp}, {"dp", "tp"}) : init_device_mesh({rep, dp, tp}, {"rep", "dp", "tp"});
}

TwoD make_2d(int64_t dp, int64_t tp, int seed) {
  TwoD t{dp_tp_mesh(dp, tp), make_mlp(seed), std::nullopt, nullptr};
  parallelize_module(*t.model, t.mesh["tp"], tp_models::mlp_plan());
  t.fsdp = fully_shard(t.model, FullyShardOptions().mesh(t.mesh["dp"]));
  t.opt = std::make_unique<torch::optim::Adam>(t.model->parameters(), torch::optim::AdamOptions(1e-2));
  return t;
}

// Adam steps on the batches train() draws, each dp row on its rows of them.
void train_2d(TwoD& t, int steps, int seed) {
  torch::manual_seed(seed);
  const Group dp = t.dp();
  for (int s = 0; s < steps; ++s) {
    at::Tensor x = at::randn({4, kDim}, at::kDouble), y = at::randn({4, kDim}, at::kDouble);
    x = x.chunk(dp.size())[dp.rank()];
    y = y.chunk(dp.size())[dp.rank()];
    t.opt->zero_grad();
    ((*t.fsdp)(x)-y).pow(2).mean().backward();
    t.opt->step();
  }
}

// A {dp 2, tp 2} model (on 2 ranks {dp 1, tp 2}) after 2 Adam steps.
TwoD trained_2d() {
  TwoD t = make_2d(world_size() / 2, 2, 3);
  train_2d(t, 2, 10);
  return t;
}

void load_dcp(torch::nn::Module& m, torch::optim::Optimizer& opt, const std::string& dir) {
  dcp::StateDict sd = dcp::get_state_dict(m, &opt);
  dcp::load(sd, dir);
  dcp::set_state_dict(m, &opt, sd);
}

// Two models of one layout: every local parameter and its Adam state bit-identical.
void expect_same_locals(TwoD& a, TwoD& b, const std::string& when) {
  auto theirs = b.model->named_parameters();
  for (const auto& p : a.model->named_parameters()) {
    const at::Tensor& q = theirs[p.key()];
    EXPECT_TRUE(at::equal(p.value(), q)) << p.key() << " " << when;
    auto &x = adam_state(*a.opt, p.value()), &y = adam_state(*b.opt, q);
    EXPECT_EQ(x.step(), y.step()) << p.key() << " " << when;
    EXPECT_TRUE(at::equal(x.exp_avg(), y.exp_avg())) << p.key() << " exp_avg " << when;
    EXPECT_TRUE(at::equal(x.exp_avg_sq(), y.exp_avg_sq())) << p.key() << " exp_avg_sq " << when;
  }
}

void expect_equal_wholes(const std::vector<std::pair<std::string, at::Tensor>>& mine,
                         const std::vector<std::pair<std::string, at::Tensor>>& saved, const std::string& what) {
  ASSERT_EQ(mine.size(), saved.size()) << what;
  for (size_t i = 0; i < mine.size(); ++i) {
    EXPECT_EQ(mine[i].first, saved[i].first) << what;
    EXPECT_TRUE(at::equal(mine[i].second, saved[i].second)) << mine[i].first << " " << what;
  }
}

}  // namespace

// The spec of a parameter follows its unit: both cuts while sharded, TP's alone while gathered.
TEST(TensorParallelCheckpoint, TwoDimensionalSpecsComposeAndFollowTheUnit) {
  TwoD t = make_2d(world_size() / 2, 2, 3);
  const Group dp = t.dp(), tp = t.tp();
  const int64_t tp_rows = kHidden / 2, dp_rows = (tp_rows + dp.size() - 1) / dp.size();
  auto w1 = shard_spec_of(t.model->w1->weight);
  ASSERT_TRUE(w1.has_value());
  EXPECT_EQ(w1->full_shape(), (std::vector<int64_t>{kHidden, kDim}));
  ASSERT_EQ(w1->cuts().size(), 2u) << w1->to_string();
  EXPECT_EQ(w1->cuts()[0].group.name(), tp.name()) << "TP's cut first";
  EXPECT_EQ(w1->cuts()[1].group.name(), dp.name());
  EXPECT_EQ(w1->offsets(), (std::vector<int64_t>{tp.rank() * tp_rows + dp.rank() * dp_rows, 0})) << w1->to_string();
  EXPECT_EQ(w1->local_sizes(), t.model->w1->weight.sizes().vec());
  auto w2 = shard_spec_of(t.model->w2->weight);  // Rowwise: TP's columns, then fully_shard's rows
  ASSERT_TRUE(w2.has_value());
  EXPECT_EQ(w2->offsets(), (std::vector<int64_t>{dp.rank() * (kDim / dp.size()), tp.rank() * tp_rows}));
  auto b2 = shard_spec_of(t.model->w2->bias);  // replicated over tp: fully_shard's cut alone
  ASSERT_TRUE(b2.has_value());
  EXPECT_EQ(b2->cuts().size(), 1u) << b2->to_string();

  t.fsdp->unshard();  // whole over dp: TP's part, described by TP's cut alone
  auto gathered = shard_spec_of(t.model->w2->weight);
  ASSERT_TRUE(gathered.has_value());
  EXPECT_EQ(gathered->cuts().size(), 1u) << gathered->to_string();
  EXPECT_EQ(gathered->local_sizes(), t.model->w2->weight.sizes().vec());
  EXPECT_FALSE(shard_spec_of(t.model->w2->bias).has_value()) << "whole on every rank while gathered";
  t.fsdp->reshard();
  EXPECT_EQ(shard_spec_of(t.model->w2->weight)->offsets(), w2->offsets());
  EXPECT_EQ(shard_spec_of(t.model->w2->bias)->cuts().size(), 1u);
}

// (a) dcp::save of the 2-D model, loaded into a fresh one of the same layout: parameters and Adam's
// state bit-identical, and training continues bit for bit.
TEST(TensorParallelCheckpoint, TwoDimensionalDcpLoadsBackBitIdentical) {
  TwoD t = trained_2d();
  const std::string dir = fresh_dir("dcp_2d");
  dcp::StateDict sd = dcp::get_state_dict(*t.model, t.opt.get());
  const Group dp = t.dp(), tp = t.tp();
  for (const dcp::Entry& e : sd) {  // each rank's box: TP's offset plus fully_shard's within it
    if (e.key() == "model.w1.weight" || e.key() == "optim.state.w1.weight.exp_avg") {
      EXPECT_EQ(e.global_shape, (std::vector<int64_t>{kHidden, kDim}));
      EXPECT_EQ(e.offsets, (std::vector<int64_t>{tp.rank() * kHidden / 2 + dp.rank() * kHidden / 2 / dp.size(), 0}))
          << e.key();
    }
    if (e.key() == "model.w2.weight") {
      EXPECT_EQ(e.offsets, (std::vector<int64_t>{dp.rank() * kDim / dp.size(), tp.rank() * kHidden / 2}));
    }
  }
  dcp::save(sd, dir);

  TwoD back = make_2d(dp.size(), tp.size(), 99);  // other weights until loaded
  load_dcp(*back.model, *back.opt, dir);
  expect_same_locals(back, t, "loaded");
  train_2d(t, 2, 20);
  train_2d(back, 2, 20);
  expect_same_locals(back, t, "after 2 more steps");
  remove_dir(dir);
}

// (b) The same folder resharded: {dp 1, tp 2}, {dp 2, tp 1} and the unsharded model on every rank
// load the very whole parameters the saver had.
TEST(TensorParallelCheckpoint, TwoDimensionalDcpLoadsResharded) {
  TwoD t = trained_2d();
  const std::string dir = fresh_dir("dcp_2d_reshard");
  dcp::save(dcp::get_state_dict(*t.model, t.opt.get()), dir);
  const auto saved = full_state_dict(*t.model);
  for (auto [dp, tp] : std::vector<std::pair<int64_t, int64_t>>{{1, 2}, {2, 1}}) {
    if (world_size() % (dp * tp) != 0) continue;
    TwoD other = make_2d(dp, tp, 99);
    load_dcp(*other.model, *other.opt, dir);
    expect_equal_wholes(full_state_dict(*other.model), saved, dtrain::detail::cat("on {dp ", dp, ", tp ", tp, "}"));
  }
  tp_models::MLP whole = make_mlp(99);
  torch::optim::Adam opt(whole->parameters(), torch::optim::AdamOptions(1e-2));
  load_dcp(*whole, opt, dir);
  std::vector<std::pair<std::string, at::Tensor>> mine;
  for (const auto& p : whole->named_parameters()) mine.emplace_back(p.key(), p.value());
  expect_equal_wholes(mine, saved, "unsharded");
  remove_dir(dir);
}

// (c) The whole state of the 2-D model (and the same through fully_shard's and TP's names for it)
// equals the unsharded model's trained on the whole batches.
TEST(TensorParallelCheckpoint, TwoDimensionalFullStateDictEqualsTheUnshardedModel) {
  TwoD t = make_2d(world_size() / 2, 2, 3);
  tp_models::MLP ref = make_mlp(3);
  torch::optim::Adam ref_opt(ref->parameters(), torch::optim::AdamOptions(1e-2));
  train_2d(t, 4, 10);
  train(ref, ref_opt, 4, 10);
  const auto whole = full_state_dict(*t.model);
  auto r = ref->named_parameters();
  ASSERT_EQ(whole.size(), r.size());
  for (const auto& [name, w] : whole) {
    EXPECT_EQ(w.scalar_type(), at::kDouble) << name;
    EXPECT_LT(rel_diff(w, r[name]), 1e-10) << name;
  }
  expect_equal_wholes(t.fsdp->full_state_dict(), whole, "FSDPModule::full_state_dict");
  expect_equal_wholes(dtrain::tp::full_state_dict(*t.model), whole, "tp::full_state_dict");
}

// CheckpointManager on a 2-D model: its DCP folder loads back onto the same mesh bit for bit (the
// exact resume: training continues bit for bit), and resharded onto {dp 1, tp 2}, {dp 2, tp 1} and
// the unsharded model with the very whole parameters the saver had.
TEST(TensorParallelCheckpoint, CheckpointManagerSavesTwoDimensionalSharding) {
  TwoD t = trained_2d();
  const std::string dir = fresh_dir("2d");
  CheckpointManager ckpt(dir);
  ckpt.save(state_of(t.model, *t.opt, 2));
  const auto saved = full_state_dict(*t.model);

  TwoD back = make_2d(t.dp().size(), t.tp().size(), 99);  // other weights until loaded
  TrainingState st = state_of(back.model, *back.opt, 0);
  ASSERT_TRUE(ckpt.load_latest(st).has_value());
  EXPECT_EQ(st.step, 2);
  expect_same_locals(back, t, "loaded");
  for (auto [dp, tp] : std::vector<std::pair<int64_t, int64_t>>{{1, 2}, {2, 1}}) {
    if (world_size() % (dp * tp) != 0) continue;
    TwoD other = make_2d(dp, tp, 99);
    TrainingState ost = state_of(other.model, *other.opt, 0);
    ASSERT_TRUE(ckpt.load_latest(ost).has_value());
    expect_equal_wholes(full_state_dict(*other.model), saved, dtrain::detail::cat("on {dp ", dp, ", tp ", tp, "}"));
  }
  tp_models::MLP whole = make_mlp(99);
  torch::optim::Adam opt(whole->parameters(), torch::optim::AdamOptions(1e-2));
  TrainingState wst = state_of(whole, opt, 0);
  ASSERT_TRUE(ckpt.load_latest(wst).has_value());
  std::vector<std::pair<std::string, at::Tensor>> mine;
  for (const auto& p : whole->named_parameters()) mine.emplace_back(p.key(), p.value());
  expect_equal_wholes(mine, saved, "unsharded");

  train_2d(t, 2, 20);  // the exact resume continues bit for bit
  train_2d(back, 2, 20);
  expect_same_locals(back, t, "after 2 more steps");
  remove_dir(dir);
}

DTRAIN_DIST_TEST_MAIN()
