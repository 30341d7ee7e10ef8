// SyncBatchNorm on 2 and 3 real processes with unequal batches, against one process's BatchNorm over
// the concatenated batch (float64): outputs, input gradients, parameter gradients, and after 5 SGD
// steps the parameters and running statistics, under DDP with broadcast_buffers on and off.
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>

#include <optional>
#include <thread>

#include "dist_main.h"
#include "dtrain/ddp.h"
#include "dtrain/sync_batchnorm.h"

using namespace dtrain;

namespace {

constexpr int64_t kChannels = 3;
constexpr int kSteps = 5;

// The ranks' batch sizes: unequal (PyTorch's SyncBatchNorm once weighted every rank alike), or with
// rank 0 empty.
int64_t batch_of(int r, bool rank0_empty) { return rank0_empty && r == 0 ? 0 : 3 + 2 * r; }
int64_t offset_of(int r, bool rank0_empty) {
  int64_t o = 0;
  for (int q = 0; q < r; ++q) o += batch_of(q, rank0_empty);
  return o;
}

// A 1x1 layer mixing the channels (so the normalized input itself needs a gradient), the BatchNorm
// for `dims`-D inputs (2: BatchNorm1d on (N, C); 3: BatchNorm1d on (N, C, L); 4: 2d; 5: 3d), Tanh.
torch::nn::Sequential make_model(int dims, const torch::nn::BatchNormOptions& o) {
  torch::nn::Sequential m;
  switch (dims) {
    case 2:
      m->push_back(torch::nn::Linear(kChannels, kChannels));
      m->push_back(torch::nn::BatchNorm1d(o));
      break;
    case 3:
      m->push_back(torch::nn::Conv1d(torch::nn::Conv1dOptions(kChannels, kChannels, 1)));
      m->push_back(torch::nn::BatchNorm1d(o));
      break;
    case 4:
      m->push_back(torch::nn::Conv2d(torch::nn::Conv2dOptions(kChannels, kChannels, 1)));
      m->push_back(torch::nn::BatchNorm2d(o));
      break;
    default:
      m->push_back(torch::nn::Conv3d(torch::nn::Conv3dOptions(kChannels, kChannels, 1)));
      m->push_back(torch::nn::BatchNorm3d(o));
  }
  m->push_back(torch::nn::Tanh());
  m->to(at::kDouble);
  return m;
}

std::vector<int64_t> input_shape(int dims, int64_t n) {
  const std::vector<int64_t> spatial{4, 3, 2};
  std::vector<int64_t> s{n, kChannels};
  for (int d = 2; d < dims; ++d) s.push_back(spatial[d - 2]);
  return s;
}

void expect_close(const at::Tensor& got, const at::Tensor& want, const std::string& what) {
  ASSERT_EQ(got.sizes(), want.sizes()) << what;
  if (want.numel() == 0) return;
  const double scale = std::max(want.abs().max().item<double>(), 1e-6);
  const double rel = (got - want).abs().max().item<double>() / scale;
  EXPECT_LE(rel, 1e-7) << what << " on rank " << rank() << ": max difference " << rel << " of the largest value";
}

struct Case {
  int dims;
  bool affine;
  std::optional<double> momentum;  // nullopt: cumulative moving average
  bool broadcast_buffers;
  bool rank0_empty;
};

void run_case(const Case& c) {
  const int world = world_size(), r = rank();
  const torch::nn::BatchNormOptions bn = torch::nn::BatchNormOptions(kChannels).affine(c.affine).momentum(
      c.momentum ? c10::optional<double>(*c.momentum) : c10::nullopt);
  torch::manual_seed(7);
  auto ref = make_model(c.dims, bn);
  torch::manual_seed(7);
  // doc:begin convert
  // Every BatchNorm of the Sequential becomes a SyncBatchNorm sharing its tensors; then DDP as usual.
  torch::nn::Sequential model = dtrain::convert_sync_batchnorm(make_model(c.dims, bn));
  dtrain::DistributedDataParallel ddp(model, dtrain::DDPOptions().broadcast_buffers(c.broadcast_buffers));
  // doc:end convert
  ASSERT_TRUE(model[1]->as<SyncBatchNorm>()) << "convert_sync_batchnorm left the BatchNorm in place";
  torch::optim::SGD opt(ddp.parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  torch::optim::SGD ref_opt(ref->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));

  int64_t total = 0;
  for (int q = 0; q < world; ++q) total += batch_of(q, c.rank0_empty);
  const int64_t n = batch_of(r, c.rank0_empty), off = offset_of(r, c.rank0_empty);
  for (int step = 0; step < kSteps; ++step) {
    const std::string at_step = " at step " + std::to_string(step);
    auto g = at::make_generator<at::CPUGeneratorImpl>(100 + step);
    const at::Tensor x_all = at::randn(input_shape(c.dims, total), g, at::kDouble) * 2 + 0.5;
    const at::Tensor target_all = at::randn(input_shape(c.dims, total), g, at::kDouble);

    // One process on the whole batch; DDP averages over ranks, so the reference loss is the sum of
    // the ranks' losses over their number.
    at::Tensor x_ref = x_all.clone().requires_grad_(true);
    at::Tensor out_ref = ref->forward(x_ref);
    ref_opt.zero_grad();
    ((out_ref * target_all).sum() / world).backward();

    at::Tensor x = x_all.narrow(0, off, n).clone().requires_grad_(true);
    at::Tensor out = ddp(x);
    opt.zero_grad();
    (out * target_all.narrow(0, off, n)).sum().backward();

    expect_close(out, out_ref.narrow(0, off, n), "output" + at_step);
    // This rank's input gradient is that of the sum of every rank's loss: the reference's times world.
    expect_close(x.grad(), x_ref.grad().narrow(0, off, n) * world, "input gradient" + at_step);
    auto p = ddp.module()->named_parameters(), pr = ref->named_parameters();
    for (const auto& kv : pr) expect_close(p[kv.key()].grad(), kv.value().grad(), kv.key() + ".grad" + at_step);
    opt.step();
    ref_opt.step();
  }
  auto p = ddp.module()->named_parameters(), pr = ref->named_parameters();
  for (const auto& kv : pr)
    expect_close(p[kv.key()], kv.value(), kv.key() + " after " + std::to_string(kSteps) + " steps");
  auto b = ddp.module()->named_buffers(), br = ref->named_buffers();
  ASSERT_EQ(b.size(), br.size());
  for (const auto& kv : br) {
    if (kv.value().scalar_type() == at::kLong)
      EXPECT_TRUE(b[kv.key()].equal(kv.value())) << kv.key();
    else
      expect_close(b[kv.key()], kv.value(), kv.key() + " after " + std::to_string(kSteps) + " steps");
  }

  // Eval: the running statistics, no communication. Only rank 0 runs it: a collective would wait for
  // ranks that never come, and the test would fail at the timeout.
  ddp.module()->eval();
  ref->eval();
  if (r == 0) {
    const at::Tensor x = at::randn(input_shape(c.dims, 4), at::kDouble);
    at::NoGradGuard ng;
    expect_close(model->forward(x), ref->forward(x), "eval output");
  }
  barrier();
}

}  // namespace

