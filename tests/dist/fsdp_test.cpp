// fully_shard on 2, 3 and 4 real processes, against one process training the whole batch in float64:
// shards laid out as FSDP2's, parameters within 1e-10 after 20 steps (SGD with momentum and Adam,
// ZeRO-3 and ZeRO-2; what each mode gathers and keeps whole), gradient accumulation without sync against the large
// batch, clip_grad_norm_ over shards against torch's on the whole model, bf16 and fp16 param dtypes against one process
// computing in them, a bf16 reduce_dtype told apart from a float32 one, sharding over a subgroup, parameters
// whole only while their unit runs, and the bad inputs named in one line on every rank.
#include <torch/nn/modules/linear.h>  // (clip_grad.h needs what it includes)
#include <torch/nn/utils/clip_grad.h>
#include <torch/optim/adam.h>
#include <torch/optim/sgd.h>

#include <unistd.h>

#include <exception>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "common/malloc_threshold.h"
#include "dist_main.h"
#include "dtrain/checkpoint.h"
#include "dtrain/ddp.h"
#include "sanitizer.h"
#include "dtrain/fsdp.h"
#include "fsdp_models.h"
#include "matchers.h"

using namespace dtrain;
using fsdp_models::Net;

namespace {

using fsdp_models::max_rel_diff;

std::unique_ptr<torch::optim::Optimizer> make_optimizer(const std::string& kind, std::vector<at::Tensor> params) {
  if (kind == "sgd") return std::make_unique<torch::optim::SGD>(params, torch::optim::SGDOptions(0.05).momentum(0.9));
  return std::make_unique<torch::optim::Adam>(params, torch::optim::AdamOptions(1e-2));
}

// Steps of training the sharded model on this rank's part and the reference on the whole batch.
struct Pair {
  Net net = fsdp_models::make_net();
  Net ref = fsdp_models::make_net();
  FSDPModule<fsdp_models::NetImpl> fsdp{nullptr};
  std::unique_ptr<torch::optim::Optimizer> opt, ref_opt;

  Pair(const std::string& kind, FullyShardOptions options = FullyShardOptions()) {
    fsdp = fsdp_models::shard(net, options);
    opt = make_optimizer(kind, net->parameters());
    ref_opt = make_optimizer(kind, ref->parameters());
  }
  // zero_grad_after_forward: the optimizer's zero_grad() between forward and backward, while units
  // kept whole (the root by default; every unit under ZeRO-2) hold their shards' gradients aside.
  void step(int s, double clip = 0, bool zero_grad_after_forward = false) {
    auto [x, y] = fsdp_models::batch(s);
    ref_opt->zero_grad();
    (ref->forward(x) - y).pow(2).mean().backward();
    if (clip > 0) torch::nn::utils::clip_grad_norm_(ref->parameters(), clip);
    ref_opt->step();
    fsdp_models::keep_this_ranks_part(x, y);
    if (!zero_grad_after_forward) opt->zero_grad();
    at::Tensor loss = (fsdp(x) - y).pow(2).mean();
    if (zero_grad_after_forward) opt->zero_grad();
    loss.backward();
    if (clip > 0) dtrain::clip_grad_norm_(net->parameters(), clip);
    opt->step();
  }
};

}  // namespace

TEST(FullyShard, EachLocalShardHasFsdp2sRows) {
  Net net = fsdp_models::make_net();
  std::map<std::string, at::Tensor> whole;
  for (const auto& kv : net->named_parameters()) whole[kv.key()] = kv.value().detach().clone();
  fsdp_models::shard(net);
  const int n = world_size(), r = rank();
  for (const auto& kv : net->named_parameters()) {
    const at::Tensor& w = whole.at(kv.key());
    // FSDP2: torch.chunk on dim 0, the ranks past the last chunk get an empty one.
    auto chunks = w.chunk(n, 0);
    at::Tensor expected = r < static_cast<int>(chunks.size()) ? chunks[r] : w.narrow(0, 0, 0);
    EXPECT_EQ(kv.value().sizes(), expected.sizes()) << kv.key() << " on rank " << r << " of " << n;
    EXPECT_TRUE(kv.value().equal(expected)) << kv.key() << ": the shard holds this rank's rows";
  }
}

