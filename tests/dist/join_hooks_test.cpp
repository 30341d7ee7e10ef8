// Join with DDP's other modes, on 3 real ranks with 7, 10 and 4 batches (as tests/dist/join_test.cpp):
// find_unused_parameters with a layer that ranks skip in some iterations, and the PowerSGD
// communication hook. Every rank ends with the same parameters, bit for bit, equal to PyTorch's
// semantics computed here in one process: a joined rank shadows every all-reduce with zeros as its
// gradients; DDP's own average divides by 3 (divide_by_initial_world_size) or by the ranks still
// active, a communication hook as it does itself (PowerSGD: by the group's size, either way); a
// parameter that no active rank used keeps the gradient zero_grad() left it. A joined rank's PowerSGD
// runs on that zero bucket as PyTorch's does: it adds its error memory, which it keeps updating, and
// counts the iterations with the others.
#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>

#include <algorithm>

#include "dist_main.h"
#include "dtrain/comm_hooks.h"
#include "dtrain/ddp.h"
#include "dtrain/join.h"
#include "powersgd_reference.h"

using namespace dtrain;
using dtrain::powersgd_ref::RefPowerSGD;

namespace {

const std::vector<int> kUneven{7, 10, 4};
constexpr int kIterations = 10;

// Weight decay moves a parameter whose gradient is defined, zero or not: a globally unused gradient
// written as zeros instead of left untouched would show.
torch::optim::SGDOptions sgd() { return torch::optim::SGDOptions(0.1).momentum(0.9).weight_decay(0.01); }

// Rank r's batch i: (4, 5) inputs, (4, 3) targets.
std::pair<at::Tensor, at::Tensor> batch(int r, int i) {
  auto g = at::make_generator<at::CPUGeneratorImpl>(2000 * r + i);
  return {at::randn({4, 5}, g, at::kDouble), at::randn({4, 3}, g, at::kDouble)};
}
at::Tensor loss_of(const at::Tensor& out, const at::Tensor& y) { return (out - y).pow(2).mean(); }

std::vector<int> active_at(int i) {
  std::vector<int> a;
  for (int r = 0; r < static_cast<int>(kUneven.size()); ++r)
    if (i < kUneven[r]) a.push_back(r);
  return a;
}

double max_rel_diff(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  double worst = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double scale = std::max(b[i].abs().max().item<double>(), 1e-12);
    worst = std::max(worst, (a[i] - b[i]).abs().max().item<double>() / scale);
  }
  return worst;
}

// Every rank holds the same bits as rank 0.
void expect_same_on_every_rank(const std::vector<at::Tensor>& params, const std::string& what) {
  for (size_t k = 0; k < params.size(); ++k) {
    at::Tensor root = params[k].detach().clone();
    broadcast(root, 0);
    EXPECT_TRUE(root.equal(params[k].detach())) << what << ": parameter " << k << " on rank " << rank();
  }
}

// --- find_unused_parameters under Join ---------------------------------------------------------------

// Head c is used by rank r in iteration i > 0 when (r + i) % 3 == 0. With 7, 10 and 4 batches that
// makes every kind of iteration: c used by no rank before any gradient of it exists (i = 0: its
// .grad() stays undefined, so SGD skips it, weight decay included); used by one active rank and not
// the others, while a rank has joined (i = 5, 6, 8) or not (i = 1 to 3); used by no active rank once
// rank 2 has joined (i = 4) and once only rank 1 is left (i = 7, 9).
bool uses_c(int r, int i) { return i > 0 && (r + i) % 3 == 0; }

struct BranchNetImpl : torch::nn::Module {
  BranchNetImpl() {
    torch::manual_seed(8);
    a = register_module("a", torch::nn::Linear(5, 8));
    b = register_module("b", torch::nn::Linear(8, 3));
    c = register_module("c", torch::nn::Linear(8, 3));
    to(at::kDouble);
  }
  at::Tensor forward(const at::Tensor& x, bool use_c) {
    at::Tensor h = at::tanh(a(x));
    return use_c ? b(h) + c(h) : b(h);
  }
  torch::nn::Linear a{nullptr}, b{nullptr}, c{nullptr};
};
TORCH_MODULE(BranchNet);

