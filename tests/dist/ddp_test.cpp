// DistributedDataParallel on 2 and 3 real processes.
//
// Equivalence is the core check: N ranks, each on 1/N of every batch, must end every step with the
// same parameters as one process on the whole batch (the reference runs inside every rank on the
// full batch, which every rank can generate from the step's seed).
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/optim/adam.h>
#include <torch/optim/sgd.h>
#include <torch/serialize.h>

#include "dist_main.h"
#include "dtrain/ddp.h"
#include "tutorial_models.h"
#include "test_util.h"
#include "matchers.h"

using namespace dtrain;
namespace F = torch::nn::functional;

namespace {

constexpr int kGlobalBatch = 12;  // divisible by 2 and 3 ranks

at::Generator gen(uint64_t seed) { return at::make_generator<at::CPUGeneratorImpl>(seed); }

// The full batch of step s, the same on every rank.
std::pair<at::Tensor, at::Tensor> batch(at::IntArrayRef sample_shape, int step, int size = kGlobalBatch) {
  std::vector<int64_t> shape{size};
  shape.insert(shape.end(), sample_shape.begin(), sample_shape.end());
  auto g = gen(1000 + step);
  return {at::randn(shape, g, at::kDouble), at::randint(0, 4, {size}, g)};
}

at::Tensor chunk(const at::Tensor& t, int r, int n) { return t.chunk(n)[r]; }

// Copies parameters and buffers of `from` into `to` (same architecture).
void copy_state(torch::nn::Module& to, const torch::nn::Module& from) {
  at::NoGradGuard ng;
  auto a = to.parameters(), b = from.parameters();
  for (size_t i = 0; i < a.size(); ++i) a[i].copy_(b[i]);
  auto c = to.buffers(), d = from.buffers();
  for (size_t i = 0; i < c.size(); ++i) c[i].copy_(d[i]);
}

double max_rel_diff(torch::nn::Module& a, torch::nn::Module& b) {
  double worst = 0;
  auto pa = a.parameters(), pb = b.parameters();
  for (size_t i = 0; i < pa.size(); ++i) {
    double scale = std::max(pb[i].abs().max().item<double>(), 1e-3);
    worst = std::max(worst, (pa[i] - pb[i]).abs().max().item<double>() / scale);
  }
  return worst;
}

std::unique_ptr<torch::optim::Optimizer> make_opt(const std::string& kind, std::vector<at::Tensor> ps) {
  if (kind == "sgd") return std::make_unique<torch::optim::SGD>(ps, torch::optim::SGDOptions(0.05).momentum(0.9));
  return std::make_unique<torch::optim::Adam>(ps, torch::optim::AdamOptions(1e-3));
}

struct SmallMlpImpl : torch::nn::Module {
  SmallMlpImpl(int out = 4) {
    a = register_module("a", torch::nn::Linear(16, 32));
    b = register_module("b", torch::nn::Linear(32, out));
  }
  at::Tensor forward(const at::Tensor& x) { return b(torch::relu(a(x))); }
  torch::nn::Linear a{nullptr}, b{nullptr};
};
TORCH_MODULE(SmallMlp);

struct BnNetImpl : torch::nn::Module {
  BnNetImpl() {
    conv = register_module("conv", torch::nn::Conv2d(torch::nn::Conv2dOptions(3, 8, 3).padding(1)));
    bn = register_module("bn", torch::nn::BatchNorm2d(8));
    fc = register_module("fc", torch::nn::Linear(8, 4));
  }
  at::Tensor forward(const at::Tensor& x) {  // (B, 3, 8, 8) -> (B, 4)
    auto h = torch::relu(bn(conv(x)));
    return fc(h.mean({2, 3}));
  }
  torch::nn::Conv2d conv{nullptr};
  torch::nn::BatchNorm2d bn{nullptr};
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(BnNet);

// head_b takes part only when use_b.
struct BranchyImpl : torch::nn::Module {
  BranchyImpl() {
    trunk = register_module("trunk", torch::nn::Linear(16, 16));
    head_a = register_module("head_a", torch::nn::Linear(16, 4));
    head_b = register_module("head_b", torch::nn::Linear(16, 4));
  }
  at::Tensor forward(const at::Tensor& x, bool use_b) {
    auto h = torch::relu(trunk(x));
    auto out = head_a(h);
    return use_b ? out + head_b(h) : out;
  }
  torch::nn::Linear trunk{nullptr}, head_a{nullptr}, head_b{nullptr};
};
TORCH_MODULE(Branchy);

// Trains `steps` steps with DDP and with the whole-batch reference; returns the worst relative
// parameter difference seen after any step. per_chunk_reference: the reference runs the forward on
// each rank's chunk separately and averages the losses (needed where the forward is not per-sample,
// e.g. BatchNorm's batch statistics).
//
// Float64 throughout: the check is about the algorithm (which gradients are averaged, when), and in
// float32 the different summation order of a chunked batch (~1e-7) is amplified by Adam's
// normalization of near-zero gradients beyond 1e-6.
template <typename Net, typename Fwd>
double equivalence(Net model, Net ref, std::vector<int64_t> sample_shape, const std::string& opt_kind,
                   DDPOptions options, Fwd fwd, bool per_chunk_reference, int steps = 20) {
  model->to(at::kDouble);
  ref->to(at::kDouble);
  DistributedDataParallel ddp(model, options);
  copy_state(*ref, *model);  // after DDP's broadcast: rank 0's initial state
  auto opt = make_opt(opt_kind, ddp.parameters());
  auto ref_opt = make_opt(opt_kind, ref->parameters());
  const int r = rank(), n = world_size();
  double worst = 0;
  for (int s = 0; s < steps; ++s) {
    auto [x, y] = batch(sample_shape, s);
    opt->zero_grad();
    auto loss = F::cross_entropy(fwd(ddp, chunk(x, r, n), r, s), chunk(y, r, n));
    loss.backward();
    opt->step();

    ref_opt->zero_grad();
    at::Tensor ref_loss;
    if (per_chunk_reference) {
      ref_loss = at::zeros({});
      for (int c = 0; c < n; ++c)
        ref_loss = ref_loss + F::cross_entropy(fwd(*ref, chunk(x, c, n), c, s), chunk(y, c, n)) / n;
    } else {
      ref_loss = F::cross_entropy(fwd(*ref, x, -1, s), y);
    }
    ref_loss.backward();
    ref_opt->step();
    worst = std::max(worst, max_rel_diff(*model, *ref));
  }
  return worst;
}

auto plain = [](auto& m, const at::Tensor& x, int, int) { return m.forward(x); };

using dtrain::test_util::error_of;

constexpr double kTol = 1e-6;

}  // namespace

// DDP's buckets go through the default group: shared memory here, Gloo in dist_ddp_test_gloo_2.
TEST(DDP, DefaultGroupRunsOverTheTransportThisRunTests) { expect_default_group_transport_from_env(); }

TEST(DDP, MlpMatchesSingleProcessSgdAndAdam) {
  for (std::string opt : {"sgd", "adam"}) {
    torch::manual_seed(rank());  // different initial weights per rank: DDP must broadcast rank 0's
    double d = equivalence(tutorial::SimpleModel(), tutorial::SimpleModel(), {128}, opt, DDPOptions(), plain, false);
    EXPECT_LT(d, kTol) << opt;
  }
}

TEST(DDP, TutorialCnnMatchesSingleProcess) {
  for (std::string opt : {"sgd", "adam"}) {
    torch::manual_seed(rank());
    double d = equivalence(tutorial::TrainModel(), tutorial::TrainModel(), {3, 32, 32}, opt,
                           DDPOptions().gradient_as_bucket_view(opt == "adam"), plain, false, 10);
    EXPECT_LT(d, kTol) << opt;
  }
}

TEST(DDP, BatchNormModelMatchesAndBuffersFollowRankZero) {
  for (std::string opt : {"sgd", "adam"}) {
    torch::manual_seed(rank());
    BnNet model, ref;
    double d = equivalence(model, ref, {3, 8, 8}, opt, DDPOptions(), plain, true);
    EXPECT_LT(d, kTol) << opt;
  }
  // broadcast_buffers: before a forward that follows a synchronized one, every rank takes rank 0's
  // running stats. The ranks first see different data (their stats drift apart), then the same
  // input: equal stats afterwards prove the broadcast happened before that forward.
  BnNet m;
  DistributedDataParallel ddp(m);
  for (int s = 0; s < 3; ++s) ddp(at::randn({4, 3, 8, 8}) + rank());  // synchronized forwards
  {
    at::NoGradGuard ng;
    ddp(at::ones({2, 3, 8, 8}));
  }
  auto gather_stats = [&] {
    std::vector<at::Tensor> all;
    for (int i = 0; i < world_size(); ++i) all.push_back(at::empty_like(m->bn->running_mean));
    all_gather(all, m->bn->running_mean);
    return all;
  };
  auto all = gather_stats();
  for (auto& t : all) EXPECT_TRUE(at::equal(t, all[0]));
  // PyTorch's rule: that forward was a no-grad one, so the next takes no broadcast, and the ranks'
  // stats drift apart again on different data.
  {
    at::NoGradGuard ng;
    ddp(at::randn({4, 3, 8, 8}) + rank());
  }
  all = gather_stats();
  for (size_t r = 1; r < all.size(); ++r) EXPECT_FALSE(at::equal(all[r], all[0])) << "rank " << r;
}

TEST(DDP, UnusedBranchWithFindUnusedParameters) {
  // head_b: unused by everyone on even steps; on odd steps used only by rank 1 (so it is locally
  // unused on the other ranks but globally used).
  auto fwd = [](auto& m, const at::Tensor& x, int r, int s) {
    bool use_b = s % 2 == 1 && r == 1;
    if (r < 0) throw std::logic_error("per-chunk reference only");
    return m.forward(x, use_b);
  };
  for (std::string opt : {"sgd", "adam"}) {
    torch::manual_seed(rank());
    double d = equivalence(Branchy(), Branchy(), {16}, opt, DDPOptions().find_unused_parameters(true), fwd, true);
    EXPECT_LT(d, kTol) << opt;
  }
  torch::manual_seed(0);
  double d = equivalence(
      Branchy(), Branchy(), {16}, "sgd", DDPOptions().static_graph(true),
      [](auto& m, const at::Tensor& x, int, int) { return m.forward(x, false); }, true, 5);
  EXPECT_LT(d, kTol) << "static_graph";
}

TEST(DDP, UnusedParameterWithoutTheOptionIsAClearError) {
  Branchy m;
  DistributedDataParallel ddp(m);
  auto x = at::randn({4, 16});
  std::string err = error_of([&] { ddp.forward(x, false).sum().backward(); });
  EXPECT_THAT(err, HasSubstr("head_b.weight")) << err;
  EXPECT_THAT(err, HasSubstr("find_unused_parameters")) << err;
  // The wrapper recovers: the next iteration with every parameter used works.
  ddp.forward(x, true).sum().backward();
  barrier();
}

TEST(DDP, NoSyncAccumulationEqualsOneStepOnTheConcatenation) {
  constexpr int k = 3;
  for (bool as_view : {false, true}) {
    torch::manual_seed(rank());
    SmallMlp model, ref;
    model->to(at::kDouble);
    ref->to(at::kDouble);
    DistributedDataParallel ddp(model, DDPOptions().gradient_as_bucket_view(as_view));
    copy_state(*ref, *model);
    torch::optim::SGD opt(ddp.parameters(), 0.1), ref_opt(ref->parameters(), 0.1);
    const int r = rank(), n = world_size();
    for (int s = 0; s < 4; ++s) {
      auto [x, y] = batch({16}, s, kGlobalBatch * k);  // k micro-batches of kGlobalBatch
      auto micro_x = x.chunk(k), micro_y = y.chunk(k);
      opt.zero_grad();
      for (int m = 0; m < k; ++m) {
        auto step = [&] { (F::cross_entropy(ddp(chunk(micro_x[m], r, n)), chunk(micro_y[m], r, n)) / k).backward(); };
        if (m < k - 1) {
          auto guard = ddp.no_sync();
          step();
        } else {
          step();
        }
      }
      opt.step();
      ref_opt.zero_grad();
      at::Tensor ref_loss = at::zeros({});
      for (int m = 0; m < k; ++m)
        for (int c = 0; c < n; ++c)
          ref_loss = ref_loss + F::cross_entropy(ref(chunk(micro_x[m], c, n)), chunk(micro_y[m], c, n)) / (k * n);
      ref_loss.backward();
      ref_opt.step();
      EXPECT_LT(max_rel_diff(*model, *ref), kTol) << "step " << s << " as_view " << as_view;
    }
  }
}

TEST(DDP, BucketCapsAndGradientViewsGiveTheSameResult) {
  std::vector<at::Tensor> first;
  for (double cap : {0.001, 0.05, 25.0, 100.0}) {
    for (bool as_view : {false, true}) {
      torch::manual_seed(7);
      tutorial::SimpleModel m;
      DistributedDataParallel ddp(
          m, DDPOptions().bucket_cap_mb(cap).first_bucket_cap_mb(std::min(cap, 1.0)).gradient_as_bucket_view(as_view));
      if (cap == 0.001) {
        EXPECT_EQ(ddp.bucket_param_indices().size(), 3u);
      }
      if (cap == 100.0) {
        EXPECT_LE(ddp.bucket_param_indices().size(), 2u);
      }
      torch::optim::Adam opt(ddp.parameters(), 1e-3);
      for (int s = 0; s < 5; ++s) {
        auto [x, y] = batch({128}, s);
        opt.zero_grad();
        F::cross_entropy(ddp(chunk(x, rank(), world_size()).to(at::kFloat)), chunk(y, rank(), world_size())).backward();
        opt.step();
      }
      auto ps = m->parameters();
      if (first.empty()) {
        for (auto& p : ps) first.push_back(p.detach().clone());
      } else {
        for (size_t i = 0; i < ps.size(); ++i)
          EXPECT_TRUE(at::allclose(ps[i], first[i], 1e-6, 1e-7)) << "cap " << cap << " view " << as_view;
      }
    }
  }
}

TEST(DDP, FirstBucketIsLaunchedBeforeBackwardEnds) {
  tutorial::SimpleModel m;
  // Buckets: {fc3.bias, fc3.weight} (10 KB > 5 KB), {fc2.*} (257 KB), {fc1.*}.
  DistributedDataParallel ddp(m, DDPOptions().bucket_cap_mb(0.1).first_bucket_cap_mb(0.005));
  ASSERT_GT(ddp.bucket_param_indices().size(), 2u);
  ddp(at::randn({8, 128})).sum().backward();
  auto ev = ddp.last_backward_events();
  int first_launch = -1, last_grad = -1;
  for (int i = 0; i < static_cast<int>(ev.size()); ++i) {
    if (ev[i].kind == DDPEvent::Kind::kBucketLaunched && first_launch < 0) first_launch = i;
    if (ev[i].kind == DDPEvent::Kind::kGradReady) last_grad = i;
  }
  ASSERT_GE(first_launch, 0);
  EXPECT_LT(first_launch, last_grad) << "the first all-reduce must start while backward still runs";
  EXPECT_LT(ev[first_launch].time_ns, ev[last_grad].time_ns);
  // Bucket 0 holds the last layer (its gradient is ready first).
  EXPECT_EQ(ddp.bucket_param_indices()[0].back(), static_cast<int>(m->parameters().size()) - 2);
}

TEST(DDP, DifferentModelsAcrossRanksFailOnEveryRank) {
  SmallMlp m(rank() == world_size() - 1 ? 5 : 4);  // the last rank's head is wider
  auto t0 = std::chrono::steady_clock::now();
  std::string err = error_of([&] { DistributedDataParallel ddp(m); });
  EXPECT_THAT(err, HasSubstr("ranks disagree on the model")) << err;
  EXPECT_THAT(err, HasSubstr("'b.weight' [5, 32]")) << err;
  EXPECT_THAT(err, HasSubstr("rank " + std::to_string(world_size() - 1))) << err;
  EXPECT_LT(std::chrono::steady_clock::now() - t0, dtrain::test_util::scaled(std::chrono::seconds(10)));
}

TEST(DDP, SubgroupAndModuleAccess) {
  Group g = new_group({0, 1});
  if (!g.is_member()) {
    barrier();
    return;
  }
  SmallMlp m;
  DistributedDataParallel ddp(m, DDPOptions().process_group(g));
  EXPECT_EQ(ddp.module().get(), m.ptr().get());
  EXPECT_TRUE(ddp.named_parameters().contains("a.weight"));  // the inner model's names
  // Saving module() gives a file a plain (non-DDP) model loads.
  std::stringstream saved;
  torch::save(ddp.module(), saved);
  SmallMlp plain_model;
  torch::load(plain_model, saved);
  EXPECT_TRUE(at::equal(plain_model->a->weight, m->a->weight));
  auto x = at::full({2, 16}, static_cast<float>(rank()));
  ddp(x).sum().backward();
  std::vector<at::Tensor> grads;
  for (int i = 0; i < 2; ++i) grads.push_back(at::empty_like(m->a->weight.grad()));
  all_gather(grads, m->a->weight.grad(), g);
  EXPECT_TRUE(at::equal(grads[0], grads[1]));
  barrier();
}

TEST(DDP, LoadingTheModelAfterWrappingKeepsGradientsSynchronized) {
  // LibTorch's torch::load set_()s every parameter (Note [Replaced parameters]): a checkpoint loaded
  // into the wrapped model must not silently stop the all-reduce.
  SmallMlp m;
  DistributedDataParallel ddp(m);
  std::stringstream saved;
  torch::save(ddp.module(), saved);
  torch::load(m, saved);
  for (int step = 0; step < 2; ++step) {
    for (auto& p : ddp.parameters()) p.mutable_grad() = at::Tensor();
    auto x = at::full({2, 16}, static_cast<float>(rank() + 1));  // a different batch on every rank
    ddp(x).sum().backward();
    for (const auto& p : ddp.named_parameters()) {
      std::vector<at::Tensor> grads(world_size());
      for (auto& g : grads) g = at::empty_like(p.value().grad());
      all_gather(grads, p.value().grad());
      for (int r = 1; r < world_size(); ++r)
        EXPECT_TRUE(at::equal(grads[r], grads[0])) << p.key() << " differs on rank " << r << ", step " << step;
    }
  }
}

DTRAIN_DIST_TEST_MAIN()