// Note [Sharding and glibc's mmap threshold]: by the time a model of CPU parameters is sharded,
// glibc's mmap threshold is pinned (at 1 MiB: nothing in this program sets another).
TEST(FullyShard, ShardingPinsGlibcsMmapThreshold) {
#if defined(DTRAIN_TEST_SANITIZER)
  GTEST_SKIP() << "malloc is the sanitizer's here, not glibc's: it has no mmap threshold to pin";
#endif
  Net net = fsdp_models::make_net();
  fsdp_models::shard(net);
  EXPECT_EQ(dtrain::detail::pinned_mmap_threshold(), size_t{1} << 20);
}

TEST(FullyShard, TwentyStepsEqualOneProcessOnTheWholeBatch) {
  for (const std::string kind : {"sgd", "adam"}) {
    for (bool zero3 : {true, false}) {
      Pair pair(kind, FullyShardOptions().reshard_after_forward(zero3));
      for (int s = 0; s < 20; ++s) pair.step(s);
      EXPECT_LT(max_rel_diff(pair.fsdp.full_state_dict(), *pair.ref), 1e-10)
          << kind << (zero3 ? " ZeRO-3" : " ZeRO-2") << " on " << world_size() << " ranks";
      EXPECT_FALSE(pair.net->inner.module()->unused.grad().defined())
          << "a parameter backward never reaches gets no gradient, as in one process";
    }
  }
}

TEST(FullyShard, ZeroGradBetweenForwardAndBackwardClearsTheShardsGradients) {
  // As FSDP2's, whose optimizer clears the sharded parameters' gradients whenever it is called.
  for (bool zero3 : {true, false}) {
    for (bool set_to_none : {true, false}) {
      Pair pair("sgd", FullyShardOptions().reshard_after_forward(zero3));
      for (int s = 0; s < 6; ++s) {
        if (set_to_none) {
          pair.step(s, 0, /*zero_grad_after_forward=*/true);
          continue;
        }
        // zero_grad(false) (LibTorch 1.13's only kind): the gradients zeroed in place, not reset.
        auto [x, y] = fsdp_models::batch(s);
        pair.ref_opt->zero_grad();
        (pair.ref->forward(x) - y).pow(2).mean().backward();
        pair.ref_opt->step();
        fsdp_models::keep_this_ranks_part(x, y);
        at::Tensor loss = (pair.fsdp(x) - y).pow(2).mean();
        for (auto& p : pair.net->parameters())
          if (p.grad().defined()) p.mutable_grad().zero_();
        loss.backward();
        pair.opt->step();
      }
      EXPECT_LT(max_rel_diff(pair.fsdp.full_state_dict(), *pair.ref), 1e-10)
          << (zero3 ? "ZeRO-3" : "ZeRO-2") << (set_to_none ? ", zero_grad()" : ", grads zeroed in place");
    }
  }
}

TEST(FullyShard, AnOptimizerBuiltBeforeShardingHoldsTheShards) {
  // The shards are the module's own tensors, resized, so an optimizer made before fully_shard (and
  // not stepped yet) trains exactly like one made after.
  Net net = fsdp_models::make_net(), ref = fsdp_models::make_net();
  torch::optim::Adam opt(net->parameters(), torch::optim::AdamOptions(1e-2));
  auto fsdp = fsdp_models::shard(net);
  auto ref_fsdp = fsdp_models::shard(ref);
  torch::optim::Adam ref_opt(ref->parameters(), torch::optim::AdamOptions(1e-2));
  for (int s = 0; s < 5; ++s) {
    auto [x, y] = fsdp_models::batch(s);
    fsdp_models::keep_this_ranks_part(x, y);
    for (auto* o : {&opt, &ref_opt}) o->zero_grad();
    (fsdp(x) - y).pow(2).mean().backward();
    (ref_fsdp(x) - y).pow(2).mean().backward();
    opt.step();
    ref_opt.step();
  }
  auto a = net->parameters(), b = ref->parameters();
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(a[i].equal(b[i])) << "parameter " << i;
}

