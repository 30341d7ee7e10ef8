// Join on 3 real ranks with 7, 10 and 4 batches: nobody hangs, and every rank ends with the parameters
// (and buffer) that PyTorch's semantics give, computed here in one process: in iteration i the
// gradient is the sum of the active ranks' gradients divided by 3 (divide_by_initial_world_size) or
// by the number of active ranks; buffers come from the lowest active rank. Also: 10/10/10 under Join
// is bit-identical to no Join; throw_on_early_termination makes every rank throw naming rank 2 and
// iteration 4; DDP + ZeroRedundancyOptimizer under Join reaches the same reference, and so do
// no_sync micro-batches and a communication hook. ZeroRedundancyOptimizer's joined rank steps exactly
// when the others call step() (Note [ZeRO under Join]): with no_sync micro-batches, with an
// evaluation forward under no-grad between backward and step, and with GradScaler skipping steps
// after overflows (also while ranks have joined), every rank ends identical and equal to the
// reference; active ranks at different calls, GradScaler's process_group and a closure under Join are
// clear errors on every rank.
#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>

#include <limits>
#include <optional>
#include <utility>

#include "dist_main.h"
#include "dtrain/amp.h"
#include "dtrain/ddp.h"
#include "dtrain/join.h"
#include "dtrain/zero.h"
#include "matchers.h"

using namespace dtrain;

namespace {

constexpr double kLr = 0.1;
constexpr double kMomentum = 0.9;
constexpr int kMaxBatches = 10;

// A buffer that each rank moves with its own inputs, so which rank's buffer DDP broadcasts shows.
struct NetImpl : torch::nn::Module {
  NetImpl() {
    torch::manual_seed(5);
    a = register_module("a", torch::nn::Linear(5, 8));
    b = register_module("b", torch::nn::Linear(8, 3));
    running = register_buffer("running", at::zeros({5}));
    to(at::kDouble);
  }
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor out = b(at::tanh(a(x - running)));
    if (is_training()) {
      at::NoGradGuard ng;
      running.mul_(0.9).add_(x.mean(0), 0.1);
    }
    return out;
  }
  torch::nn::Linear a{nullptr}, b{nullptr};
  at::Tensor running;
};
TORCH_MODULE(Net);

// Rank r's batch i (micro-batch m of it): (4, 5) inputs, (4, 3) targets.
std::pair<at::Tensor, at::Tensor> batch(int r, int i, int m = 0, at::ScalarType dtype = at::kDouble) {
  auto g = at::make_generator<at::CPUGeneratorImpl>(1000 * r + i + 100 * m);
  return {at::randn({4, 5}, g, at::kDouble).to(dtype), at::randn({4, 3}, g, at::kDouble).to(dtype)};
}

// What a training loop does besides forward, backward and step.
struct Recipe {
  bool zero = false;    // ZeroRedundancyOptimizer (listed after DDP in the Join) instead of SGD
  int micro = 1;        // micro-batches per step, all but the last under no_sync
  bool hook = false;    // DDP averages through allreduce_hook
  int eval_every = 0;   // k > 0: in iterations i % k == 1, an evaluation forward (eval mode, no-grad)
                        // between backward and step
  bool scaler = false;  // float32 with GradScaler, and overflows injected at kOverflows
  Recipe& use_zero(bool on) {
    zero = on;
    return *this;
  }
  Recipe& micro_batches(int n) {
    micro = n;
    return *this;
  }
  Recipe& comm_hook(bool on) {
    hook = on;
    return *this;
  }
  Recipe& evaluate_every(int k) {
    eval_every = k;
    return *this;
  }
  Recipe& grad_scaler(bool on) {
    scaler = on;
    return *this;
  }
  bool evaluates(int i) const { return eval_every > 0 && i % eval_every == 1; }
  at::ScalarType dtype() const { return scaler ? at::kFloat : at::kDouble; }
};

// (rank, iteration): that rank's loss is multiplied by infinity there, so every active rank's
// GradScaler skips the step: before anyone has joined (2), with rank 2 joined (5), with only rank 1
// left (8).
const std::vector<std::pair<int, int>> kOverflows{{0, 2}, {1, 5}, {1, 8}};

bool overflows_at(const Recipe& recipe, int r, int i) {
  return recipe.scaler && std::find(kOverflows.begin(), kOverflows.end(), std::make_pair(r, i)) != kOverflows.end();
}

