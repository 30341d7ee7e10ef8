// Tensor parallelism on real ranks, in float64 against one process computing the whole model:
//   - the differentiable collectives pass a gradient check across ranks (finite differences of the
//     sum over ranks of each rank's weighted output);
//   - an MLP block, a transformer block (heads split over the ranks) and a vocab-parallel embedding
//     with a column-parallel head and the parallel cross-entropy give the one process's outputs,
//     input gradients and parameter gradients (this rank's part), and its parameters after 10 Adam
//     steps, within 1e-10 relative; the MLP's hidden size and the classes also in sizes that do
//     not divide by the ranks (torch.chunk's unequal parts);
//   - shards have PyTorch's shapes; the MLP block sends one all-reduce forward and one backward,
//     counted from DTRAIN_DEBUG=DETAIL's record of the group's collectives;
//   - dp x tp on a 2-D mesh with DDP, or fully_shard, over dp equals one process on the whole batch;
//   - a TP model's gathered state dict loads into the unsharded model;
//   - bad plans are one line.
#include <gmock/gmock.h>

#include <ATen/ATen.h>
#include <torch/nn/functional/loss.h>
#include <torch/optim/adam.h>
#include <torch/serialize.h>

#include <unistd.h>

#include <cstdio>
#include <functional>
#include <map>

#include "comm/state.h"  // the group's count of checked collectives (DTRAIN_DEBUG=DETAIL)
#include "dist_main.h"
#include "dtrain/ddp.h"
#include "dtrain/fsdp.h"
#include "dtrain/device_mesh.h"
#include "dtrain/functional_collectives.h"
#include "dtrain/tensor_parallel.h"
#include "matchers.h"
#include "tp_compare.h"
#include "tp_models.h"

using namespace dtrain;
using ::testing::HasSubstr;
using ::testing::StartsWith;

namespace {

using tp_compare::kTol;
using tp_compare::part_of;
using tp_compare::rel_diff;

using tp_compare::copy_params;
using tp_compare::expect_equivalent;
using tp_compare::expect_params_match;

Group tp_group() { return init_device_mesh({world_size()}, {"tp"}).get_group(); }

}  // namespace

// Finite differences of L = sum over ranks of <w_r, f(x)_r> along random directions v (one per
// rank, all moving at once), against the analytic sum over ranks of <grad_r, v_r>: torch's
// gradcheck in its fast mode (random projections), across ranks.
TEST(FunctionalCollectives, GradcheckInFloat64) {
  const int64_t n = world_size();
  using F = std::function<at::Tensor(const at::Tensor&)>;
  const std::vector<std::tuple<std::string, F, std::vector<int64_t>>> cases = {
      {"all_reduce SUM", [](const at::Tensor& x) { return functional::all_reduce(x); }, {n, 2}},
      {"all_reduce AVG", [](const at::Tensor& x) { return functional::all_reduce(x, ReduceOp::AVG); }, {n, 2}},
      {"all_gather dim 0", [](const at::Tensor& x) { return functional::all_gather(x, 0); }, {2, 3}},
      {"all_gather dim -1", [](const at::Tensor& x) { return functional::all_gather(x, -1); }, {2, 3}},
      {"reduce_scatter dim 0", [](const at::Tensor& x) { return functional::reduce_scatter(x, 0); }, {n, 2}},
      {"reduce_scatter dim 1 AVG",
       [](const at::Tensor& x) { return functional::reduce_scatter(x, 1, ReduceOp::AVG); },
       {2, n}},
      {"all_to_all 0 -> 1", [](const at::Tensor& x) { return functional::all_to_all(x, 0, 1); }, {n, 2}},
      {"all_to_all 1 -> 0", [](const at::Tensor& x) { return functional::all_to_all(x, 1, 0); }, {2, n}},
  };
  const double eps = 1e-6;
  for (const auto& [name, f, shape] : cases) {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(100 + rank());
    at::Tensor x = at::randn(shape, gen, at::kDouble);
    at::Tensor w = at::randn(f(x).sizes(), gen, at::kDouble);
    auto sum_over_ranks = [](double mine) { return all_reduce_values(std::vector<double>{mine})[0]; };
    auto total = [&, &f = f](const at::Tensor& in) {  // a structured binding: captured by name
      at::NoGradGuard no_grad;
      return sum_over_ranks((f(in) * w).sum().item<double>());
    };
    at::Tensor leaf = x.clone().requires_grad_(true);
    (f(leaf) * w).sum().backward();
    for (int d = 0; d < 4; ++d) {
      at::Tensor v = at::randn(shape, gen, at::kDouble);
      const double numeric = (total(x + eps * v) - total(x - eps * v)) / (2 * eps);
      const double analytic = sum_over_ranks((leaf.grad() * v).sum().item<double>());
      EXPECT_NEAR(numeric, analytic, 1e-7 * std::max(1.0, std::abs(analytic))) << name << ", direction " << d;
    }
  }
  at::Tensor x = at::ones({2}, at::kDouble).requires_grad_(true);
  EXPECT_THAT([&] { functional::all_reduce(x, ReduceOp::MAX); }, ThrowsDtrainError(HasSubstr("MAX has no gradient")));
}