TEST(FullyShard, FromTheSecondIterationEachGatherIsPrefetched) {
  // Forwards start in the order root, blocks.0, blocks.2, inner, inner.b and end in the order
  // blocks.0, blocks.2, inner.b, inner, root. Backward takes them in reverse: the root (whole since
  // forward) prefetches inner; inner's output is inner.b's own output tensor, so inner.b's hook runs
  // first, gathers without a prefetch and prefetches blocks.2; then inner (prefetched by the root),
  // blocks.2, which prefetches blocks.0, and blocks.0: 3 per backward. From the second iteration on,
  // each forward also prefetches the 4 units below the root: 7 per iteration.
  Net net = fsdp_models::make_net();
  auto fsdp = fsdp_models::shard(net);
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.01));
  std::vector<int64_t> prefetched;
  for (int s = 0; s < 3; ++s) {
    auto [x, y] = fsdp_models::batch(s);
    fsdp_models::keep_this_ranks_part(x, y);
    opt.zero_grad();
    (fsdp(x) - y).pow(2).mean().backward();
    opt.step();
    prefetched.push_back(fsdp.prefetched_gathers());
  }
  EXPECT_EQ(prefetched[0], 3) << "the first forward knows no order; its backward prefetches";
  EXPECT_EQ(prefetched[1] - prefetched[0], 7) << "the second iteration prefetches in forward too";
  EXPECT_EQ(prefetched[2] - prefetched[1], 7) << "every later iteration alike";
}

TEST(FullyShard, ParametersAreWholeOnlyWhileTheirUnitRuns) {
  Net net = fsdp_models::make_net();
  auto fsdp = fsdp_models::shard(net);
  const auto shard_numel = [&] {
    int64_t total = 0;
    for (const auto& p : net->parameters()) total += p.numel();
    return total;
  };
  const int64_t sharded = shard_numel();
  auto [x, y] = fsdp_models::batch(0);
  fsdp_models::keep_this_ranks_part(x, y);
  at::Tensor loss = (fsdp(x) - y).pow(2).mean();
  // After forward only the root keeps its parameters (FSDP2's default); the units below reshard.
  EXPECT_EQ(net->inp->weight.size(0), 13) << "the root is whole after forward";
  EXPECT_LT(net->inner.module()->a->weight.size(0), 9) << "a unit below the root is sharded after forward";
  loss.backward();
  EXPECT_EQ(shard_numel(), sharded) << "every unit is sharded again after backward";
  for (const auto& p : net->parameters()) {
    if (p.grad().defined()) {
      EXPECT_EQ(p.grad().sizes(), p.sizes()) << "each gradient is its shard's";
    }
  }
}