// PyTorch's semantics in one process. Each iteration: the active ranks' local gradients (an unused
// parameter's is zero) summed and divided; a parameter used by no active rank keeps what zero_grad()
// left (DDP leaves a globally unused gradient untouched); one SGD step.
std::vector<at::Tensor> unused_reference(bool divide_by_initial_world_size) {
  BranchNet net, scratch;
  torch::optim::SGD opt(net->parameters(), sgd());
  auto params = net->parameters(), local = scratch->parameters();
  for (int i = 0; i < kIterations; ++i) {
    const auto active = active_at(i);
    std::vector<at::Tensor> sum;
    std::vector<bool> used(params.size(), false);
    for (int r : active) {
      {
        at::NoGradGuard ng;
        for (size_t k = 0; k < params.size(); ++k) local[k].copy_(params[k]);
      }
      for (auto& p : local) p.mutable_grad() = at::Tensor();
      auto [x, y] = batch(r, i);
      loss_of(scratch->forward(x, uses_c(r, i)), y).backward();
      for (size_t k = 0; k < local.size(); ++k) {
        const bool u = local[k].grad().defined();
        used[k] = used[k] || u;
        at::Tensor g = u ? local[k].grad().clone() : at::zeros_like(local[k]);
        if (sum.size() <= k)
          sum.push_back(g);
        else
          sum[k] += g;
      }
    }
    const double d = divide_by_initial_world_size ? static_cast<double>(kUneven.size()) : active.size();
    opt.zero_grad();
    for (size_t k = 0; k < params.size(); ++k)
      if (used[k]) params[k].mutable_grad() = sum[k] / d;
    opt.step();
  }
  return net->parameters();
}

std::vector<at::Tensor> train_unused(const JoinOptions& options) {
  BranchNet net;
  DistributedDataParallel ddp(net, DDPOptions().find_unused_parameters(true));
  torch::optim::SGD opt(ddp.parameters(), sgd());
  Join join({&ddp}, options);
  for (int i = 0; i < kUneven[rank()]; ++i) {
    auto [x, y] = batch(rank(), i);
    opt.zero_grad();
    loss_of(ddp(x, uses_c(rank(), i)), y).backward();
    opt.step();
  }
  join.join();
  return net->parameters();
}

// --- PowerSGD under Join -----------------------------------------------------------------------------

struct NetImpl : torch::nn::Module {
  NetImpl() {
    torch::manual_seed(5);
    a = register_module("a", torch::nn::Linear(5, 8));
    b = register_module("b", torch::nn::Linear(8, 3));
    to(at::kDouble);
  }
  at::Tensor forward(const at::Tensor& x) { return b(at::tanh(a(x))); }
  torch::nn::Linear a{nullptr}, b{nullptr};
};
TORCH_MODULE(Net);

constexpr int64_t kStartIter = 2;

PowerSGDOptions powersgd_options() {
  return PowerSGDOptions().matrix_approximation_rank(1).start_powerSGD_iter(kStartIter);
}

// The reference run: every iteration each rank's local gradients (zeros once it has joined) through
// the plain PowerSGD of tests/common/powersgd_reference.h, one SGD step with the result.
std::vector<at::Tensor> powersgd_reference(const std::vector<std::vector<int>>& buckets, bool joined_error) {
  Net net, scratch;
  torch::optim::SGD opt(net->parameters(), sgd());
  auto params = net->parameters(), local = scratch->parameters();
  const int world = static_cast<int>(kUneven.size());
  RefPowerSGD ref(powersgd_options(), world, buckets, params);
  ref.joined_error = joined_error;
  for (int i = 0; i < kIterations; ++i) {
    std::vector<std::vector<at::Tensor>> grads(world);
    std::vector<bool> joined;
    for (int r = 0; r < world; ++r) {
      joined.push_back(i >= kUneven[r]);
      if (joined.back()) {
        for (auto& p : params) grads[r].push_back(at::zeros_like(p));
        continue;
      }
      {
        at::NoGradGuard ng;
        for (size_t k = 0; k < params.size(); ++k) local[k].copy_(params[k]);
      }
      for (auto& p : local) p.mutable_grad() = at::Tensor();
      auto [x, y] = batch(r, i);
      loss_of(scratch->forward(x), y).backward();
      for (auto& p : local) grads[r].push_back(p.grad().clone());
    }
    const std::vector<at::Tensor> avg = ref.step(grads, joined);
    for (size_t k = 0; k < params.size(); ++k) params[k].mutable_grad() = avg[k];
    opt.step();
  }
  return net->parameters();
}