// An MLP block of `hidden` features (w1 Colwise, w2 Rowwise, or `plan`) against one process.
void expect_mlp_equals_one_process(int64_t hidden, int seed, const ParallelizePlan& plan = tp_models::mlp_plan()) {
  Group g = tp_group();
  torch::manual_seed(seed);
  tp_models::MLP ref(8, hidden), tp(8, hidden);
  ref->to(at::kDouble);
  tp->to(at::kDouble);
  copy_params(*tp, *ref);
  parallelize_module(*tp, g, plan);
  EXPECT_EQ(tp->w1->weight.size(0), at::empty({hidden}).chunk(g.size())[g.rank()].size(0)) << "torch.chunk's part";
  at::Tensor x = at::randn({5, 8}, at::kDouble), target = at::randn({5, 8}, at::kDouble);
  at::Tensor x_tp = x.clone().requires_grad_(true), x_ref = x.clone().requires_grad_(true);
  expect_equivalent(
      *tp, *ref, g,
      [&](torch::nn::Module&, bool is_tp) {
        at::Tensor out = is_tp ? tp(x_tp) : ref(x_ref);
        return std::make_pair(out, (out - target).pow(2).mean());
      },
      [&](bool is_tp) { return (is_tp ? x_tp : x_ref).grad(); });
}

TEST(TensorParallel, MLPBlockEqualsOneProcess) { expect_mlp_equals_one_process(16, 1); }

// A hidden size that does not divide (PyTorch's uneven Shard): 11 on 2 ranks is 6 + 5, 21 on 4 is
// 6 + 6 + 6 + 3 (torch.chunk's parts), Colwise rows then Rowwise columns of unequal parts.
TEST(TensorParallel, UnevenMLPBlockEqualsOneProcess) { expect_mlp_equals_one_process(5 * world_size() + 1, 11); }

// The same uneven hidden layer whole between the two (w1's output gathered: each part padded to
// the widest for the all-gather, then trimmed; w2 takes its columns of it).
TEST(TensorParallel, UnevenHiddenGatheredToReplicateEqualsOneProcess) {
  expect_mlp_equals_one_process(
      5 * world_size() + 1, 13,
      {{"w1", ColwiseParallel().output_layouts(Replicate())}, {"w2", RowwiseParallel().input_layouts(Replicate())}});
}

TEST(TensorParallel, TransformerBlockEqualsOneProcess) {
  Group g = tp_group();
  torch::manual_seed(2);
  const int64_t heads = 4;  // one or more per rank at 2 and 4 ranks
  tp_models::Block ref(16, heads), tp(16, heads);
  ref->to(at::kDouble);
  tp->to(at::kDouble);
  copy_params(*tp, *ref);
  parallelize_module(*tp, g, tp_models::block_plan());
  EXPECT_EQ(tp->q->weight.size(0), 16 / g.size());  // this rank's heads
  at::Tensor x = at::randn({2, 3, 16}, at::kDouble), target = at::randn({2, 3, 16}, at::kDouble);
  at::Tensor x_tp = x.clone().requires_grad_(true), x_ref = x.clone().requires_grad_(true);
  expect_equivalent(
      *tp, *ref, g,
      [&](torch::nn::Module&, bool is_tp) {
        at::Tensor out = is_tp ? tp(x_tp) : ref(x_ref);
        return std::make_pair(out, (out - target).pow(2).mean());
      },
      [&](bool is_tp) { return (is_tp ? x_tp : x_ref).grad(); });
}