// What each unit's collectives move, from FSDP2's padded layout (ceil(rows / n) rows per rank): an
// all-gather and a reduce-scatter each receive (n - 1) padded shards. FSDP2's default (unset) keeps
// the root whole after forward and gathers every unit below it again in backward; true reshards the
// root too, so backward gathers it as well; false (ZeRO-2) keeps every unit whole from its forward to
// its backward, so each unit gathers once a step. A mode that silently behaved as another would
// change both the bytes and the shapes seen between forward and backward.
TEST(FullyShard, ReshardAfterForwardSetsWhatIsGatheredAndWhatStaysWhole) {
  const int64_t n = world_size();
  const auto padded = [&](std::vector<std::vector<int64_t>> shapes) {
    int64_t numel = 0;
    for (const auto& s : shapes) {
      const int64_t rows = s[0], row_numel = s.size() > 1 ? s[1] : 1;
      numel += (rows + n - 1) / n * row_numel;
    }
    return numel;
  };
  // The units of fsdp_models::Net and the shapes of the parameters each holds.
  const int64_t root = padded({{13, 8}, {13}, {3, 11}, {3}});
  const int64_t below =
      padded({{5, 13}, {5}}) + padded({{7, 5}, {7}}) + padded({{11, 9}, {11}}) + padded({{9, 7}, {9}, {5, 2}});
  const int64_t shard_bytes = (n - 1) * static_cast<int64_t>(sizeof(double));
  const auto rows = [&](int64_t whole, bool sharded) {  // this rank's rows: the last ranks may hold fewer
    const int64_t chunk = (whole + n - 1) / n;
    return sharded ? std::max<int64_t>(0, std::min(chunk, whole - rank() * chunk)) : whole;
  };
  for (std::optional<bool> option : {std::optional<bool>(), std::optional<bool>(true), std::optional<bool>(false)}) {
    const std::string mode = !option ? "default" : *option ? "true" : "false";
    const bool root_resharded = option.value_or(false), below_resharded = option.value_or(true);
    Net net = fsdp_models::make_net();
    FullyShardOptions o;
    if (option) o.reshard_after_forward(*option);
    auto fsdp = fsdp_models::shard(net, o);
    torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.01));
    for (int s = 0; s < 2; ++s) {
      auto [x, y] = fsdp_models::batch(s);
      fsdp_models::keep_this_ranks_part(x, y);
      const int64_t start = fsdp.received_bytes();
      opt.zero_grad();
      at::Tensor loss = (fsdp(x) - y).pow(2).mean();
      EXPECT_EQ(fsdp.received_bytes() - start, (root + below) * shard_bytes) << mode << ": forward gathers every unit";
      // Between forward and backward.
      EXPECT_EQ(net->inner.module()->a->weight.size(0), rows(9, below_resharded)) << mode;
      EXPECT_EQ(net->inner.module()->b.get()->weight.size(0), rows(11, below_resharded)) << mode;
      EXPECT_EQ(net->inp->weight.size(0), rows(13, root_resharded)) << mode << ": the root";
      const int64_t before_backward = fsdp.received_bytes();
      loss.backward();
      const int64_t gathers = (below_resharded ? below : 0) + (root_resharded ? root : 0);
      EXPECT_EQ(fsdp.received_bytes() - before_backward, (gathers + root + below) * shard_bytes)
          << mode << ": backward gathers what forward resharded and reduce-scatters every unit";
      opt.step();
    }
  }
}

TEST(FullyShard, GradientAccumulationWithoutSyncEqualsTheLargeBatch) {
  Pair pair("sgd");
  for (int s = 0; s < 4; ++s) {
    auto [x1, y1] = fsdp_models::batch(2 * s);
    auto [x2, y2] = fsdp_models::batch(2 * s + 1);
    pair.ref_opt->zero_grad();
    (pair.ref->forward(at::cat({x1, x2})) - at::cat({y1, y2})).pow(2).mean().backward();
    pair.ref_opt->step();
    fsdp_models::keep_this_ranks_part(x1, y1);
    fsdp_models::keep_this_ranks_part(x2, y2);
    pair.opt->zero_grad();
    pair.fsdp.set_requires_gradient_sync(false);
    ((pair.fsdp(x1) - y1).pow(2).mean() / 2).backward();
    pair.fsdp.set_requires_gradient_sync(true);
    ((pair.fsdp(x2) - y2).pow(2).mean() / 2).backward();
    pair.opt->step();
  }
  EXPECT_LT(max_rel_diff(pair.fsdp.full_state_dict(), *pair.ref), 1e-10);
}

