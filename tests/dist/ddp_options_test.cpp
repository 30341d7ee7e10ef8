// DDPOptions on 2 and 3 real processes: each test fails when its option is ignored (or treated as
// another option), not only when DDP as a whole breaks. Equivalence with one process: ddp_test.cpp.
#include <torch/nn/modules/linear.h>

#include "dist_main.h"
#include "dtrain/ddp.h"
#include "test_util.h"
#include "matchers.h"

using namespace dtrain;

namespace {

// The tensors of every rank, in rank order.
std::vector<at::Tensor> gathered(const at::Tensor& t) {
  std::vector<at::Tensor> all;
  for (int r = 0; r < world_size(); ++r) all.push_back(at::empty_like(t));
  all_gather(all, t.contiguous());
  return all;
}

struct ThreeLayersImpl : torch::nn::Module {
  ThreeLayersImpl() {
    a = register_module("a", torch::nn::Linear(16, 64));
    b = register_module("b", torch::nn::Linear(64, 64));
    c = register_module("c", torch::nn::Linear(64, 4));
  }
  at::Tensor forward(const at::Tensor& x) { return c(torch::relu(b(torch::relu(a(x))))); }
  torch::nn::Linear a{nullptr}, b{nullptr}, c{nullptr};
};
TORCH_MODULE(ThreeLayers);

// out = x * scale, with `scale` a buffer (not a parameter): only broadcast_buffers moves it.
struct ScaledImpl : torch::nn::Module {
  ScaledImpl() {
    fc = register_module("fc", torch::nn::Linear(4, 4));
    scale = register_buffer("scale", at::ones({4}));
  }
  at::Tensor forward(const at::Tensor& x) { return fc(x * scale); }
  torch::nn::Linear fc{nullptr};
  at::Tensor scale;
};
TORCH_MODULE(Scaled);

// `side` = b(x) feeds the loss; the forward returns it only when asked, as a model that keeps an
// auxiliary output in a member would.
struct SideOutputImpl : torch::nn::Module {
  SideOutputImpl() {
    a = register_module("a", torch::nn::Linear(16, 4));
    b = register_module("b", torch::nn::Linear(16, 4));
  }
  std::vector<at::Tensor> forward(const at::Tensor& x, bool return_side) {
    side = b(x);
    at::Tensor main = a(x);
    return return_side ? std::vector<at::Tensor>{main, side} : std::vector<at::Tensor>{main};
  }
  torch::nn::Linear a{nullptr}, b{nullptr};
  at::Tensor side;
};
TORCH_MODULE(SideOutput);

}  // namespace

// With gradient_as_bucket_view every .grad() is a slice of its bucket's flat buffer (the one that is
// all-reduced): the gradients of one bucket share a single storage of the bucket's size, laid out in
// bucket order, and stay there across iterations. Without it each .grad() owns its own storage.
TEST(DDPOptions, GradientAsBucketViewMakesGradsSlicesOfTheBucket) {
  for (bool as_view : {true, false}) {
    ThreeLayers m;
    // Small caps: several buckets, some holding more than one parameter.
    DistributedDataParallel ddp(
        m, DDPOptions().bucket_cap_mb(0.01).first_bucket_cap_mb(0.001).gradient_as_bucket_view(as_view));
    const auto params = ddp.parameters();
    const auto buckets = ddp.bucket_param_indices();
    ASSERT_GE(buckets.size(), 2u);
    for (int step = 0; step < 2; ++step) {
      ddp(at::randn({8, 16})).sum().backward();
      for (size_t b = 0; b < buckets.size(); ++b) {
        int64_t bucket_bytes = 0;
        for (int i : buckets[b]) bucket_bytes += params[i].numel() * params[i].element_size();
        const at::Tensor& first = params[buckets[b][0]].grad();
        int64_t offset = 0;
        for (int i : buckets[b]) {
          const at::Tensor& g = params[i].grad();
          ASSERT_TRUE(g.defined());
          const auto where = testing::Message()
                             << "bucket " << b << " param " << i << " step " << step << " as_view " << as_view;
          if (as_view) {
            EXPECT_TRUE(g.is_alias_of(first)) << where;
            EXPECT_EQ(static_cast<int64_t>(g.storage().nbytes()), bucket_bytes) << where;
            EXPECT_EQ(static_cast<char*>(g.data_ptr()) - static_cast<char*>(first.data_ptr()), offset) << where;
          } else {
            EXPECT_EQ(static_cast<int64_t>(g.storage().nbytes()), g.numel() * g.element_size()) << where;
            if (i != buckets[b][0]) {
              EXPECT_FALSE(g.is_alias_of(first)) << where;
            }
          }
          offset += g.numel() * g.element_size();
        }
      }
    }
  }
}