GradScalerOptions scaler_options(const Recipe& recipe) {
  return GradScalerOptions().init_scale(1024).growth_interval(3).enabled(recipe.scaler);
}

at::Tensor loss_of(const at::Tensor& out, const at::Tensor& y) { return (out - y).pow(2).mean(); }

torch::optim::SGDOptions sgd() { return torch::optim::SGDOptions(kLr).momentum(kMomentum); }

std::vector<int> active_at(const std::vector<int>& counts, int i) {
  std::vector<int> a;
  for (int r = 0; r < static_cast<int>(counts.size()); ++r)
    if (i < counts[r]) a.push_back(r);
  return a;
}

// PyTorch's semantics in one process: every iteration, the active ranks' gradients (each computed
// from the buffer of the iteration's authoritative rank, the lowest active one, as it left that
// rank's previous forward) summed and divided; one SGD step. The final buffer is the last
// iteration's authoritative rank's. micro > 1: each step accumulates that many micro-batches (the
// first ones under no_sync), each forward taking the authoritative rank's buffer afresh. An
// evaluation forward gives every active rank the authoritative rank's buffer (DDP broadcasts it; eval
// mode leaves it as it is). GradScaler: each loss scaled, the step skipped when the summed gradients
// overflow, the scale updated.
Net reference(const std::vector<int>& counts, bool divide_by_initial_world_size, const Recipe& recipe = Recipe()) {
  Net net;
  net->to(recipe.dtype());
  torch::optim::SGD opt(net->parameters(), sgd());
  GradScaler scaler(scaler_options(recipe));
  const int iterations = *std::max_element(counts.begin(), counts.end());
  std::vector<at::Tensor> buffer(counts.size(), net->running.clone());  // each rank's, after its forward
  int authority = 0;
  for (int i = 0; i < iterations; ++i) {
    const auto active = active_at(counts, i);
    authority = active.front();
    std::vector<std::vector<at::Tensor>> local(counts.size());  // per rank, accumulated over micro-batches
    for (int m = 0; m < recipe.micro; ++m) {
      // As PyTorch: the authority's buffers before a forward that follows a synchronized one (the
      // first micro-batch); after a no_sync micro-batch each rank goes on from its own.
      const at::Tensor start = buffer[authority].clone();
      for (int r : active) {
        net->running.copy_(m == 0 ? start : buffer[r]);
        net->zero_grad();
        auto [x, y] = batch(r, i, m, recipe.dtype());
        at::Tensor loss = loss_of(net->forward(x), y);
        if (overflows_at(recipe, r, i)) loss = loss * std::numeric_limits<float>::infinity();
        scaler.scale(loss).backward();
        buffer[r] = net->running.clone();
        auto params = net->parameters();
        for (size_t k = 0; k < params.size(); ++k) {
          if (local[r].size() <= k)
            local[r].push_back(params[k].grad().clone());
          else
            local[r][k] += params[k].grad();
        }
      }
    }
    if (recipe.evaluates(i))
      for (int r : active) buffer[r] = buffer[authority].clone();
    std::vector<at::Tensor> sum;
    for (int r : active) {
      const std::vector<at::Tensor>& grads = local[r];
      if (sum.empty())
        sum = grads;
      else
        for (size_t k = 0; k < sum.size(); ++k) sum[k] += grads[k];
    }
    const double d = divide_by_initial_world_size ? static_cast<double>(counts.size()) : active.size();
    auto params = net->parameters();
    for (size_t k = 0; k < params.size(); ++k) params[k].mutable_grad() = sum[k] / d;
    scaler.step(opt);
    scaler.update();
  }
  net->running.copy_(buffer[authority]);
  return net;
}

double max_rel_diff(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b, int* where = nullptr) {
  double worst = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double scale = std::max(b[i].abs().max().item<double>(), 1e-12);
    const double d = (a[i] - b[i]).abs().max().item<double>() / scale;
    if (d > worst && where) *where = static_cast<int>(i);
    worst = std::max(worst, d);
  }
  return worst;
}

// "1.2e-3 at tensor 4" (the buffer is the last tensor).
std::string diff_text(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  int where = -1;
  const double d = max_rel_diff(a, b, &where);
  return dtrain::detail::cat(d, " at tensor ", where, " of ", a.size());
}

std::vector<at::Tensor> state_of(Net& net) {
  std::vector<at::Tensor> s = net->parameters();
  s.push_back(net->running);
  return s;
}