TEST(FullyShard, ClipGradNormOverShardsEqualsTorchsOnTheWholeModel) {
  Pair pair("adam");
  for (int s = 0; s < 10; ++s) pair.step(s, /*clip=*/0.05);
  EXPECT_LT(max_rel_diff(pair.fsdp.full_state_dict(), *pair.ref), 1e-10);
}

// A low param dtype (bf16, fp16) against one process computing in it.
static void expect_low_param_dtype_equals_one_process(at::ScalarType low_dtype) {
  // The reference: float32 master weights, copied into a low-precision model for each forward and
  // backward, whose gradients update the master in float32 (what MixedPrecisionPolicy means). The
  // only difference left is where the low dtype sums the batch (per rank, then a float32 average,
  // against the whole batch at once), so the check is relative to how far training moved each
  // parameter.
  Net master = fsdp_models::make_net(), low = fsdp_models::make_net(), net = fsdp_models::make_net();
  master->to(at::kFloat);
  low->to(low_dtype);
  net->to(at::kFloat);
  std::vector<at::Tensor> start;
  for (const auto& p : master->parameters()) start.push_back(p.detach().clone());
  auto fsdp = fsdp_models::shard(
      net, FullyShardOptions().mp_policy(MixedPrecisionPolicy().param_dtype(low_dtype).reduce_dtype(at::kFloat)));
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.5));
  torch::optim::SGD ref_opt(master->parameters(), torch::optim::SGDOptions(0.5));
  for (int s = 0; s < 10; ++s) {
    auto [x, y] = fsdp_models::batch(s);
    {
      torch::NoGradGuard no_grad;
      auto mp = master->parameters(), lp = low->parameters();
      for (size_t i = 0; i < mp.size(); ++i) lp[i].copy_(mp[i]);
    }
    low->zero_grad();
    (low->forward(x.to(low_dtype)).to(at::kFloat) - y.to(at::kFloat)).pow(2).mean().backward();
    {
      auto mp = master->parameters(), lp = low->parameters();
      for (size_t i = 0; i < mp.size(); ++i)
        if (lp[i].grad().defined()) mp[i].mutable_grad() = lp[i].grad().to(at::kFloat);
    }
    ref_opt.step();
    fsdp_models::keep_this_ranks_part(x, y);
    opt.zero_grad();
    at::Tensor out = fsdp(x.to(low_dtype));
    EXPECT_EQ(out.scalar_type(), low_dtype) << "computed in the param dtype";
    (out.to(at::kFloat) - y.to(at::kFloat)).pow(2).mean().backward();
    opt.step();
  }
  for (const auto& p : net->parameters()) {
    EXPECT_EQ(p.scalar_type(), at::kFloat) << "shards keep float32";
    if (p.grad().defined()) {
      EXPECT_EQ(p.grad().scalar_type(), at::kFloat) << "and so do their gradients";
    }
  }
  auto whole = fsdp.full_state_dict();
  auto ref = master->named_parameters();
  for (size_t i = 0; i < whole.size(); ++i) {
    const at::Tensor& r = ref[whole[i].first];
    const double moved = (r - start[i]).abs().max().item<double>();
    if (moved == 0) {
      EXPECT_TRUE(whole[i].second.equal(r)) << whole[i].first << " never moves";
      continue;
    }
    const double diff = (whole[i].second - r).abs().max().item<double>() / moved;
    EXPECT_LT(diff, 0.05) << whole[i].first << ": moved " << moved << "; the low dtype sums over other batch splits";
  }
}