// broadcast_buffers: before each forward every rank takes rank 0's buffers (true), or keeps its own
// (false). The buffer is set per rank after construction, which broadcasts it once either way.
TEST(DDPOptions, BroadcastBuffersDecidesWhoseBufferTheForwardUses) {
  for (bool broadcast : {true, false}) {
    Scaled m;
    DistributedDataParallel ddp(m, DDPOptions().broadcast_buffers(broadcast));
    {
      at::NoGradGuard ng;
      m->scale.fill_(rank() + 2.0);
    }
    ddp(at::ones({2, 4})).sum().backward();
    const float expected = broadcast ? 2.0f : rank() + 2.0f;
    EXPECT_TRUE(at::all(m->scale == expected).item<bool>())
        << "broadcast_buffers(" << broadcast << "): rank " << rank() << " has scale " << m->scale[0].item<float>();
    auto all = gathered(m->scale);
    for (int r = 1; r < world_size(); ++r)
      EXPECT_EQ(at::equal(all[r], all[0]), broadcast) << "rank " << r << " vs rank 0, broadcast " << broadcast;
  }
}

// static_graph finds the used parameters once, on the first iteration, and keeps that set; with
// find_unused_parameters alone the graph is searched again after every forward, from the tensors the
// forward returns. So when later forwards stop returning the side output (its loss term still
// counts), only static_graph still averages b's gradient: the search would miss b, take it for
// unused, and leave each rank its own gradient.
TEST(DDPOptions, StaticGraphKeepsTheFirstIterationsUsedSet) {
  SideOutput m;
  DistributedDataParallel ddp(m, DDPOptions().static_graph(true));
  const at::Tensor x = at::full({3, 16}, 0.5);  // the same batch on every rank
  const double weight = rank() + 1.0;           // rank r's loss weighs the side output r+1 times
  const double mean_weight = (world_size() + 1) / 2.0;
  for (int step = 0; step < 3; ++step) {
    for (auto& p : ddp.parameters()) p.mutable_grad() = at::Tensor();
    auto out = ddp.forward(x, /*return_side=*/step == 0);
    (out[0].sum() + m->side.sum() * weight).backward();
    // d(sum(side))/d(b.bias) = batch size per output; averaged over ranks: times the mean weight.
    const at::Tensor& g = m->b->bias.grad();
    ASSERT_TRUE(g.defined()) << "step " << step;
    EXPECT_TRUE(at::allclose(g, at::full({4}, 3.0 * mean_weight)))
        << "step " << step << ": rank " << rank() << " has b.bias.grad " << g[0].item<float>() << ", expected "
        << 3.0 * mean_weight << " (the average over ranks)";
  }
  // The set is fixed, not re-searched: a parameter used on the first iteration and no longer
  // afterwards is reported missing (find_unused_parameters would take it as unused).
  SideOutput m2;
  DistributedDataParallel fixed(m2, DDPOptions().static_graph(true));
  fixed.forward(x, true)[0].sum().add(m2->side.sum()).backward();
  const std::string err = test_util::error_of([&] { fixed.forward(x, false)[0].sum().backward(); });
  EXPECT_THAT(err, HasSubstr("b.weight")) << err;
  SideOutput m3;
  DistributedDataParallel searched(m3, DDPOptions().find_unused_parameters(true));
  searched.forward(x, true)[0].sum().add(m3->side.sum()).backward();
  EXPECT_EQ(test_util::error_of([&] { searched.forward(x, false)[0].sum().backward(); }), "");
}

DTRAIN_DIST_TEST_MAIN()
