// SyncBatchNorm on 2 and 3 real processes with unequal batches, against one process's BatchNorm over
// the concatenated batch (float64): outputs, input gradients, parameter gradients, and after 5 SGD
// steps the parameters and running statistics, under DDP with broadcast_buffers on and off. On a
// subgroup (ranks {0, 1} together and rank 2 alone, on 3 ranks) each rank against its own group's
// batch; bfloat16 input against the float32 reference at bfloat16 precision.
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>

#include <optional>
#include <thread>
#include <tuple>

#include "dist_main.h"
#include "dtrain/ddp.h"
#include "dtrain/sync_batchnorm.h"
#include "matchers.h"

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
    EXPECT_THAT(std::string(e.what()), HasSubstr("'1.bn'")) << e.what();
    EXPECT_THAT(std::string(e.what()), HasSubstr("declare that member as a dtrain::SyncBatchNorm")) << e.what();
  }
}

TEST(SyncBatchNorm, RejectsAnInputWithTheWrongChannelCount) {
  SyncBatchNorm bn(4);
  try {
    bn(at::randn({2, 3}));
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_THAT(std::string(e.what()), HasSubstr("the input has 3 channels")) << e.what();
  }
}

// --- A subgroup; bfloat16 ---------------------------------------------------------------------------

namespace {

// The ranks' groups: {0, ..., n - 2} synchronized together and the last rank alone (on 3 ranks {0, 1}
// and {2}; on 2 ranks each alone). Every rank creates both, in the same order.
struct SplitGroups {
  Group mine;
  std::vector<int> members;  // global ranks of `mine`
};
SplitGroups split_groups() {
  const int n = world_size();
  std::vector<int> first;
  for (int r = 0; r + 1 < n; ++r) first.push_back(r);
  Group a = new_group(first), b = new_group({n - 1});
  if (rank() + 1 < n) return {a, first};
  return {b, {n - 1}};
}

// Rows of each rank in the whole (world) batch, and where this rank's start.
int64_t rows_of(int r) { return 3 + 2 * r; }
int64_t start_of(int r) {
  int64_t o = 0;
  for (int q = 0; q < r; ++q) o += rows_of(q);
  return o;
}
// The concatenated rows of `ranks`, in rank order.
at::Tensor rows_of_ranks(const at::Tensor& all, const std::vector<int>& ranks) {
  std::vector<at::Tensor> parts;
  for (int r : ranks) parts.push_back(all.narrow(0, start_of(r), rows_of(r)));
  return at::cat(parts);
}

}  // namespace