// reduce_dtype is the dtype gradients travel and are averaged in. A bf16 reduce hands each shard an
// average that is a bfloat16 number (8 bits of mantissa) converted back to float32: every element of
// the gradient survives a round trip through bfloat16 unchanged, and lies within a few bf16 steps of
// float32's average; a float32 reduce gives float32's average (every rank's gradient on its part of
// the batch, computed here in one process) to float32 rounding, most of whose elements bfloat16
// cannot hold. A tolerance alone could not tell the two apart.
TEST(FullyShard, ReduceDtypeIsTheDtypeGradientsAreAveragedIn) {
  const int64_t n = world_size(), r = rank();
  auto [x, y] = fsdp_models::batch(0);
  x = x.to(at::kFloat);
  y = y.to(at::kFloat);
  Net ref = fsdp_models::make_net();
  ref->to(at::kFloat);
  const auto params = ref->parameters();
  std::vector<at::Tensor> average(params.size());
  std::vector<double> scale(params.size(), 1e-30);  // the largest magnitude any rank's gradient has
  for (int64_t q = 0; q < n; ++q) {                 // rank q's gradient, on its rows of the batch
    ref->zero_grad();
    (ref->forward(x.chunk(n)[q]) - y.chunk(n)[q]).pow(2).mean().backward();
    for (size_t i = 0; i < params.size(); ++i) {
      at::Tensor g = params[i].grad().defined() ? params[i].grad() : at::zeros_like(params[i]);
      average[i] = q ? average[i] + g / n : g / n;
      scale[i] = std::max(scale[i], g.abs().max().item<double>());
    }
  }
  for (at::ScalarType reduce : {at::kFloat, at::kBFloat16}) {
    const char* what = reduce == at::kFloat ? "float32 reduce" : "bfloat16 reduce";
    Net net = fsdp_models::make_net();
    net->to(at::kFloat);
    auto fsdp = fsdp_models::shard(net, FullyShardOptions().mp_policy(MixedPrecisionPolicy().reduce_dtype(reduce)));
    at::Tensor xr = x.clone(), yr = y.clone();
    fsdp_models::keep_this_ranks_part(xr, yr);
    (fsdp(xr) - yr).pow(2).mean().backward();
    int64_t elements = 0, bf16_exact = 0;
    double worst = 0;  // from float32's average, in bf16 steps at the tensor's largest gradient
    const auto shards = net->parameters();
    for (size_t i = 0; i < shards.size(); ++i) {
      if (!shards[i].grad().defined() || shards[i].numel() == 0) continue;
      const at::Tensor& got = shards[i].grad();
      EXPECT_EQ(got.scalar_type(), at::kFloat) << what << ": the shard's gradient is back in its dtype";
      const int64_t rows = params[i].size(0), chunk = (rows + n - 1) / n;
      at::Tensor want = average[i].narrow(0, std::min(rows, r * chunk), shards[i].size(0));
      elements += got.numel();
      bf16_exact += got.to(at::kBFloat16).to(at::kFloat).eq(got).sum().item<int64_t>();
      const double step = scale[i] * std::ldexp(1.0, -7);  // bf16's spacing there, within 2x
      worst = std::max(worst, (got - want).abs().max().item<double>() / step);
    }
    ASSERT_GT(elements, 0);
    if (reduce == at::kBFloat16) {
      EXPECT_EQ(bf16_exact, elements) << what << ": every averaged element is a bfloat16 number";
      EXPECT_LT(worst, 4.0) << what << ": within a few bf16 steps of float32's average";
    } else {
      EXPECT_LT(bf16_exact, elements / 2) << what << ": most elements need float32's mantissa";
      EXPECT_LT(worst, 1e-3) << what << ": float32's average (1e-3 bf16 steps is 2^-17 relative)";
    }
  }
}

TEST(FullyShard, Bf16ParamDtypeEqualsOneProcessComputingInBf16) {
  expect_low_param_dtype_equals_one_process(at::kBFloat16);
}

TEST(FullyShard, Fp16ParamDtypeEqualsOneProcessComputingInFp16) {
  try {
    (void)at::mm(at::ones({2, 2}, at::kHalf), at::ones({2, 2}, at::kHalf));
  } catch (const std::exception&) {
    GTEST_SKIP() << "this LibTorch has no float16 matrix product on the CPU";
  }
  expect_low_param_dtype_equals_one_process(at::kHalf);
}