// Every rank holds the same values (bit for bit).
void expect_same_on_every_rank(const std::vector<at::Tensor>& state, const std::string& what) {
  std::vector<at::Tensor> flat;
  for (const at::Tensor& t : state) flat.push_back(t.detach().to(at::kDouble).reshape(-1));
  const at::Tensor mine = at::cat(flat);
  at::Tensor lo = mine.clone(), hi = mine.clone();
  all_reduce(lo, ReduceOp::MIN);
  all_reduce(hi, ReduceOp::MAX);
  EXPECT_TRUE(lo.equal(mine) && hi.equal(mine)) << what << ": rank " << rank() << " differs from another rank";
}

// This rank's loop: `mine` batches of DDP + the optimizer, as `recipe` says, inside a Join when
// options are given. *skipped: how many steps this rank's GradScaler skipped.
Net train(int mine, std::optional<JoinOptions> options, const Recipe& recipe = Recipe(), int* skipped = nullptr) {
  Net net;
  net->to(recipe.dtype());
  DistributedDataParallel ddp(net);
  if (recipe.hook) ddp.register_comm_hook(Group(), allreduce_hook);
  std::unique_ptr<torch::optim::Optimizer> opt;
  ZeroRedundancyOptimizer* zero_opt = nullptr;
  if (recipe.zero) {
    auto z = std::make_unique<ZeroRedundancyOptimizer>(ddp.parameters(), optimizer_factory<torch::optim::SGD>(sgd()));
    zero_opt = z.get();
    opt = std::move(z);
  } else {
    opt = std::make_unique<torch::optim::SGD>(ddp.parameters(), sgd());
  }
  GradScaler scaler(scaler_options(recipe));
  if (skipped) *skipped = 0;
  auto evaluate = [&](int i) {
    at::NoGradGuard ng;
    ddp.eval();
    auto [x, y] = batch(rank(), 1000 + i, 0, recipe.dtype());
    (void)loss_of(ddp(x), y).item<double>();
    ddp.train();
  };
  auto loop = [&] {
    for (int i = 0; i < mine; ++i) {
      opt->zero_grad();
      for (int m = 0; m < recipe.micro; ++m) {
        auto [x, y] = batch(rank(), i, m, recipe.dtype());
        std::optional<NoSyncGuard> local;
        if (m + 1 < recipe.micro) local.emplace(ddp.no_sync());
        at::Tensor loss = loss_of(ddp(x), y);
        if (overflows_at(recipe, rank(), i)) loss = loss * std::numeric_limits<float>::infinity();
        scaler.scale(loss).backward();
      }
      if (recipe.evaluates(i)) evaluate(i);
      const bool stepped = scaler.step(*opt);
      scaler.update();
      if (skipped && !stepped) ++*skipped;
    }
  };
  if (!options) {
    loop();
    return net;
  }
  std::vector<Joinable*> joinables{&ddp};
  if (zero_opt) joinables.push_back(zero_opt);
  // doc:begin join
  // Each rank loops over its own number of batches; join() then shadows the ranks still training
  // (their gradient all-reduces, with zeros from here) until all are done.
  dtrain::Join join(joinables, *options);  // e.g. Join({&ddp, &optimizer}, JoinOptions())
  loop();                                  // forward, backward, step: as without Join
  join.join();
  // doc:end join
  return net;
}

const std::vector<int> kUneven{7, 10, 4};

}  // namespace

TEST(Join, UnevenInputsEndWithPyTorchsParameters) {
  ASSERT_EQ(world_size(), 3) << "this test is written for 3 ranks with 7, 10 and 4 batches";
  expect_default_group_transport_from_env();
  for (const bool by_initial : {true, false}) {
    Net got = train(kUneven[rank()], JoinOptions().divide_by_initial_world_size(by_initial));
    Net want = reference(kUneven, by_initial);
    EXPECT_LE(max_rel_diff(state_of(got), state_of(want)), 1e-10)
        << "divide_by_initial_world_size=" << by_initial << " on rank " << rank() << ": "
        << diff_text(state_of(got), state_of(want));
    // The two divisors must give different models, or the test could not tell them apart.
    Net other = reference(kUneven, !by_initial);
    EXPECT_GT(max_rel_diff(got->parameters(), other->parameters()), 1e-6);
  }
}