TEST(SyncBatchNorm, OnASubgroupEachGroupMatchesOneProcessOverItsOwnBatch) {
  // The layer, DDP and the reference all belong to this rank's group; a rank that synchronized
  // with the wrong ranks (the world, say) would see another batch's statistics.
  const SplitGroups g = split_groups();
  ASSERT_TRUE(g.mine.is_member());
  const int64_t group_rows = [&] {
    int64_t t = 0;
    for (int r : g.members) t += rows_of(r);
    return t;
  }();
  const auto bn = torch::nn::BatchNormOptions(kChannels).momentum(0.2);
  torch::manual_seed(9);
  auto ref = make_model(4, bn);
  torch::manual_seed(9);
  torch::nn::Sequential model = convert_sync_batchnorm(make_model(4, bn), g.mine);
  DistributedDataParallel ddp(model, DDPOptions().process_group(g.mine));
  torch::optim::SGD opt(ddp.parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  torch::optim::SGD ref_opt(ref->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  int64_t world_rows = 0;
  for (int r = 0; r < world_size(); ++r) world_rows += rows_of(r);
  // Where this rank's rows sit in its group's concatenated batch.
  int64_t off = 0;
  for (int r : g.members)
    if (r < rank()) off += rows_of(r);
  const int64_t n = rows_of(rank());
  const double members = static_cast<double>(g.members.size());
  for (int step = 0; step < 3; ++step) {
    const std::string at_step = " at step " + std::to_string(step);
    auto gen = at::make_generator<at::CPUGeneratorImpl>(300 + step);
    const at::Tensor x_all = at::randn(input_shape(4, world_rows), gen, at::kDouble) * 2 + 0.5;
    const at::Tensor t_all = at::randn(input_shape(4, world_rows), gen, at::kDouble);
    const at::Tensor x_group = rows_of_ranks(x_all, g.members), t_group = rows_of_ranks(t_all, g.members);
    ASSERT_EQ(x_group.size(0), group_rows);

    at::Tensor x_ref = x_group.clone().requires_grad_(true);
    at::Tensor out_ref = ref->forward(x_ref);
    ref_opt.zero_grad();
    ((out_ref * t_group).sum() / members).backward();

    at::Tensor x = x_all.narrow(0, start_of(rank()), n).clone().requires_grad_(true);
    at::Tensor out = ddp(x);
    opt.zero_grad();
    (out * t_all.narrow(0, start_of(rank()), n)).sum().backward();

    expect_close(out, out_ref.narrow(0, off, n), "output" + at_step);
    expect_close(x.grad(), x_ref.grad().narrow(0, off, n) * members, "input gradient" + at_step);
    auto p = ddp.module()->named_parameters(), pr = ref->named_parameters();
    for (const auto& kv : pr) expect_close(p[kv.key()].grad(), kv.value().grad(), kv.key() + ".grad" + at_step);
    opt.step();
    ref_opt.step();
  }
  auto b = ddp.module()->named_buffers(), br = ref->named_buffers();
  for (const auto& kv : br)
    if (kv.value().scalar_type() != at::kLong) expect_close(b[kv.key()], kv.value(), kv.key() + " after 3 steps");
}

namespace {

// |got - want| <= 2^-8 |want| + 1e-5 max |want| elementwise: one bfloat16 rounding (8 bits of
// mantissa: half an ulp is 2^-9 of the value) of a float32 result, and float32 round-off beside it.
void expect_bf16_close(const at::Tensor& got, const at::Tensor& want, const std::string& what) {
  ASSERT_EQ(got.sizes(), want.sizes()) << what;
  if (want.numel() == 0) return;
  const at::Tensor g = got.to(at::kFloat), w = want.to(at::kFloat);
  const double scale = w.abs().max().item<double>();
  const at::Tensor excess = (g - w).abs() - (w.abs() * (1.0 / 256) + 1e-5 * scale);
  EXPECT_LE(excess.max().item<double>(), 0)
      << what << " on rank " << rank() << ": max difference " << (g - w).abs().max().item<double>() << " of " << scale;
}

void expect_float_close(const at::Tensor& got, const at::Tensor& want, double tol, const std::string& what) {
  ASSERT_EQ(got.sizes(), want.sizes()) << what;
  const double scale = std::max(want.abs().max().item<double>(), 1e-6);
  EXPECT_LE((got.to(at::kFloat) - want.to(at::kFloat)).abs().max().item<double>() / scale, tol)
      << what << " on rank " << rank();
}

}  // namespace

// bfloat16 input, as PyTorch's SyncBatchNorm takes it on CUDA (on the CPU PyTorch's refuses any
// input in training once torch.distributed is initialized, "SyncBatchNorm expected input tensor to
// be on GPU", whatever its type): the statistics in float32 (batch_norm_stats' accumulate type), the
// output and the input gradient in the input's type, the parameters float32 or bfloat16 (their
// gradients and running statistics in their own type), the normalization computed in float32 and
// rounded once. So synchronized over the world it equals one process's float32 BatchNorm over the
// same values to one bfloat16 rounding. On a group of one there is nothing to synchronize and,
// like PyTorch's, it is the plain batch norm: PyTorch's CPU kernel, bit for bit. (That kernel, in
// 1.13 and 2.x alike, rounds the batch mean and inverse standard deviation to the parameters' type
// before normalizing, so with bfloat16 parameters it is further than one rounding from float32: a
// mean of 3 moves by up to 2^-7. Only float32 parameters are compared with the float reference
// there.)
TEST(SyncBatchNorm, BFloat16InputMatchesTheFloatReferenceAtBFloat16Precision) {
  std::vector<Group> singles;
  for (int r = 0; r < world_size(); ++r) singles.push_back(new_group({r}));  // every rank, same order
  int64_t world_rows = 0;
  for (int r = 0; r < world_size(); ++r) world_rows += rows_of(r);
  std::vector<int> everyone;
  for (int r = 0; r < world_size(); ++r) everyone.push_back(r);
  for (const bool alone : {false, true}) {
    for (const at::ScalarType param_type : {at::kFloat, at::kBFloat16}) {
      SCOPED_TRACE(::testing::Message() << (alone ? "group of one" : "world") << ", parameters "
                                        << c10::toString(param_type));
      const Group group = alone ? singles[rank()] : Group();
      const std::vector<int> members = alone ? std::vector<int>{rank()} : everyone;
      const double momentum = 0.3;
      SyncBatchNorm bn(SyncBatchNormOptions(kChannels).momentum(momentum).process_group(group));
      // The float32 reference, and PyTorch's own BatchNorm in the parameters' type.
      torch::nn::BatchNorm1d ref(torch::nn::BatchNormOptions(kChannels).momentum(momentum));
      torch::nn::BatchNorm1d plain(torch::nn::BatchNormOptions(kChannels).momentum(momentum));
      {
        // Parameters away from 1 and 0, exact in bfloat16 so that every side starts from one value.
        at::NoGradGuard ng;
        auto gen = at::make_generator<at::CPUGeneratorImpl>(77);
        bn->weight.copy_((at::randn({kChannels}, gen) * 0.5 + 1).to(at::kBFloat16));
        bn->bias.copy_((at::randn({kChannels}, gen) * 0.3).to(at::kBFloat16));
        for (auto* m : {&ref, &plain}) {
          (*m)->weight.copy_(bn->weight);
          (*m)->bias.copy_(bn->bias);
        }
      }
      bn->to(param_type);
      plain->to(param_type);
      for (int step = 0; step < 2; ++step) {
        const std::string at_step = " at step " + std::to_string(step);
        auto gen = at::make_generator<at::CPUGeneratorImpl>(900 + step);
        // (N, C, L), the mean far from 0 against the spread; values exact in bfloat16, the float32
        // reference given the same values (and the same output gradient).
        const at::Tensor x_all =
            (at::randn({world_rows, kChannels, 4}, gen) * 0.5 + 3).to(at::kBFloat16).to(at::kFloat);
        const at::Tensor t_all = at::randn({world_rows, kChannels, 4}, gen).to(at::kBFloat16).to(at::kFloat);
        const at::Tensor x_group = rows_of_ranks(x_all, members), t_group = rows_of_ranks(t_all, members);
        int64_t off = 0;
        for (int r : members)
          if (r < rank()) off += rows_of(r);
        const int64_t n = rows_of(rank());
        const at::Tensor t_mine = t_all.narrow(0, start_of(rank()), n);

        at::Tensor x_ref = x_group.clone().requires_grad_(true);
        at::Tensor out_ref = ref->forward(x_ref);
        for (auto& p : ref->parameters()) p.mutable_grad() = at::Tensor();
        (out_ref * t_group).sum().backward();

        at::Tensor x = x_all.narrow(0, start_of(rank()), n).to(at::kBFloat16).requires_grad_(true);
        at::Tensor out = bn->forward(x);
        for (auto& p : bn->parameters()) p.mutable_grad() = at::Tensor();
        (out.to(at::kFloat) * t_mine).sum().backward();

        EXPECT_EQ(out.scalar_type(), at::kBFloat16);
        EXPECT_EQ(x.grad().scalar_type(), at::kBFloat16);
        EXPECT_EQ(bn->weight.grad().scalar_type(), param_type);
        EXPECT_EQ(bn->running_mean.scalar_type(), param_type);
        if (alone) {
          at::Tensor x_plain = x.detach().clone().requires_grad_(true);
          at::Tensor out_plain = plain->forward(x_plain);
          for (auto& p : plain->parameters()) p.mutable_grad() = at::Tensor();
          (out_plain.to(at::kFloat) * t_mine).sum().backward();
          EXPECT_TRUE(out.equal(out_plain)) << "output" << at_step;
          EXPECT_TRUE(x.grad().equal(x_plain.grad())) << "input gradient" << at_step;
          EXPECT_TRUE(bn->weight.grad().equal(plain->weight.grad())) << "weight.grad" << at_step;
          EXPECT_TRUE(bn->bias.grad().equal(plain->bias.grad())) << "bias.grad" << at_step;
          EXPECT_TRUE(bn->running_mean.equal(plain->running_mean)) << "running_mean" << at_step;
          EXPECT_TRUE(bn->running_var.equal(plain->running_var)) << "running_var" << at_step;
          if (param_type == at::kBFloat16) continue;
        }
        expect_bf16_close(out, out_ref.narrow(0, off, n), "output" + at_step);
        expect_bf16_close(x.grad(), x_ref.grad().narrow(0, off, n), "input gradient" + at_step);
        // This rank's share of the parameters' gradients (DDP would average them): sum(dy * x_hat)
        // and sum(dy) over its own rows, x_hat normalized with the group's batch statistics.
        const std::vector<int64_t> dims{0, 2};
        auto [var, mean] = at::var_mean(x_group.to(at::kDouble), at::IntArrayRef(dims), /*unbiased=*/false);
        const at::Tensor x_hat =
            (x_group.to(at::kDouble) - mean.view({1, kChannels, 1})) * (var + 1e-5).rsqrt().view({1, kChannels, 1});
        const at::Tensor dy = t_mine.to(at::kDouble);
        const at::Tensor want_w = (dy * x_hat.narrow(0, off, n)).sum(dims), want_b = dy.sum(dims);
        for (const auto& [got, want, name] : {std::make_tuple(bn->weight.grad(), want_w, "weight.grad"),
                                              std::make_tuple(bn->bias.grad(), want_b, "bias.grad")}) {
          if (param_type == at::kFloat)
            expect_float_close(got, want, 1e-5, name + at_step);
          else
            expect_bf16_close(got, want, name + at_step);
        }
        // The running statistics follow the float32 statistics (in bfloat16: a rounding per update).
        const double stats_tol = param_type == at::kFloat ? 1e-5 : 2.0 / 256;
        expect_float_close(bn->running_mean, ref->running_mean, stats_tol, "running_mean" + at_step);
        expect_float_close(bn->running_var, ref->running_var, stats_tol, "running_var" + at_step);
      }
    }
  }
}

DTRAIN_DIST_TEST_MAIN()