TEST(SyncBatchNorm, MatchesOneProcessOverTheConcatenatedBatch) {
  const Case cases[] = {
      {2, true, 0.1, true, false},          {2, false, std::nullopt, false, false},
      {3, true, std::nullopt, true, false}, {3, true, 0.3, false, false},
      {4, true, 0.1, true, false},          {4, false, 0.1, false, false},
      {5, true, std::nullopt, true, false}, {5, true, 0.1, false, false},
      {2, true, 0.1, true, true},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(::testing::Message() << "dims " << c.dims << " affine " << c.affine << " momentum "
                                      << (c.momentum ? std::to_string(*c.momentum) : "cumulative")
                                      << " broadcast_buffers " << c.broadcast_buffers << " rank0_empty "
                                      << c.rank0_empty);
    run_case(c);
    if (::testing::Test::HasFatalFailure()) return;
  }
}

TEST(SyncBatchNorm, ConvertSharesTheTensorsAndRefusesMembersItCannotRewire) {
  torch::nn::BatchNorm2d bn(4);
  auto converted = std::dynamic_pointer_cast<SyncBatchNormImpl>(convert_sync_batchnorm(bn.ptr()));
  ASSERT_TRUE(converted);
  EXPECT_TRUE(converted->weight.is_same(bn->weight));
  EXPECT_TRUE(converted->running_var.is_same(bn->running_var));
  EXPECT_EQ(converted->options.momentum(), std::optional<double>(0.1));

  struct Net : torch::nn::Module {
    Net() { bn = register_module("bn", torch::nn::BatchNorm1d(4)); }
    at::Tensor forward(const at::Tensor& x) { return bn(x); }
    torch::nn::BatchNorm1d bn{nullptr};
  };
  torch::nn::Sequential seq(torch::nn::Linear(4, 4), std::make_shared<Net>());
  try {
    convert_sync_batchnorm(seq);
    ADD_FAILURE() << "a BatchNorm held by a C++ member was silently left unsynchronized";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'1.bn'"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("declare that member as a dtrain::SyncBatchNorm"), std::string::npos)
        << e.what();
  }
}

TEST(SyncBatchNorm, RejectsAnInputWithTheWrongChannelCount) {
  SyncBatchNorm bn(4);
  try {
    bn(at::randn({2, 3}));
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("the input has 3 channels"), std::string::npos) << e.what();
  }
}

DTRAIN_DIST_TEST_MAIN()
