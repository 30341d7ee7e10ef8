// DataParallel over CPU replicas and model parallelism over CPU "devices" — the whole path runs here.
#include "dtrain/data_parallel.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/cloneable.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>
#include "test_util.h"
#include "matchers.h"

using dtrain::DataParallel;
using dtrain::DataParallelOptions;

namespace {

struct NetImpl : torch::nn::Cloneable<NetImpl> {
  NetImpl() { reset(); }
  void reset() override {
    a = register_module("a", torch::nn::Linear(6, 16));
    b = register_module("b", torch::nn::Linear(16, 3));
  }
  at::Tensor forward(const at::Tensor& x) { return b(torch::relu(a(x))); }
  torch::nn::Linear a{nullptr}, b{nullptr};
};
TORCH_MODULE(Net);

struct BnNetImpl : torch::nn::Cloneable<BnNetImpl> {
  BnNetImpl() { reset(); }
  void reset() override {
    lin = register_module("lin", torch::nn::Linear(4, 4));
    bn = register_module("bn", torch::nn::BatchNorm1d(4));
  }
  at::Tensor forward(const at::Tensor& x) { return bn(lin(x)); }
  torch::nn::Linear lin{nullptr};
  torch::nn::BatchNorm1d bn{nullptr};
};
TORCH_MODULE(BnNet);

struct PlainImpl : torch::nn::Module {  // not Cloneable
  PlainImpl() { l = register_module("l", torch::nn::Linear(2, 2)); }
  at::Tensor forward(const at::Tensor& x) { return l(x); }
  torch::nn::Linear l{nullptr};
};
TORCH_MODULE(Plain);

std::vector<c10::Device> cpus(int n) { return std::vector<c10::Device>(n, c10::Device(at::kCPU)); }

using dtrain::test_util::error_of;

// Gradient comparisons run in float64: splitting a batch changes the order of the sums, and in
// float32 the rounding of that order depends on the CPU's BLAS kernels (a fixed tolerance that
// held on one machine failed on another).
Net double_net() {
  Net n;
  n->to(at::kDouble);
  return n;
}
at::Tensor drandn(at::IntArrayRef sizes) { return at::randn(sizes, at::kDouble); }

void copy_params(torch::nn::Module& to, torch::nn::Module& from) {
  at::NoGradGuard ng;
  auto a = to.parameters(), b = from.parameters();
  for (size_t i = 0; i < a.size(); ++i) a[i].copy_(b[i]);
}

}  // namespace

class DataParallelGrad : public ::testing::TestWithParam<std::tuple<int, int>> {};

TEST_P(DataParallelGrad, GradientsAndOutputsEqualTheSingleModule) {
  const auto [replicas, batch] = GetParam();
  Net model = double_net(), ref = double_net();
  copy_params(*ref, *model);
  DataParallel dp(model, DataParallelOptions(cpus(replicas)));
  torch::optim::SGD opt(model->parameters(), 0.1), ref_opt(ref->parameters(), 0.1);
  for (int step = 0; step < 3; ++step) {
    at::Tensor x = drandn({batch, 6});
    opt.zero_grad();
    ref_opt.zero_grad();
    at::Tensor out = dp(x), ref_out = ref(x);
    ASSERT_EQ(out.sizes(), ref_out.sizes());
    EXPECT_TRUE(at::allclose(out, ref_out, 1e-10, 1e-12)) << "outputs in input order";
    out.pow(2).sum().backward();
    ref_out.pow(2).sum().backward();
    auto p = model->parameters(), q = ref->parameters();
    for (size_t i = 0; i < p.size(); ++i)
      EXPECT_TRUE(at::allclose(p[i].grad(), q[i].grad(), 1e-10, 1e-12)) << "param " << i << " step " << step;
    opt.step();
    ref_opt.step();
  }
}

INSTANTIATE_TEST_SUITE_P(ReplicasAndBatches, DataParallelGrad,
                         ::testing::Values(std::make_tuple(2, 8), std::make_tuple(2, 7), std::make_tuple(3, 9),
                                           std::make_tuple(3, 7), std::make_tuple(3, 2), std::make_tuple(1, 5)));

TEST(DataParallel, ScattersAlongAnotherDim) {
  Net model = double_net();
  DataParallel dp(model, DataParallelOptions(cpus(2)).dim(1));
  at::Tensor x = drandn({3, 4, 6});  // (T, B, F): scattered along B
  EXPECT_TRUE(at::allclose(dp(x), model(x), 1e-10, 1e-12));
}