// The language model over `classes` (its head Colwise, the loss on the sharded logits) against one
// process; the vocabulary of 11 does not divide evenly.
void expect_lm_equals_one_process(int64_t classes, int seed) {
  Group g = tp_group();
  torch::manual_seed(seed);
  const int64_t vocab = 11;
  tp_models::LM ref(vocab, 6, classes), tp(vocab, 6, classes);
  ref->to(at::kDouble);
  tp->to(at::kDouble);
  copy_params(*tp, *ref);
  parallelize_module(*tp, g, tp_models::lm_plan());
  at::Tensor tokens = at::randint(vocab, {4, 5}, at::kLong);
  at::Tensor target = at::randint(classes, {4, 5}, at::kLong);
  target.index_put_({0, 0}, -100);         // ignored, as by torch's cross_entropy
  target.index_put_({0, 1}, classes - 1);  // a class of the last rank, which may hold fewer
  expect_equivalent(*tp, *ref, g, [&](torch::nn::Module&, bool is_tp) {
    at::Tensor logits = is_tp ? tp(tokens) : ref(tokens);
    at::Tensor loss = is_tp ? parallel_cross_entropy(logits, target, g)
                            : torch::nn::functional::cross_entropy(logits.reshape({-1, classes}), target.reshape(-1));
    return std::make_pair(logits, loss);
  });
}

TEST(TensorParallel, VocabParallelEmbeddingAndCrossEntropyEqualOneProcess) { expect_lm_equals_one_process(12, 3); }

// Classes that do not divide: 9 on 2 ranks is 5 + 4, 17 on 4 is 5 + 5 + 5 + 2 (torch.chunk's parts).
TEST(TensorParallel, ParallelCrossEntropyOverUnevenClassesEqualsOneProcess) {
  expect_lm_equals_one_process(4 * world_size() + 1, 12);
}

// Sequence parallelism's layouts: the MLP's input and output sharded by rows (dim 0), gathered
// before w1 and reduce-scattered after w2; each rank's loss covers its rows, so their sum is the
// one process's loss.
TEST(TensorParallel, SequenceShardedMLPEqualsOneProcess) {
  Group g = tp_group();
  torch::manual_seed(7);
  tp_models::MLP ref(8, 16), tp(8, 16);
  ref->to(at::kDouble);
  tp->to(at::kDouble);
  copy_params(*tp, *ref);
  parallelize_module(
      *tp, g, {{"w1", ColwiseParallel().input_layouts(Shard(0))}, {"w2", RowwiseParallel().output_layouts(Shard(0))}});
  at::Tensor x = at::randn({2 * g.size(), 8}, at::kDouble), target = at::randn({2 * g.size(), 8}, at::kDouble);
  at::Tensor x_tp = x.chunk(g.size())[g.rank()].clone().requires_grad_(true), x_ref = x.clone().requires_grad_(true);
  at::Tensor out = tp(x_tp), ref_out = ref(x_ref);
  (out - target.chunk(g.size())[g.rank()]).pow(2).sum().div(target.numel()).backward();
  (ref_out - target).pow(2).mean().backward();
  EXPECT_LT(rel_diff(out, part_of(ref_out, out, g)), kTol) << "output rows";
  EXPECT_LT(rel_diff(x_tp.grad(), part_of(x_ref.grad(), x_tp.grad(), g)), kTol) << "input grad rows";
  expect_params_match(*tp, *ref, g, /*grads=*/true, "sequence-sharded");
}