TEST(Join, EvenInputsUnderJoinAreBitIdenticalToNoJoin) {
  const std::vector<int> even(world_size(), kMaxBatches);
  Net with = train(kMaxBatches, JoinOptions());
  Net without = train(kMaxBatches, std::nullopt);
  auto a = with->parameters(), b = without->parameters();
  for (size_t k = 0; k < a.size(); ++k) EXPECT_TRUE(a[k].equal(b[k])) << "parameter " << k << " on rank " << rank();
  EXPECT_LE(max_rel_diff(a, reference(even, true)->parameters()), 1e-10);
}

TEST(Join, ThrowOnEarlyTerminationStopsEveryRankNamingTheFirstToRunOut) {
  ASSERT_EQ(world_size(), 3);
  std::string error;
  try {
    train(kUneven[rank()], JoinOptions().throw_on_early_termination(true));
  } catch (const Error& e) {
    error = e.what();
  }
  EXPECT_THAT(error, HasSubstr("rank 2 ran out of inputs first, at iteration 4")) << "rank " << rank() << ": " << error;
  EXPECT_THAT(error, HasSubstr("throw_on_early_termination")) << error;
  // Every rank left at the same collective: the group still works.
  EXPECT_EQ(all_reduce_values(std::vector<int64_t>{1})[0], world_size());
}

TEST(Join, DisabledJoinIsNoJoin) {
  const std::vector<int> even(world_size(), 3);
  Net got = train(3, JoinOptions().enable(false));
  Net want = train(3, std::nullopt);
  auto a = got->parameters(), b = want->parameters();
  for (size_t k = 0; k < a.size(); ++k) EXPECT_TRUE(a[k].equal(b[k]));
}

TEST(Join, ZeroRedundancyOptimizerUnderJoinEndsWithPyTorchsParameters) {
  ASSERT_EQ(world_size(), 3);
  Net got = train(kUneven[rank()], JoinOptions(), Recipe().use_zero(true));
  Net want = reference(kUneven, true);
  EXPECT_LE(max_rel_diff(state_of(got), state_of(want)), 1e-10)
      << "rank " << rank() << ": " << diff_text(state_of(got), state_of(want));
}

TEST(Join, NoSyncAndCommHooksAreShadowedToo) {
  // Two micro-batches per step, the first under no_sync: a joined rank must shadow the synchronized
  // backward only (DDP's flag all-reduce tells it which); and a communication hook's collectives.
  ASSERT_EQ(world_size(), 3);
  Net want = reference(kUneven, true, Recipe().micro_batches(2));
  for (const bool hook : {false, true}) {
    Net got = train(kUneven[rank()], JoinOptions(), Recipe().micro_batches(2).comm_hook(hook));
    EXPECT_LE(max_rel_diff(state_of(got), state_of(want)), 1e-10)
        << "hook=" << hook << " on rank " << rank() << ": " << diff_text(state_of(got), state_of(want));
  }
}

// Note [ZeRO under Join]: the joined rank's step follows the active ranks' step() calls, whatever
// DDP forwards come between them. Each case with DDP and SGD too, where nothing is sharded.
void expect_recipe_matches_reference(const Recipe& base, const std::string& what) {
  ASSERT_EQ(world_size(), 3);
  Net want = reference(kUneven, true, base);
  const double tolerance = base.scaler ? 1e-5 : 1e-10;  // float32 sums in another order
  for (const bool zero : {false, true}) {
    const Recipe recipe = Recipe(base).use_zero(zero);
    Net got = train(kUneven[rank()], JoinOptions(), recipe);
    const std::string label = what + (zero ? " with ZeroRedundancyOptimizer" : " with SGD");
    expect_same_on_every_rank(state_of(got), label);
    EXPECT_LE(max_rel_diff(state_of(got), state_of(want)), tolerance)
        << label << " on rank " << rank() << ": " << diff_text(state_of(got), state_of(want));
  }
}

TEST(Join, ZeroWithNoSyncMicroBatchesStepsOncePerStep) {
  // Three DDP forwards per step (two under no_sync): one shadow step, not three.
  expect_recipe_matches_reference(Recipe().micro_batches(3), "3 micro-batches");
}

TEST(Join, ZeroWithAnEvalForwardBeforeTheStep) {
  // A forward under no-grad between backward and step: a DDP iteration of its own, without a step.
  expect_recipe_matches_reference(Recipe().evaluate_every(3), "an evaluation forward");
}