// The world split in two subgroups, the first ranks and the last one, each sharding its own model
// over its own ranks and training on the whole batch split among them: nothing may assume the
// world group.
TEST(FullyShard, OnASubgroupEqualsOneProcess) {
  const int n = world_size();
  std::vector<int> first, last{n - 1};
  for (int r = 0; r + 1 < n; ++r) first.push_back(r);
  const Group a = new_group(first), b = new_group(last);  // every rank creates both, in this order
  const Group& mine = rank() < n - 1 ? a : b;
  Net net = fsdp_models::make_net(), ref = fsdp_models::make_net();
  std::map<std::string, at::Tensor> whole;
  for (const auto& kv : net->named_parameters()) whole[kv.key()] = kv.value().detach().clone();
  auto fsdp = fsdp_models::shard(net, FullyShardOptions().process_group(mine));
  for (const auto& kv : net->named_parameters()) {
    auto chunks = whole.at(kv.key()).chunk(mine.size(), 0);
    const int64_t rows = mine.rank() < static_cast<int>(chunks.size()) ? chunks[mine.rank()].size(0) : 0;
    EXPECT_EQ(kv.value().size(0), rows) << kv.key() << ": sharded over the subgroup of " << mine.size();
  }
  auto opt = make_optimizer("adam", net->parameters()), ref_opt = make_optimizer("adam", ref->parameters());
  for (int s = 0; s < 10; ++s) {
    auto [x, y] = fsdp_models::batch(s);
    ref_opt->zero_grad();
    (ref->forward(x) - y).pow(2).mean().backward();
    ref_opt->step();
    x = x.chunk(mine.size())[mine.rank()];
    y = y.chunk(mine.size())[mine.rank()];
    opt->zero_grad();
    (fsdp(x) - y).pow(2).mean().backward();
    opt->step();
  }
  EXPECT_LT(max_rel_diff(fsdp.full_state_dict(), *ref), 1e-10) << "a subgroup of " << mine.size() << " ranks";
}

// FSDP2's mesh argument: a 1-D sub-mesh shards over its group, as process_group(that group) does.
TEST(FullyShard, AOneDimensionalSubMeshShardsOverItsGroup) {
  const int64_t rep = world_size() % 2 == 0 ? 2 : 1;
  DeviceMesh mesh = init_device_mesh({rep, world_size() / rep}, {"rep", "dp"});
  const Group dp = mesh.get_group("dp");
  Net net = fsdp_models::make_net(), ref = fsdp_models::make_net();
  std::map<std::string, at::Tensor> whole;
  for (const auto& kv : net->named_parameters()) whole[kv.key()] = kv.value().detach().clone();
  auto fsdp = fsdp_models::shard(net, FullyShardOptions().mesh(mesh["dp"]));
  for (const auto& kv : net->named_parameters()) {
    auto chunks = whole.at(kv.key()).chunk(dp.size(), 0);
    const int64_t rows = dp.rank() < static_cast<int>(chunks.size()) ? chunks[dp.rank()].size(0) : 0;
    EXPECT_EQ(kv.value().size(0), rows) << kv.key() << ": sharded over mesh[\"dp\"] of " << dp.size();
  }
  EXPECT_LT(max_rel_diff(fsdp.full_state_dict(), *ref), 1e-12) << "the whole model back from the dp shards";
}