TEST(TensorParallel, ShardsHavePyTorchsShapes) {
  Group g = tp_group();
  const int64_t n = g.size();
  tp_models::MLP mlp(8, 16);
  parallelize_module(*mlp, g, tp_models::mlp_plan());
  EXPECT_EQ(mlp->w1->weight.sizes(), at::IntArrayRef({16 / n, 8}));  // Colwise: Shard(0)
  EXPECT_EQ(mlp->w1->bias.sizes(), at::IntArrayRef({16 / n}));
  EXPECT_EQ(mlp->w2->weight.sizes(), at::IntArrayRef({8, 16 / n}));  // Rowwise: Shard(1)
  EXPECT_EQ(mlp->w2->bias.sizes(), at::IntArrayRef({8}));            // Replicate
  tp_models::LM lm(11, 6, 12);
  parallelize_module(*lm, g, tp_models::lm_plan());
  const int64_t chunk = (11 + n - 1) / n;  // torch.chunk of the vocabulary
  EXPECT_EQ(lm->emb->weight.size(0), std::max<int64_t>(0, std::min(chunk, 11 - g.rank() * chunk)));
  EXPECT_EQ(lm->emb->weight.size(1), 6);
  // PyTorch's default RowwiseParallel input is Shard(-1), for an Embedding too: the indices of
  // every rank are gathered, and every rank gets the whole lookup of all of them (rank order), as
  // one process looks up the concatenated indices in the whole table.
  torch::manual_seed(21);
  tp_models::LM gathered(11, 6, 12);
  torch::manual_seed(21);
  tp_models::LM whole(11, 6, 12);
  parallelize_module(*gathered, g, {{"emb", RowwiseParallel()}});
  const auto indices_of = [](int64_t r) { return at::arange(3, at::kLong).add(4 * r + 1).remainder(11); };
  at::Tensor out = gathered->emb(indices_of(g.rank()));
  EXPECT_EQ(out.size(0), 3 * n);
  std::vector<at::Tensor> all;
  for (int64_t r = 0; r < n; ++r) all.push_back(indices_of(r));
  at::NoGradGuard no_grad;
  // Each row comes from one rank, zeros from the others: the sum is exact.
  EXPECT_TRUE(at::equal(out, whole->emb(at::cat(all)))) << "the gathered lookup on rank " << g.rank();
}

// Counted from the group's record of checked collectives (DTRAIN_DEBUG=DETAIL numbers each one and
// leaves its description in the job store), not from the layers' code.
TEST(TensorParallel, MLPBlockSendsOneAllReduceForwardAndOneBackward) {
  Group g = tp_group();
  tp_models::MLP mlp(8, 16);
  mlp->to(at::kDouble);
  parallelize_module(*mlp, g, tp_models::mlp_plan());
  const DebugLevel before = get_debug_level();
  set_debug_level(DebugLevel::DETAIL);
  const auto& impl = comm::resolve(g);
  auto logged = [&](uint64_t seq) {
    return default_store()->get(dtrain::detail::cat("debug/", impl.name, "/", seq, "/", impl.rank));
  };
  at::Tensor x = at::randn({4, 8}, at::kDouble).requires_grad_(true);
  const uint64_t start = impl.debug_seq.load();
  at::Tensor y = mlp(x);
  const uint64_t after_forward = impl.debug_seq.load();
  y.sum().backward();
  const uint64_t after_backward = impl.debug_seq.load();
  set_debug_level(before);
  EXPECT_EQ(after_forward - start, 1u);
  EXPECT_EQ(after_backward - after_forward, 1u);
  auto text = [](const std::vector<uint8_t>& b) { return std::string(b.begin(), b.end()); };
  // (Read only what was logged: a missing key would wait for the timeout.)
  if (after_forward - start == 1) {
    EXPECT_THAT(text(logged(start)), StartsWith("all_reduce(Double[4, 8]"));
  }
  if (after_backward - after_forward == 1) {
    EXPECT_THAT(text(logged(after_forward)), StartsWith("all_reduce(Double[4, 8]"));
  }
}

// dp x tp: the MLP sharded over "tp", DDP averaging over "dp", each dp row on its part of the batch;
// against one process on the whole batch, parameters after 10 Adam steps.
TEST(TensorParallel, TwoDimensionalWithDDPEqualsOneProcess) {
  DeviceMesh mesh = init_device_mesh({world_size() / 2, 2}, {"dp", "tp"});
  Group tp = mesh.get_group("tp"), dp = mesh.get_group("dp");
  torch::manual_seed(4);
  tp_models::MLP ref(8, 16), model(8, 16);
  ref->to(at::kDouble);
  model->to(at::kDouble);
  copy_params(*model, *ref);
  parallelize_module(*model, mesh["tp"], tp_models::mlp_plan());
  DistributedDataParallel ddp(model, DDPOptions().process_group(dp));
  at::Tensor x = at::randn({3 * dp.size(), 8}, at::kDouble), target = at::randn({3 * dp.size(), 8}, at::kDouble);
  at::Tensor my_x = x.chunk(dp.size())[dp.rank()], my_target = target.chunk(dp.size())[dp.rank()];
  torch::optim::Adam opt(model->parameters(), torch::optim::AdamOptions(1e-2));
  torch::optim::Adam ref_opt(ref->parameters(), torch::optim::AdamOptions(1e-2));
  for (int step = 0; step < 10; ++step) {
    opt.zero_grad();
    ref_opt.zero_grad();
    (ddp(my_x) - my_target).pow(2).mean().backward();
    (ref(x) - target).pow(2).mean().backward();
    if (step == 0) expect_params_match(*model, *ref, tp, /*grads=*/true, "at step 0");
    opt.step();
    ref_opt.step();
  }
  expect_params_match(*model, *ref, tp, /*grads=*/false, "after 10 Adam steps");
}

