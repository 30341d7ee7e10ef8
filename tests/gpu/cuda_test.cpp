// CUDA paths of one process: autocast float16, GradScaler's CUDA kernels, DataParallel and model
// parallelism over the visible GPUs, the monitor's CUDA memory fields. Built in CUDA builds of
// LibTorch only; without a CUDA device the program says why and exits 77, which ctest reports as
// skipped (SKIP_RETURN_CODE), never as passed.
#include <cstdio>

#include <gtest/gtest.h>
#include <torch/cuda.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/activation.h>
#include <torch/optim/sgd.h>

#include "dtrain/amp.h"
#include "dtrain/data_parallel.h"
#include "dtrain/monitor.h"

namespace {

at::Device cuda0() { return at::Device(at::kCUDA, 0); }

TEST(CudaAutocast, MatmulRunsInFloat16AndTheScopeRestoresFloat32) {
  at::Tensor a = at::randn({8, 8}, at::TensorOptions().device(cuda0()));
  {
    dtrain::Autocast ac(at::kCUDA);
    EXPECT_EQ(at::mm(a, a).scalar_type(), at::kHalf);
  }
  EXPECT_EQ(at::mm(a, a).scalar_type(), at::kFloat);
}

TEST(CudaGradScaler, SkipsTheStepOnOverflowAndBacksOffThenGrows) {
  torch::nn::Linear lin(4, 1);
  lin->to(cuda0());
  torch::optim::SGD opt(lin->parameters(), 0.1);
  dtrain::GradScaler scaler(dtrain::GradScalerOptions().init_scale(1024).growth_interval(1));
  auto x = at::randn({2, 4}, at::TensorOptions().device(cuda0()));
  // Step 1: an infinite gradient -> no step, scale halves.
  at::Tensor before = lin->weight.detach().clone();
  opt.zero_grad();
  scaler.scale(lin(x).sum()).backward();
  lin->weight.grad().fill_(std::numeric_limits<float>::infinity());
  EXPECT_FALSE(scaler.step(opt));
  scaler.update();
  EXPECT_TRUE(at::equal(before, lin->weight.detach()));
  EXPECT_EQ(scaler.get_scale(), 512.0);
  // Step 2: finite -> steps, and with growth_interval 1 the scale doubles.
  opt.zero_grad();
  scaler.scale(lin(x).sum()).backward();
  EXPECT_TRUE(scaler.step(opt));
  scaler.update();
  EXPECT_FALSE(at::equal(before, lin->weight.detach()));
  EXPECT_EQ(scaler.get_scale(), 1024.0);
}

torch::nn::Sequential small_net() {
  return torch::nn::Sequential(torch::nn::Linear(6, 16), torch::nn::ReLU(), torch::nn::Linear(16, 3));
}

TEST(CudaDataParallel, OutputsAndGradientsEqualTheModuleOnOneDevice) {
  std::vector<c10::Device> devices;
  for (int d = 0; d < static_cast<int>(torch::cuda::device_count()); ++d) devices.emplace_back(at::kCUDA, d);
  auto net = small_net();
  net->to(at::kDouble);
  auto ref = std::dynamic_pointer_cast<torch::nn::SequentialImpl>(net->clone());
  net->to(devices[0]);
  ref->to(devices[0]);
  dtrain::DataParallel<torch::nn::SequentialImpl> dp(net.ptr(), dtrain::DataParallelOptions(devices));
  auto x = at::randn({10, 6}, at::TensorOptions().dtype(at::kDouble).device(devices[0]));
  at::Tensor out = dp(x);
  at::Tensor expected = ref->forward(x);
  EXPECT_TRUE(at::allclose(out, expected, 1e-12, 1e-12));
  out.pow(2).sum().backward();
  expected.pow(2).sum().backward();
  auto p = net->parameters(), q = ref->parameters();
  for (size_t i = 0; i < p.size(); ++i) EXPECT_TRUE(at::allclose(p[i].grad(), q[i].grad(), 1e-10, 1e-12)) << i;
}

TEST(CudaModelParallel, StagesLiveOnTheirDevicesAndTheOutputOnTheLast) {
  const int n = static_cast<int>(torch::cuda::device_count());
  std::vector<c10::Device> devices{at::Device(at::kCUDA, 0), at::Device(at::kCUDA, n - 1)};
  dtrain::ModelParallelSequential mp(small_net(), devices);
  at::Tensor out = mp(at::randn({5, 6}, at::TensorOptions().device(devices[0])));
  EXPECT_EQ(out.device(), devices[1]);
  EXPECT_EQ(mp->stages()[0]->parameters()[0].device(), devices[0]);
}

TEST(CudaMonitor, MemoryInfoReportsTheTensorsHeldOnTheDevice) {
  at::Tensor big = at::empty({64 << 20}, at::TensorOptions().dtype(at::kByte).device(cuda0()));
  auto mem = dtrain::memory_info();
  ASSERT_FALSE(mem.devices.empty());
  EXPECT_EQ(mem.devices[0].device, "cuda:0");
  EXPECT_GE(mem.devices[0].allocated, int64_t{64} << 20);
  EXPECT_GE(mem.devices[0].reserved, mem.devices[0].allocated);
}

}  // namespace

int main(int argc, char** argv) {
  if (!torch::cuda::is_available()) {
    std::printf(
        "SKIPPED: no CUDA device here (torch::cuda::device_count() == 0); run scripts/gpu_check.sh "
        "on a machine with a GPU\n");
    return 77;
  }
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