TEST(FullyShard, BadInputIsNamedInOneLine) {
  auto expect_error = [](const std::function<void()>& fn, const std::string& part) {
    try {
      fn();
      ADD_FAILURE() << "no error; expected one containing: " << part;
    } catch (const dtrain::Error& e) {
      EXPECT_THAT(std::string(e.what()), HasSubstr(part)) << e.what();
      EXPECT_THAT(std::string(e.what()), Not(HasSubstr("\n"))) << "one line: " << e.what();
    }
  };
  {
    Net net = fsdp_models::make_net();
    dtrain::fully_shard(net->inner.module()->b);
    expect_error([&] { dtrain::fully_shard(net->inner.module()->b); }, "already a unit");
  }
  {
    // A 3-D mesh (2-D is HSDP's), and a mesh beside another group.
    DeviceMesh mesh = init_device_mesh({1, 1, world_size()}, {"pp", "rep", "dp"});
    auto lin = std::make_shared<torch::nn::LinearImpl>(4, 4);
    expect_error([&] { dtrain::fully_shard(lin, FullyShardOptions().mesh(mesh)); },
                 "mesh has 3 dimensions (pp, rep, dp); it shards over a 1-D mesh or a 2-D (replicate, shard) one: "
                 "pass the data-parallel dimensions' sub-mesh, as mesh[{\"rep\", \"dp\"}]");
    const Group one = new_group({rank()});  // every rank its own: a group other than mesh["dp"]'s
    expect_error([&] { dtrain::fully_shard(lin, FullyShardOptions().mesh(mesh["dp"]).process_group(one)); },
                 "and process_group ('");
  }
  {
    auto tied = std::make_shared<torch::nn::Module>("Tied");
    auto w = tied->register_parameter("w", torch::randn({4, 4}));
    tied->register_parameter("w_again", w);
    expect_error([&] { dtrain::fully_shard(tied); }, "'w' and 'w_again' are the same tensor");
  }
  {
    // Trained (and an optimizer stepped) before fully_shard: its state has the whole shapes.
    auto trained = std::make_shared<torch::nn::LinearImpl>(4, 4);
    torch::optim::SGD opt(trained->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
    trained->forward(torch::ones({2, 4})).sum().backward();
    opt.step();
    expect_error([&] { dtrain::fully_shard(trained); }, "parameter 'weight' already has a gradient");
  }
  {
    auto ints = std::make_shared<torch::nn::Module>("Ints");
    ints->register_parameter("steps", torch::zeros({4}, at::kLong), /*requires_grad=*/false);
    expect_error([&] { dtrain::fully_shard(ints); }, "only floating-point parameters");
  }
  {
    // DDP and fully_shard on the same parameters, either way round.
    auto wrapped = std::make_shared<torch::nn::LinearImpl>(4, 4);
    {
      DistributedDataParallel ddp(wrapped);
      expect_error([&] { dtrain::fully_shard(wrapped); }, "is already held by DistributedDataParallel");
    }
    auto sharded = std::make_shared<torch::nn::LinearImpl>(4, 4);
    dtrain::fully_shard(sharded);
    expect_error([&] { DistributedDataParallel ddp(sharded); }, "is already held by fully_shard unit");
  }
  {
    // A checkpoint of the whole model (saved before fully_shard) cannot give a sharded model its
    // shards: refused on every rank, with the remedy.
    const int64_t pid0 = all_reduce_values(std::vector<int64_t>{rank() == 0 ? ::getpid() : 0}, ReduceOp::MAX)[0];
    const std::string dir = "/tmp/dtrain_fsdp_whole_" + std::to_string(pid0);
    Net whole = fsdp_models::make_net();
    TrainingState saved;
    saved.model = whole.ptr().get();
    CheckpointManager ckpt(dir);
    ckpt.save(saved);
    Net net = fsdp_models::make_net();
    fsdp_models::shard(net);
    TrainingState st;
    st.model = net.ptr().get();
    expect_error([&] { ckpt.load_latest(st); }, "holds a whole model, saved without fully_shard or parallelize_module");
    barrier();
    if (rank() == 0) std::filesystem::remove_all(dir);
  }
  {
    // Ranks that built different models: every rank names the first difference.
    auto odd = std::make_shared<torch::nn::Module>("Odd");
    odd->register_parameter("w", torch::randn({4 + (rank() == world_size() - 1 ? 1 : 0), 2}));
    expect_error([&] { dtrain::fully_shard(odd); }, "fully_shard('Odd'): ranks disagree on the model");
  }
}

DTRAIN_DIST_TEST_MAIN()
