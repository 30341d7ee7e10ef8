// NCCL and DDP on CUDA tensors, one GPU per rank (cuda:LOCAL_RANK), run through dtrain-run by
// run_multi_gpu.sh, which reports the test skipped (exit 77) on a machine with fewer GPUs than ranks.
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include <gtest/gtest.h>
#include <torch/cuda.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adam.h>

#include "common/flight_pickle.h"
#include "dtrain/checkpoint.h"
#include "dtrain/ddp.h"
#include "dtrain/process_group.h"

namespace {

at::Device my_device() { return at::Device(at::kCUDA, dtrain::local_rank()); }
at::TensorOptions on_gpu(at::ScalarType t = at::kFloat) { return at::TensorOptions().dtype(t).device(my_device()); }

TEST(Nccl, CollectivesOnCudaTensors) {
  const int r = dtrain::rank(), n = dtrain::world_size();
  at::Tensor t = at::full({1000}, static_cast<double>(r + 1), on_gpu());
  dtrain::all_reduce(t);
  EXPECT_TRUE(at::all(t == n * (n + 1) / 2.0).item<bool>());

  at::Tensor b = at::full({7}, static_cast<double>(r), on_gpu(at::kDouble));
  dtrain::broadcast(b, n - 1);
  EXPECT_TRUE(at::all(b == n - 1).item<bool>());

  std::vector<at::Tensor> parts;
  for (int i = 0; i < n; ++i) parts.push_back(at::empty({3}, on_gpu()));
  dtrain::all_gather(parts, at::full({3}, static_cast<double>(10 * r), on_gpu()));
  for (int i = 0; i < n; ++i) EXPECT_TRUE(at::all(parts[i] == 10.0 * i).item<bool>()) << i;
}

// Uneven splits, zeros among them, through NCCL's all_to_all: rank i sends rank j (i + 2j) % 3 rows
// of 100 i + j, in both forms.
TEST(Nccl, AllToAllWithUnevenSplits) {
  const int r = dtrain::rank(), n = dtrain::world_size();
  auto rows = [](int i, int j) { return static_cast<int64_t>((i + 2 * j) % 3); };
  std::vector<at::Tensor> ins, outs, expected;
  std::vector<int64_t> sends, gets;
  for (int k = 0; k < n; ++k) {
    ins.push_back(at::full({rows(r, k), 2}, 100.0 * r + k, on_gpu(at::kDouble)));
    sends.push_back(rows(r, k));
    expected.push_back(at::full({rows(k, r), 2}, 100.0 * k + r, on_gpu(at::kDouble)));
    gets.push_back(rows(k, r));
    outs.push_back(at::full({rows(k, r), 2}, -1.0, on_gpu(at::kDouble)));
  }
  at::Tensor out = at::full({at::cat(expected).size(0), 2}, -1.0, on_gpu(at::kDouble));
  dtrain::all_to_all_single(out, at::cat(ins), gets, sends);
  EXPECT_TRUE(at::equal(out, at::cat(expected)));
  dtrain::all_to_all(outs, ins);
  for (int k = 0; k < n; ++k) EXPECT_TRUE(at::equal(outs[k], expected[k])) << "from rank " << k;
}

// The flight recorder covers NCCL: a dump written after CUDA all_reduces names them "nccl:all_reduce",
// completed, with their sizes and dtype (what PyTorch's analyzer and dtrain-run --analyze read).
TEST(Nccl, FlightRecorderRecordsNcclCallsAsCompleted) {
  at::Tensor t = at::ones({1000}, on_gpu());
  for (int i = 0; i < 3; ++i) dtrain::all_reduce(t);
  torch::cuda::synchronize();
  const std::string path = dtrain::dump_flight_record("gpu test");
  ASSERT_FALSE(path.empty()) << "the recorder is off or could not write";
  std::ifstream in(path, std::ios::binary);
  std::stringstream bytes;
  bytes << in.rdbuf();
  const nlohmann::json dump = dtrain::flight::pickle::loads(bytes.str());
  int found = 0;
  for (const auto& e : dump.at("entries")) {
    if (e.at("profiling_name") != "nccl:all_reduce" || e.at("input_sizes") != nlohmann::json({{1000}})) continue;
    EXPECT_EQ(e.at("state"), "completed") << e.dump();
    EXPECT_EQ(e.at("input_dtypes"), nlohmann::json({"Float"})) << e.dump();
    ++found;
  }
  EXPECT_GE(found, 3) << dump.at("entries").dump();
}

// DDP's averaged gradients equal the mean of every rank's own gradients, computed here on one GPU
// from the same inputs (float64).
TEST(Nccl, DdpGradientsAreTheMeanOfTheRanksGradients) {
  const int n = dtrain::world_size();
  torch::manual_seed(3);
  auto net = torch::nn::Sequential(torch::nn::Linear(8, 32), torch::nn::Tanh(), torch::nn::Linear(32, 2));
  net->to(at::kDouble);
  auto ref = std::dynamic_pointer_cast<torch::nn::SequentialImpl>(net->clone());
  net->to(my_device());
  ref->to(my_device());
  dtrain::DistributedDataParallel ddp(net, dtrain::DDPOptions().bucket_cap_mb(0.001));
  auto batch = [&](int rank) {
    auto g = at::make_generator<at::CPUGeneratorImpl>(100 + rank);
    return at::randn({6, 8}, g, at::kDouble).to(my_device());
  };
  ddp(batch(dtrain::rank())).pow(2).sum().backward();
  for (int r = 0; r < n; ++r) ref->forward(batch(r)).pow(2).sum().backward();
  auto p = net->parameters(), q = ref->parameters();
  ASSERT_EQ(p.size(), q.size());
  for (size_t i = 0; i < p.size(); ++i)
    EXPECT_TRUE(at::allclose(p[i].grad(), q[i].grad() / n, 1e-10, 1e-12)) << "parameter " << i;
}

// A checkpoint of a model and its Adam state on the GPU: rank 0 writes its own device's tensors,
// and every rank gets them back on its own device (the optimizer's moments too, or its next step
// would mix devices), with the values rank 0 saved.
TEST(Nccl, CheckpointRestoresOntoEachRanksOwnDevice) {
  torch::manual_seed(5);
  auto net = torch::nn::Linear(4, 3);
  net->to(my_device());
  dtrain::DistributedDataParallel ddp(net);
  torch::optim::Adam opt(ddp.parameters(), torch::optim::AdamOptions(0.1));
  ddp(at::ones({2, 4}, on_gpu())).sum().backward();
  opt.step();
  const at::Tensor saved_weight = net->weight.detach().clone();

  const std::string dir =
      (std::filesystem::temp_directory_path() /
       ("dtrain_gpu_ckpt_" + std::string(std::getenv("MASTER_PORT") ? std::getenv("MASTER_PORT") : "0")))
          .string();
  dtrain::CheckpointManager manager(dir);
  dtrain::TrainingState state;
  state.model = net.get();
  state.optimizer = &opt;
  state.step = 1;
  manager.save(state);

  {
    torch::NoGradGuard no_grad;
    net->weight.fill_(7.0);
  }
  ASSERT_TRUE(manager.load_latest(state).has_value());
  EXPECT_EQ(net->weight.device(), my_device());
  EXPECT_TRUE(at::equal(net->weight.detach(), saved_weight));
  // The restored moments are on this rank's device: the next step runs.
  opt.zero_grad();
  ddp(at::ones({2, 4}, on_gpu())).sum().backward();
  EXPECT_NO_THROW(opt.step());
  dtrain::barrier();
  if (dtrain::rank() == 0) std::filesystem::remove_all(dir);
}

}  // namespace

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  dtrain::init_process_group(dtrain::InitOptions().backend("nccl"));
  dtrain::set_cuda_device(dtrain::local_rank());
  int rc = RUN_ALL_TESTS();
  dtrain::destroy_process_group();
  return rc;
}