TEST(Join, ZeroWithGradScalerSkippedSteps) {
  // The skipped steps' gradients are inf/NaN on every active rank; the joined rank must neither step
  // nor broadcast then, and where the others step it must use the unscaled gradients they use.
  int skipped = -1;
  train(kUneven[rank()], JoinOptions(), Recipe().grad_scaler(true).use_zero(true), &skipped);
  const int expected[] = {2, 3, 1};  // skips at iterations 2 and 5 (rank 0), 2, 5, 8 (rank 1), 2 (rank 2)
  EXPECT_EQ(skipped, expected[rank()]) << "rank " << rank();
  expect_recipe_matches_reference(Recipe().grad_scaler(true), "GradScaler with overflows");
}

TEST(Join, ZeroWithEverythingAtOnce) {
  expect_recipe_matches_reference(Recipe().micro_batches(2).evaluate_every(2).grad_scaler(true),
                                  "2 micro-batches, an evaluation forward and GradScaler");
}

TEST(Join, ActiveRanksAtDifferentCallsAreAClearErrorOnEveryRank) {
  // Rank 0 steps while the others skip that step and go on to the next forward.
  ASSERT_EQ(world_size(), 3);
  Net net;
  DistributedDataParallel ddp(net);
  ZeroRedundancyOptimizer zero(ddp.parameters(), optimizer_factory<torch::optim::SGD>(sgd()));
  std::string error;
  try {
    Join join({&ddp, &zero});
    auto [x, y] = batch(rank(), 0);
    zero.zero_grad();
    loss_of(ddp(x), y).backward();
    if (rank() == 0) zero.step();
    loss_of(ddp(x), y).backward();
  } catch (const Error& e) {
    error = e.what();
  }
  EXPECT_THAT(error,
              HasSubstr("dtrain::Join: after 1 iteration(s) the active ranks are at different calls: rank 0 at "
                        "joinable #1's own round (e.g. ZeroRedundancyOptimizer::step), ranks 1, 2 at joinable #0's "
                        "iteration"))
      << "rank " << rank() << ": " << error;
  EXPECT_THAT(error, HasSubstr("every active rank must make the same calls in the same order")) << error;
  EXPECT_EQ(all_reduce_values(std::vector<int64_t>{1})[0], world_size());  // every rank left at one exchange
}

TEST(Join, GradScalerSyncGroupInsideAJoinIsRefused) {
  // Its overflow all-reduce is a collective no joinable announces: a joined rank would never post it.
  Net net;
  net->to(at::kFloat);
  DistributedDataParallel ddp(net);
  torch::optim::SGD opt(ddp.parameters(), sgd());
  GradScaler scaler(GradScalerOptions().process_group(Group()));
  auto step = [&] {
    auto [x, y] = batch(rank(), 0, 0, at::kFloat);
    opt.zero_grad();
    scaler.scale(loss_of(ddp(x), y)).backward();
    scaler.step(opt);
    scaler.update();
  };
  EXPECT_THAT(
      [&] {
        Join join({&ddp});
        step();
      },
      ThrowsDtrainError(
          AllOf(HasSubstr("GradScaler: process_group on rank " + std::to_string(rank()) + " inside a dtrain::Join"),
                HasSubstr("leave process_group unset"))));
  EXPECT_EQ(all_reduce_values(std::vector<int64_t>{1})[0], world_size());
  step();  // outside a Join, as before
}

TEST(Join, BadUseIsAClearError) {
  Net net;
  DistributedDataParallel ddp(net);
  ZeroRedundancyOptimizer zero(ddp.parameters(), optimizer_factory<torch::optim::SGD>(sgd()));
  try {
    Join j({&zero, &ddp});
    FAIL() << "DDP after another joinable was accepted";
  } catch (const Error& e) {
    EXPECT_THAT(std::string(e.what()), HasSubstr("must be the first joinable")) << e.what();
  }
  try {
    Join j({&ddp, &ddp});
    FAIL() << "a joinable listed twice was accepted";
  } catch (const Error& e) {
    EXPECT_THAT(std::string(e.what()), HasSubstr("list each object once")) << e.what();
  }
  std::string closure;
  try {
    Join j({&ddp, &zero});
    zero.step([] { return at::Tensor(); });
  } catch (const Error& e) {
    closure = e.what();
  }
  EXPECT_THAT(closure, HasSubstr("ZeroRedundancyOptimizer::step: a closure inside a dtrain::Join")) << closure;
  EXPECT_THAT(closure, HasSubstr("call step() without a closure")) << closure;
  // After the failed scopes, a Join works again (no joinable stayed inside one).
  dtrain::join({&ddp, &zero}, JoinOptions(), [] {});
}

DTRAIN_DIST_TEST_MAIN()
