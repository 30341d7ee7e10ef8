// The C API's ZeroRedundancyOptimizer and CheckpointManager of named tensors on a world of one rank
// (file:// rendezvous): ZeRO's steps equal LibTorch's own optimizer's, its saved state resumes bit for
// bit, the manager rotates, loads the latest and writes in the background, and bad input returns a
// status and one line naming the function and the remedy. tests/dist/test_c_api.py runs both on 2
// ranks against PyTorch's. The last case destroys the process group.
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include "dtrain_c.h"

namespace {

dtrain_c_tensor* zh(at::Tensor& t) { return reinterpret_cast<dtrain_c_tensor*>(&t); }
std::string zerr() { return dtrain_c_last_error(); }

void zero_ensure_init() {
  if (dtrain_c_is_initialized()) return;
  const std::string file = "/tmp/dtrain_c_api_zero_test_" + std::to_string(getpid());
  std::remove(file.c_str());
  ASSERT_EQ(dtrain_c_init_process_group("gloo", ("file://" + file).c_str(), 0, 1, 60000), DTRAIN_C_OK) << zerr();
}

std::string zero_tmp_dir(const std::string& what) {
  const std::string dir = "/tmp/dtrain_c_api_zero_test_" + what + "_" + std::to_string(getpid());
  std::filesystem::remove_all(dir);
  return dir;
}

#define EXPECT_ZSTATUS(call, status, text)                                         \
  do {                                                                             \
    EXPECT_EQ((call), (status));                                                   \
    EXPECT_NE(zerr().find(text), std::string::npos) << "last error: " << zerr();   \
    EXPECT_EQ(zerr().find('\n'), std::string::npos) << "not one line: " << zerr(); \
  } while (0)

std::vector<at::Tensor> zero_params() {
  at::manual_seed(3);
  return {at::randn({5, 3}, at::kDouble).requires_grad_(), at::randn({3}, at::kDouble).requires_grad_(),
          at::randn({7}, at::kDouble).requires_grad_()};
}

void zero_set_grads(std::vector<at::Tensor>& params, int step) {
  for (size_t i = 0; i < params.size(); ++i)
    params[i].mutable_grad() =
        at::sin(at::arange(params[i].numel(), at::kDouble) * (step + 1) + static_cast<double>(i)).view_as(params[i]);
}

std::unique_ptr<torch::optim::Optimizer> zero_reference(const std::string& name, std::vector<at::Tensor> params) {
  if (name == "sgd")
    return std::make_unique<torch::optim::SGD>(
        params, torch::optim::SGDOptions(0.05).momentum(0.9).nesterov(true).weight_decay(0.01));
  if (name == "adam")
    return std::make_unique<torch::optim::Adam>(
        params, torch::optim::AdamOptions(0.01).betas(std::make_tuple(0.8, 0.99)).eps(1e-6).weight_decay(0.02));
  return std::make_unique<torch::optim::AdamW>(params, torch::optim::AdamWOptions(0.01).weight_decay(0.1));
}

dtrain_c_optimizer_options zero_options(const std::string& name) {
  dtrain_c_optimizer_options o;
  EXPECT_EQ(dtrain_c_optimizer_options_default(name.c_str(), &o), DTRAIN_C_OK) << zerr();
  if (name == "sgd") {
    o.lr = 0.05, o.momentum = 0.9, o.nesterov = 1, o.weight_decay = 0.01;
  } else if (name == "adam") {
    o.lr = 0.01, o.beta1 = 0.8, o.beta2 = 0.99, o.eps = 1e-6, o.weight_decay = 0.02;
  } else {
    o.lr = 0.01, o.weight_decay = 0.1;
  }
  return o;
}

dtrain_c_zero* zero_make(std::vector<at::Tensor>& params, const std::string& name) {
  std::vector<dtrain_c_tensor*> hs;
  for (auto& p : params) hs.push_back(zh(p));
  const dtrain_c_optimizer_options o = zero_options(name);
  dtrain_c_zero* zero = nullptr;
  EXPECT_EQ(dtrain_c_zero_new(hs.data(), hs.size(), name.c_str(), &o, nullptr, &zero), DTRAIN_C_OK) << zerr();
  return zero;
}

TEST(CApiZero, StepsEqualLibTorchsOptimizer) {
  zero_ensure_init();
  for (const std::string name : {"sgd", "adam", "adamw"}) {
    std::vector<at::Tensor> ours = zero_params(), theirs = zero_params();
    dtrain_c_zero* zero = zero_make(ours, name);
    ASSERT_NE(zero, nullptr);
    auto reference = zero_reference(name, theirs);
    for (int step = 0; step < 4; ++step) {
      zero_set_grads(ours, step);
      zero_set_grads(theirs, step);
      ASSERT_EQ(dtrain_c_zero_step(zero), DTRAIN_C_OK) << zerr();
      reference->step();
    }
    for (size_t i = 0; i < ours.size(); ++i)
      EXPECT_TRUE(at::equal(ours[i].detach(), theirs[i].detach())) << name << " parameter " << i;
    EXPECT_FALSE(at::equal(ours[0].detach(), zero_params()[0].detach())) << name << " stepped nothing";
    ASSERT_EQ(dtrain_c_zero_zero_grad(zero, 0), DTRAIN_C_OK) << zerr();
    EXPECT_EQ(ours[0].grad().abs().sum().item<double>(), 0.0);
    ASSERT_EQ(dtrain_c_zero_zero_grad(zero, 1), DTRAIN_C_OK) << zerr();
    EXPECT_FALSE(ours[0].grad().defined());
    ASSERT_EQ(dtrain_c_zero_free(zero), DTRAIN_C_OK) << zerr();
  }
}

TEST(CApiZero, SavedStateResumesBitForBit) {
  zero_ensure_init();
  std::vector<at::Tensor> params = zero_params();
  dtrain_c_zero* zero = zero_make(params, "adamw");
  for (int step = 0; step < 3; ++step) {
    zero_set_grads(params, step);
    ASSERT_EQ(dtrain_c_zero_step(zero), DTRAIN_C_OK) << zerr();
  }
  ASSERT_EQ(dtrain_c_zero_set_lr(zero, 0.004), DTRAIN_C_OK) << zerr();
  const std::string dir = zero_tmp_dir("state");
  std::filesystem::create_directories(dir);
  const std::string path = dir + "/zero.pt";
  EXPECT_ZSTATUS(dtrain_c_zero_save(zero, path.c_str()), DTRAIN_C_IO_ERROR, "call consolidate_state_dict(0)");
  ASSERT_EQ(dtrain_c_zero_consolidate_state_dict(zero, 0), DTRAIN_C_OK) << zerr();
  ASSERT_EQ(dtrain_c_zero_save(zero, path.c_str()), DTRAIN_C_OK) << zerr();
  std::vector<at::Tensor> copies;
  for (auto& p : params) copies.push_back(p.detach().clone().requires_grad_());
  dtrain_c_zero* resumed = zero_make(copies, "adamw");
  ASSERT_EQ(dtrain_c_zero_load(resumed, path.c_str()), DTRAIN_C_OK) << zerr();
  double lr = 0;
  ASSERT_EQ(dtrain_c_zero_get_lr(resumed, &lr), DTRAIN_C_OK) << zerr();
  EXPECT_EQ(lr, 0.004) << "the saved lr, on LibTorch 1.13 too (its load() alone keeps the optimizer's own)";
  zero_set_grads(params, 3);
  zero_set_grads(copies, 3);
  ASSERT_EQ(dtrain_c_zero_step(zero), DTRAIN_C_OK) << zerr();
  ASSERT_EQ(dtrain_c_zero_step(resumed), DTRAIN_C_OK) << zerr();
  for (size_t i = 0; i < params.size(); ++i)
    EXPECT_TRUE(at::equal(params[i].detach(), copies[i].detach())) << "parameter " << i;
  EXPECT_ZSTATUS(dtrain_c_zero_load(resumed, (dir + "/none.pt").c_str()), DTRAIN_C_INVALID_ARGUMENT,
                 "none.pt cannot be read");
  dtrain_c_zero_free(zero);
  dtrain_c_zero_free(resumed);
  std::filesystem::remove_all(dir);
}

TEST(CApiZero, ZeroRefusals) {
  zero_ensure_init();
  std::vector<at::Tensor> params = zero_params();
  std::vector<dtrain_c_tensor*> hs;
  for (auto& p : params) hs.push_back(zh(p));
  dtrain_c_zero* zero = nullptr;
  EXPECT_ZSTATUS(dtrain_c_zero_step(nullptr), DTRAIN_C_INVALID_HANDLE, "dtrain_c_zero_step on rank 0: zero is NULL");
  EXPECT_ZSTATUS(dtrain_c_zero_new(hs.data(), hs.size(), "lamb", nullptr, nullptr, &zero), DTRAIN_C_INVALID_ARGUMENT,
                 "optimizer is 'lamb': pass \"sgd\", \"adam\" or \"adamw\"");
  EXPECT_ZSTATUS(dtrain_c_zero_new(hs.data(), hs.size(), nullptr, nullptr, nullptr, &zero), DTRAIN_C_INVALID_ARGUMENT,
                 "optimizer is NULL");
  at::Tensor single = at::zeros({4}, at::kFloat).requires_grad_();
  std::vector<dtrain_c_tensor*> mixed = {hs[0], zh(single)};
  EXPECT_ZSTATUS(dtrain_c_zero_new(mixed.data(), 2, "adam", nullptr, nullptr, &zero), DTRAIN_C_INVALID_ARGUMENT,
                 "params[1] is Float but params[0] is Double: give ZeRO parameters of one dtype");
  dtrain_c_optimizer_options o = zero_options("sgd");
  o.momentum = 0;
  EXPECT_ZSTATUS(dtrain_c_zero_new(hs.data(), hs.size(), "sgd", &o, nullptr, &zero), DTRAIN_C_INVALID_ARGUMENT,
                 "Nesterov momentum needs momentum > 0 and dampening 0");
  o = zero_options("adam");
  o.beta2 = 1.0;
  EXPECT_ZSTATUS(dtrain_c_zero_new(hs.data(), hs.size(), "adam", &o, nullptr, &zero), DTRAIN_C_INVALID_ARGUMENT,
                 "beta1, beta2 are 0.8, 1");
  o.struct_size = 0;
  EXPECT_ZSTATUS(dtrain_c_zero_new(hs.data(), hs.size(), "adam", &o, nullptr, &zero), DTRAIN_C_INVALID_ARGUMENT,
                 "fill the options with dtrain_c_optimizer_options_default first");
  EXPECT_ZSTATUS(dtrain_c_optimizer_options_default("rmsprop", &o), DTRAIN_C_INVALID_ARGUMENT,
                 "optimizer is 'rmsprop'");
  EXPECT_EQ(zero, nullptr);
  ASSERT_EQ(dtrain_c_zero_new(hs.data(), hs.size(), "adamw", nullptr, nullptr, &zero), DTRAIN_C_OK) << zerr();
  EXPECT_ZSTATUS(dtrain_c_zero_set_lr(zero, -1), DTRAIN_C_INVALID_ARGUMENT, "lr is -1");
  EXPECT_ZSTATUS(dtrain_c_zero_consolidate_state_dict(zero, 3), DTRAIN_C_DIST_ERROR, "rank 3 is not a member");
  ASSERT_EQ(dtrain_c_zero_free(zero), DTRAIN_C_OK) << zerr();
  EXPECT_ZSTATUS(dtrain_c_zero_step(zero), DTRAIN_C_INVALID_HANDLE, "is not a live zero handle");
  EXPECT_ZSTATUS(dtrain_c_zero_free(zero), DTRAIN_C_INVALID_HANDLE, "is not a live zero handle");
}

std::vector<std::string> zero_ckpt_files(const std::string& dir) {
  std::vector<std::string> out;
  for (const auto& e : std::filesystem::directory_iterator(dir)) out.push_back(e.path().filename().string());
  std::sort(out.begin(), out.end());
  return out;
}

struct ZeroCkptTensors {
  std::vector<at::Tensor> tensors = {at::randn({4, 2}, at::kDouble), at::randn({2}, at::kDouble),
                                     at::arange(3, at::kLong)};
  std::vector<const char*> names = {"fc.weight", "fc.bias", "counts"};
  std::vector<dtrain_c_tensor*> hs() {
    std::vector<dtrain_c_tensor*> out;
    for (auto& t : tensors) out.push_back(zh(t));
    return out;
  }
  std::vector<at::Tensor> snapshot() const {
    std::vector<at::Tensor> out;
    for (const auto& t : tensors) out.push_back(t.clone());
    return out;
  }
  bool equals(const std::vector<at::Tensor>& other) const {
    for (size_t i = 0; i < tensors.size(); ++i)
      if (!at::equal(tensors[i], other[i])) return false;
    return true;
  }
};

TEST(CApiZero, CheckpointManagerRotatesLoadsAndWritesInTheBackground) {
  zero_ensure_init();
  const std::string dir = zero_tmp_dir("ckpt");
  dtrain_c_checkpoint_options o;
  dtrain_c_checkpoint_options_default(&o);
  EXPECT_EQ(o.keep, 2);
  o.interval = 2;
  dtrain_c_checkpoint* ckpt = nullptr;
  ASSERT_EQ(dtrain_c_checkpoint_new(dir.c_str(), &o, &ckpt), DTRAIN_C_OK) << zerr();
  ZeroCkptTensors t;
  auto hs = t.hs();
  int found = -1, saved = -1;
  int64_t step = -1;
  ASSERT_EQ(dtrain_c_checkpoint_load_latest(ckpt, t.names.data(), hs.data(), 3, &step, &found), DTRAIN_C_OK) << zerr();
  EXPECT_EQ(found, 0);
  std::vector<at::Tensor> at6;
  for (int64_t s = 1; s <= 7; ++s) {
    for (auto& x : t.tensors) x.add_(1);
    ASSERT_EQ(dtrain_c_checkpoint_save(ckpt, s, t.names.data(), hs.data(), 3, &saved), DTRAIN_C_OK) << zerr();
    EXPECT_EQ(saved, s % 2 == 0 ? 1 : 0) << "step " << s;
    if (s == 6) at6 = t.snapshot();
  }
  EXPECT_EQ(zero_ckpt_files(dir), (std::vector<std::string>{"checkpoint_0000000004.dcp", "checkpoint_0000000004.pt",
                                                            "checkpoint_0000000006.dcp", "checkpoint_0000000006.pt"}));
  for (auto& x : t.tensors) x.zero_();
  ASSERT_EQ(dtrain_c_checkpoint_load_latest(ckpt, t.names.data(), hs.data(), 3, &step, &found), DTRAIN_C_OK) << zerr();
  EXPECT_EQ(found, 1);
  EXPECT_EQ(step, 6);
  EXPECT_TRUE(t.equals(at6));
  // In the background: the tensors as they were at the call, whatever happens to them after.
  for (auto& x : t.tensors) x.mul_(3);
  const std::vector<at::Tensor> at8 = t.snapshot();
  ASSERT_EQ(dtrain_c_checkpoint_save_async(ckpt, 8, t.names.data(), hs.data(), 3, nullptr), DTRAIN_C_OK) << zerr();
  for (auto& x : t.tensors) x.fill_(-1);
  ASSERT_EQ(dtrain_c_checkpoint_wait(ckpt), DTRAIN_C_OK) << zerr();
  ASSERT_EQ(dtrain_c_checkpoint_load_latest(ckpt, t.names.data(), hs.data(), 3, &step, &found), DTRAIN_C_OK) << zerr();
  EXPECT_EQ(step, 8);
  EXPECT_TRUE(t.equals(at8));
  ASSERT_EQ(dtrain_c_checkpoint_free(ckpt), DTRAIN_C_OK) << zerr();
  std::filesystem::remove_all(dir);
}

TEST(CApiZero, CheckpointRefusals) {
  zero_ensure_init();
  const std::string dir = zero_tmp_dir("ckpt_bad");
  dtrain_c_checkpoint_options o;
  dtrain_c_checkpoint_options_default(&o);
  dtrain_c_checkpoint* ckpt = nullptr;
  o.keep = 0;
  EXPECT_ZSTATUS(dtrain_c_checkpoint_new(dir.c_str(), &o, &ckpt), DTRAIN_C_INVALID_ARGUMENT, "options->keep is 0");
  o.keep = 2, o.interval = 0;
  EXPECT_ZSTATUS(dtrain_c_checkpoint_new(dir.c_str(), &o, &ckpt), DTRAIN_C_INVALID_ARGUMENT, "options->interval is 0");
  EXPECT_ZSTATUS(dtrain_c_checkpoint_new(nullptr, nullptr, &ckpt), DTRAIN_C_INVALID_ARGUMENT, "dir is NULL");
  ASSERT_EQ(dtrain_c_checkpoint_new(dir.c_str(), nullptr, &ckpt), DTRAIN_C_OK) << zerr();
  ZeroCkptTensors t;
  auto hs = t.hs();
  EXPECT_ZSTATUS(dtrain_c_checkpoint_save(nullptr, 1, t.names.data(), hs.data(), 3, nullptr), DTRAIN_C_INVALID_HANDLE,
                 "checkpoint is NULL");
  std::vector<const char*> clash = {"fc", "fc.bias", "counts"};
  EXPECT_ZSTATUS(dtrain_c_checkpoint_save(ckpt, 1, clash.data(), hs.data(), 3, nullptr), DTRAIN_C_INVALID_ARGUMENT,
                 "name 'fc.bias' goes inside 'fc', which another name is");
  std::vector<const char*> dots = {"fc..weight", "fc.bias", "counts"};
  EXPECT_ZSTATUS(dtrain_c_checkpoint_save(ckpt, 1, dots.data(), hs.data(), 3, nullptr), DTRAIN_C_INVALID_ARGUMENT,
                 "name 'fc..weight' has an empty part");
  EXPECT_ZSTATUS(dtrain_c_checkpoint_save(ckpt, -1, t.names.data(), hs.data(), 3, nullptr), DTRAIN_C_INVALID_ARGUMENT,
                 "step is -1");
  ASSERT_EQ(dtrain_c_checkpoint_save(ckpt, 1, t.names.data(), hs.data(), 3, nullptr), DTRAIN_C_OK) << zerr();
  // Another dtype: refused before anything changed.
  ZeroCkptTensors other;
  other.tensors[2] = at::zeros({3}, at::kInt);
  other.tensors[0].zero_();
  auto ohs = other.hs();
  int64_t step = -1;
  int found = -1;
  EXPECT_ZSTATUS(dtrain_c_checkpoint_load_latest(ckpt, other.names.data(), ohs.data(), 3, &step, &found),
                 DTRAIN_C_IO_ERROR, "counts");
  EXPECT_EQ(other.tensors[0].abs().sum().item<double>(), 0.0) << "a refused load changed a tensor";
  EXPECT_ZSTATUS(dtrain_c_checkpoint_load_latest(ckpt, t.names.data(), hs.data(), 3, &step, nullptr),
                 DTRAIN_C_INVALID_ARGUMENT, "found is NULL");
  ASSERT_EQ(dtrain_c_checkpoint_free(ckpt), DTRAIN_C_OK) << zerr();
  EXPECT_ZSTATUS(dtrain_c_checkpoint_wait(ckpt), DTRAIN_C_INVALID_HANDLE, "is not a live checkpoint handle");
  std::filesystem::remove_all(dir);
}

// Last: the process group ends, and the ZeRO and checkpoint handles with it.
TEST(CApiZero, DestroyEndsZeroAndCheckpointHandles) {
  zero_ensure_init();
  std::vector<at::Tensor> params = zero_params();
  dtrain_c_zero* zero = zero_make(params, "sgd");
  dtrain_c_checkpoint* ckpt = nullptr;
  const std::string dir = zero_tmp_dir("ckpt_end");
  ASSERT_EQ(dtrain_c_checkpoint_new(dir.c_str(), nullptr, &ckpt), DTRAIN_C_OK) << zerr();
  ASSERT_EQ(dtrain_c_destroy_process_group(), DTRAIN_C_OK) << zerr();
  EXPECT_ZSTATUS(dtrain_c_zero_step(zero), DTRAIN_C_INVALID_HANDLE, "is not a live zero handle");
  EXPECT_ZSTATUS(dtrain_c_checkpoint_wait(ckpt), DTRAIN_C_INVALID_HANDLE, "is not a live checkpoint handle");
}

}  // namespace