TEST(DataParallel, BatchNormKeepsReplicaZerosRunningStats) {
  BnNet model, ref;
  copy_params(*ref, *model);
  DataParallel dp(model, DataParallelOptions(cpus(2)));
  at::Tensor x = at::randn({8, 4}) * 3 + 1;
  dp(x);
  ref(x.chunk(2)[0]);  // replica 0 saw the first chunk
  EXPECT_TRUE(at::allclose(model->bn->running_mean, ref->bn->running_mean, 1e-6));
  EXPECT_TRUE(at::allclose(model->bn->running_var, ref->bn->running_var, 1e-6));
}

TEST(DataParallel, BadInputIsAClearError) {
  Net model;
  EXPECT_THAT(error_of([&] { DataParallel dp(model, DataParallelOptions({})); }), HasSubstr("device_ids is empty"));
  EXPECT_THAT(error_of([&] {
                DataParallel dp(model, DataParallelOptions({c10::Device(at::kCPU), c10::Device(at::kCUDA, 0)}));
              }),
              HasSubstr("mix device types"));
  Plain plain;
  EXPECT_THAT(error_of([&] { DataParallel dp(plain, DataParallelOptions(cpus(2))); }), HasSubstr("Cloneable"));
  DataParallel with_factory(plain, DataParallelOptions(cpus(2)), [] { return Plain().ptr(); });
  EXPECT_EQ(with_factory.num_replicas(), 2u);
}

TEST(DataParallel, TwoForwardsThenOneBackward) {
  Net model = double_net(), ref = double_net();
  copy_params(*ref, *model);
  DataParallel dp(model, DataParallelOptions(cpus(2)));
  at::Tensor x = drandn({4, 6}), y = drandn({6, 6});
  (dp(x).sum() + dp(y).sum()).backward();
  (ref(x).sum() + ref(y).sum()).backward();
  auto p = model->parameters(), q = ref->parameters();
  for (size_t i = 0; i < p.size(); ++i) EXPECT_TRUE(at::allclose(p[i].grad(), q[i].grad(), 1e-10, 1e-12));
}

TEST(DataParallel, ExceptionsInReplicaThreadsReachTheCaller) {
  Net model;
  DataParallel dp(model, DataParallelOptions(cpus(2)));
  EXPECT_FALSE(error_of([&] { dp(at::randn({4, 5})); }).empty());  // wrong feature size in every replica
}

TEST(Balance, ByParameterCount) {
  EXPECT_EQ(dtrain::balance_by_size({10, 10, 10, 10}, 2), (std::vector<int64_t>{2, 2}));
  // Ties keep parameter-free layers (activations) with the layer before them.
  EXPECT_EQ(dtrain::balance_by_size({100, 0, 1, 0, 1}, 2), (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(dtrain::balance_by_size({5, 5, 5}, 3), (std::vector<int64_t>{1, 1, 1}));
  EXPECT_THAT(error_of([] { dtrain::balance_by_size({1, 2}, 3); }), HasSubstr("cannot fill 3 stages"));
}

TEST(ModelParallel, SplitOverTwoAndThreeDevicesMatchesTheUnsplitModel) {
  for (int parts : {2, 3}) {
    for (bool explicit_balance : {false, true}) {
      torch::manual_seed(parts);
      auto make = [] {
        return torch::nn::Sequential(torch::nn::Linear(8, 32), torch::nn::ReLU(), torch::nn::Linear(32, 32),
                                     torch::nn::ReLU(), torch::nn::Linear(32, 4));
      };
      torch::nn::Sequential whole = make(), to_split = make();
      copy_params(*to_split, *whole);
      std::vector<int64_t> balance;
      if (explicit_balance) balance = parts == 2 ? std::vector<int64_t>{3, 2} : std::vector<int64_t>{1, 2, 2};
      dtrain::ModelParallelSequential mp(to_split, cpus(parts), balance);
      EXPECT_EQ(mp->stages().size(), static_cast<size_t>(parts));
      at::Tensor x = at::randn({5, 8});
      at::Tensor a = mp(x), b = whole->forward(x);
      EXPECT_TRUE(at::allclose(a, b));
      a.sum().backward();
      b.sum().backward();
      auto p = mp->parameters(), q = whole->parameters();
      ASSERT_EQ(p.size(), q.size());
      for (size_t i = 0; i < p.size(); ++i) EXPECT_TRUE(at::allclose(p[i].grad(), q[i].grad()));
    }
  }
  EXPECT_THAT(error_of([] {
                dtrain::ModelParallelSequential mp(torch::nn::Sequential(torch::nn::Linear(2, 2)), cpus(2),
                                                   std::vector<int64_t>{1, 1});
              }),
              HasSubstr("balance sums to 2 layers but the Sequential has 1"));
}