struct PowerSGDRun {
  std::vector<at::Tensor> params;
  std::vector<std::vector<int>> buckets;
  int64_t iter = 0;
};

PowerSGDRun train_powersgd(const JoinOptions& options) {
  Net net;
  DistributedDataParallel ddp(net);
  PowerSGDState state(powersgd_options());
  ddp.register_comm_hook(state, powerSGD_hook);
  torch::optim::SGD opt(ddp.parameters(), sgd());
  Join join({&ddp}, options);
  for (int i = 0; i < kUneven[rank()]; ++i) {
    auto [x, y] = batch(rank(), i);
    opt.zero_grad();
    loss_of(ddp(x), y).backward();
    opt.step();
  }
  join.join();
  return {net->parameters(), ddp.bucket_param_indices(), state.iter()};
}

}  // namespace

// ctest runs this program over shared memory and, as dist_join_hooks_test_gloo_3, over Gloo alone.
TEST(JoinHooks, DefaultGroupRunsOverTheTransportThisRunTests) { expect_default_group_transport_from_env(); }

TEST(JoinHooks, FindUnusedParametersUnderJoinEndsWithPyTorchsParameters) {
  ASSERT_EQ(world_size(), 3) << "this test is written for 3 ranks with 7, 10 and 4 batches";
  for (const bool by_initial : {true, false}) {
    const auto got = train_unused(JoinOptions().divide_by_initial_world_size(by_initial));
    expect_same_on_every_rank(got, "find_unused_parameters");
    const auto want = unused_reference(by_initial);
    EXPECT_LE(max_rel_diff(got, want), 1e-10) << "divide_by_initial_world_size=" << by_initial;
    // The divisors give different models, so the comparison tells them apart.
    EXPECT_GT(max_rel_diff(got, unused_reference(!by_initial)), 1e-6);
  }
}

TEST(JoinHooks, PowerSGDUnderJoinEndsWithPyTorchsParameters) {
  ASSERT_EQ(world_size(), 3) << "this test is written for 3 ranks with 7, 10 and 4 batches";
  std::vector<at::Tensor> first;
  for (const bool by_initial : {true, false}) {
    const PowerSGDRun got = train_powersgd(JoinOptions().divide_by_initial_world_size(by_initial));
    expect_same_on_every_rank(got.params, "PowerSGD");
    // A joined rank's hook ran in every iteration it shadowed: every rank counted all 10.
    EXPECT_EQ(got.iter, kIterations) << "rank " << rank();
    const auto want = powersgd_reference(got.buckets, /*joined_error=*/true);
    EXPECT_LE(max_rel_diff(got.params, want), 1e-10) << "divide_by_initial_world_size=" << by_initial;
    // The hook divides by the group's size whatever Join's divisor: both runs are one model.
    if (first.empty())
      first = got.params;
    else
      for (size_t k = 0; k < first.size(); ++k) EXPECT_TRUE(first[k].equal(got.params[k])) << "parameter " << k;
    // Whether a joined rank adds its error memory changes the model: the comparison sees it.
    EXPECT_GT(max_rel_diff(got.params, powersgd_reference(got.buckets, /*joined_error=*/false)), 1e-6);
  }
}

DTRAIN_DIST_TEST_MAIN()