// TP inside FSDP: the MLP sharded over "tp", then its TP shards sharded again over "dp" by
// fully_shard, each dp row on its part of the batch; against one process on the whole batch.
TEST(TensorParallel, InsideFullyShardEqualsOneProcess) {
  DeviceMesh mesh = init_device_mesh({world_size() / 2, 2}, {"dp", "tp"});
  Group dp = mesh.get_group("dp");
  torch::manual_seed(6);
  tp_models::MLP ref(8, 16), model(8, 16);
  ref->to(at::kDouble);
  model->to(at::kDouble);
  copy_params(*model, *ref);
  parallelize_module(*model, mesh["tp"], tp_models::mlp_plan());
  auto fsdp = fully_shard(model, FullyShardOptions().process_group(dp));
  at::Tensor x = at::randn({3 * dp.size(), 8}, at::kDouble), target = at::randn({3 * dp.size(), 8}, at::kDouble);
  at::Tensor my_x = x.chunk(dp.size())[dp.rank()], my_target = target.chunk(dp.size())[dp.rank()];
  tp_compare::adam_steps(*model, *ref, [&] {
    return std::make_pair((fsdp(my_x) - my_target).pow(2).mean(), (ref(x) - target).pow(2).mean());
  });
  auto whole = ref->named_parameters();
  for (const auto& [name, t] : fsdp.full_state_dict())  // the dp rows and the TP parts put together
    EXPECT_LT(rel_diff(t, whole[name]), kTol) << name << " after 10 Adam steps";
}

// The gathered state dict, saved by torch::save as the unsharded model's checkpoint, loads into an
// unsharded model that then computes what the TP model computes.
TEST(TensorParallel, CheckpointLoadsIntoTheUnshardedModel) {
  Group g = tp_group();
  torch::manual_seed(5);
  tp_models::LM tp(11, 6, 12);
  tp->to(at::kDouble);
  parallelize_module(*tp, g, tp_models::lm_plan());
  at::Tensor tokens = at::randint(11, {3, 4}, at::kLong);  // before rank 0 alone draws more
  auto full = dtrain::tp::full_state_dict(*tp);
  const std::string path = "/tmp/dtrain_tp_ckpt_" + std::to_string(getppid()) + ".pt";
  if (rank() == 0) {
    tp_models::LM whole(11, 6, 12);
    whole->to(at::kDouble);
    at::NoGradGuard no_grad;
    auto params = whole->named_parameters();
    for (const auto& [name, t] : full) params[name].copy_(t);
    torch::save(whole, path);
  }
  barrier();
  tp_models::LM loaded(11, 6, 12);
  loaded->to(at::kDouble);
  torch::load(loaded, path);
  barrier();
  if (rank() == 0) std::remove(path.c_str());
  at::Tensor local = tp(tokens), whole = loaded(tokens);
  EXPECT_LT(rel_diff(local, part_of(whole, local, g)), kTol);
  EXPECT_EQ(loaded->emb->weight.size(0), 11);
}

TEST(TensorParallel, BadPlansAreOneLine) {
  Group g = tp_group();
  struct Plain : torch::nn::Module {
    torch::nn::Linear fc{register_module("fc", torch::nn::Linear(4, 4))};
  } plain;
  EXPECT_THAT(
      [&] {
        parallelize_module(plain, g, {{"fc", ColwiseParallel()}});
      },
      ThrowsDtrainError(HasSubstr("declare it as dtrain::ParallelLinear")));
  tp_models::MLP mlp(8, 16);
  EXPECT_THAT(
      [&] {
        parallelize_module(*mlp, g, {{"w3", ColwiseParallel()}});
      },
      ThrowsDtrainError(HasSubstr("'w3' matches no submodule; the submodules are 'w1', 'w2'")));
  DeviceMesh mesh = init_device_mesh({1, world_size()}, {"dp", "tp"});
  EXPECT_THAT([&] { parallelize_module(*mlp, mesh, tp_models::mlp_plan()); },
              ThrowsDtrainError(HasSubstr("pass the tensor-parallel one, e.g. mesh[\"tp\"]")));
}

DTRAIN_DIST_TEST_MAIN()
