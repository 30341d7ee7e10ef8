// Expert parallelism against one process in float64: the mixture-of-experts layer with its experts
// spread over the world (ep = world size) and each rank its own tokens, against the same layer with
// every expert in one process on the concatenated batch: outputs, the load-balancing loss and every
// gradient within 1e-10; the token counts of each rank pair as the router decided; the capacity's
// drops; 10 Adam steps; a DCP checkpoint saved on ep = world loaded on other ep sizes.
#include <gmock/gmock.h>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/nn/utils/clip_grad.h>
#include <torch/optim/adam.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <string>
#include <unistd.h>
#include <vector>

#include "checkpoint/dcp_metadata.h"  // the saved chunks and items
#include "dist_main.h"
#include "dtrain/ddp.h"
#include "dtrain/device_mesh.h"
#include "dtrain/dcp.h"
#include "dtrain/expert_parallel.h"
#include "dtrain/fsdp.h"
#include "dtrain/shard_spec.h"
#include "matchers.h"

using namespace dtrain;
namespace fs = std::filesystem;

namespace {

constexpr int64_t kDim = 8, kHidden = 12, kBatch = 3, kSeq = 5;

double ept_diff(const at::Tensor& a, const at::Tensor& b) {
  EXPECT_EQ(a.sizes(), b.sizes());
  return a.numel() == 0 ? 0.0 : (a - b).abs().max().item<double>();
}

at::Tensor ept_random(std::vector<int64_t> shape, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  return at::randn(shape, gen, at::TensorOptions(at::kDouble));
}

// The layer from seed 7 in float64: with every expert here (no ep group), or over `ep`.
MoE ept_make(MoEOptions o, std::optional<Group> ep) {
  torch::manual_seed(7);
  o.ep_group(std::move(ep));
  MoE m(o);
  m->to(at::kDouble);
  return m;
}

// This rank's rows of a batch concatenated over the world (dim 0).
at::Tensor ept_mine(const at::Tensor& whole) {
  const int64_t b = whole.size(0) / world_size();
  return whole.narrow(0, rank() * b, b);
}

// Rows [first, first + count) of dim 0: the experts this rank holds of the whole.
at::Tensor ept_experts_of(const at::Tensor& whole, const MoE& m) {
  return whole.narrow(0, m->first_expert(), m->local_experts());
}

void expect_like_one_process(int64_t num_experts, int64_t top_k, bool route_norm) {
  SCOPED_TRACE("E " + std::to_string(num_experts) + ", top " + std::to_string(top_k) +
               (route_norm ? ", route_norm" : ""));
  const int64_t n = world_size();
  auto opts = MoEOptions(kDim, kHidden, num_experts).top_k(top_k).route_norm(route_norm).expert_grad_divisor(1);
  MoE ref = ept_make(opts, std::nullopt), moe = ept_make(opts, Group());
  ASSERT_EQ(moe->w1.size(0), num_experts / n);
  const at::Tensor x = ept_random({n * kBatch, kSeq, kDim}, 11).requires_grad_(true);
  const at::Tensor w = ept_random({n * kBatch, kSeq, kDim}, 12);
  at::Tensor y_ref = ref(x);
  at::Tensor loss_ref = (y_ref * w).sum() + ref->aux_loss();
  auto g_ref = torch::autograd::grad({loss_ref}, {x, ref->router->weight, ref->w1, ref->w2, ref->w3});

  at::Tensor x_mine = ept_mine(x.detach()).clone().requires_grad_(true);
  at::Tensor y = moe(x_mine);
  EXPECT_LT(ept_diff(y, ept_mine(y_ref)), 1e-10) << "output";
  EXPECT_LT(std::abs(moe->aux_loss().item<double>() - ref->aux_loss().item<double>()), 1e-10) << "aux loss";
  // The sum over ranks of each rank's loss is the whole's: the replicated aux loss counts 1 / n here.
  at::Tensor loss = (y * ept_mine(w)).sum() + moe->aux_loss() / static_cast<double>(n);
  auto g = torch::autograd::grad({loss}, {x_mine, moe->router->weight, moe->w1, moe->w2, moe->w3});
  EXPECT_LT(ept_diff(g[0], ept_mine(g_ref[0])), 1e-10) << "input gradient";
  at::Tensor router_grad = g[1].clone();
  all_reduce(router_grad);  // a replicated parameter: the data-parallel sum
  EXPECT_LT(ept_diff(router_grad, g_ref[1]), 1e-10) << "router gradient";
  const char* names[] = {"w1", "w2", "w3"};
  for (size_t i = 0; i < 3; ++i)
    EXPECT_LT(ept_diff(g[2 + i], ept_experts_of(g_ref[2 + i], moe)), 1e-10) << names[i] << " gradient";
}

}  // namespace

TEST(ExpertParallel, ForwardAndGradientsEqualOneProcess) {
  expect_like_one_process(2 * world_size(), 2, false);
  expect_like_one_process(8, 2, false);
  expect_like_one_process(8, 2, true);
  expect_like_one_process(8, 1, false);
}

// Ranks with different numbers of tokens, rank 0 none: the splits are uneven and some empty, and
// the aux loss's means are over the tokens of all ranks.
TEST(ExpertParallel, UnevenAndEmptyBatchesEqualOneProcess) {
  const int64_t n = world_size();
  auto opts = MoEOptions(kDim, kHidden, 8).expert_grad_divisor(1);
  MoE ref = ept_make(opts, std::nullopt), moe = ept_make(opts, Group());
  int64_t total = 0;
  for (int64_t r = 0; r < n; ++r) total += 3 * r;
  const at::Tensor x = ept_random({total, kDim}, 41).requires_grad_(true), w = ept_random({total, kDim}, 42);
  at::Tensor y_ref = ref(x);
  {
    // Switch's loss written out: E * sum_e (choices of e / (T k)) * (mean score of e).
    at::Tensor scores = at::softmax(ref->router(x), -1).detach();
    at::Tensor f = at::bincount(std::get<1>(at::topk(scores, 2, -1)).reshape({-1}), {}, 8).to(at::kDouble) /
                   static_cast<double>(2 * total);
    const double aux = 8.0 * (f * scores.mean(0)).sum().item<double>();
    EXPECT_LT(std::abs(ref->aux_loss().item<double>() - aux), 1e-12) << "aux loss against its formula";
  }
  auto g_ref = torch::autograd::grad({(y_ref * w).sum() + ref->aux_loss()}, {x, ref->router->weight, ref->w1});
  const int64_t first = 3 * rank() * (rank() - 1) / 2, mine = 3 * rank();
  at::Tensor xm = x.detach().narrow(0, first, mine).clone().requires_grad_(true);
  at::Tensor y = moe(xm);
  EXPECT_LT(ept_diff(y, y_ref.narrow(0, first, mine)), 1e-10) << "output";
  EXPECT_LT(std::abs(moe->aux_loss().item<double>() - ref->aux_loss().item<double>()), 1e-10) << "aux loss";
  auto g = torch::autograd::grad({(y * w.narrow(0, first, mine)).sum() + moe->aux_loss() / static_cast<double>(n)},
                                 {xm, moe->router->weight, moe->w1});
  EXPECT_LT(ept_diff(g[0], g_ref[0].narrow(0, first, mine)), 1e-10) << "input gradient";
  at::Tensor router_grad = g[1].clone();
  all_reduce(router_grad);
  EXPECT_LT(ept_diff(router_grad, g_ref[1]), 1e-10) << "router gradient";
  EXPECT_LT(ept_diff(g[2], ept_experts_of(g_ref[2], moe)), 1e-10) << "w1 gradient";
}

// What travels between each pair of ranks is what the router decided: per expert, the choices of
// the tokens of this rank; per rank pair, those for the experts of the receiver.
TEST(ExpertParallel, TokenCountsPerRankPairAreTheRoutersDecisions) {
  const int64_t n = world_size(), e = 8, local = e / n;
  MoE moe = ept_make(MoEOptions(kDim, kHidden, e), Group());
  at::Tensor x = ept_mine(ept_random({n * kBatch, kSeq, kDim}, 21));
  moe(x);
  const MoEDispatch& d = moe->last_dispatch();
  at::Tensor scores = at::softmax(moe->router(x.reshape({-1, kDim})), -1);
  at::Tensor chosen = std::get<1>(at::topk(scores, 2, -1));
  at::Tensor per_expert = at::bincount(chosen.reshape({-1}), {}, e);
  std::vector<int64_t> want(per_expert.data_ptr<int64_t>(), per_expert.data_ptr<int64_t>() + e);
  ASSERT_EQ(d.tokens_per_expert, want);
  ASSERT_EQ(d.dropped, 0);
  const auto everyone = all_gather_values(d.tokens_per_expert);
  int64_t total = 0;
  for (int64_t j = 0; j < n; ++j) {
    int64_t to_j = 0, from_j = 0;
    for (int64_t l = 0; l < local; ++l) {
      to_j += want[static_cast<size_t>(j * local + l)];
      from_j += everyone[static_cast<size_t>(j)][static_cast<size_t>(rank() * local + l)];
    }
    ASSERT_EQ(d.send_counts[static_cast<size_t>(j)], to_j) << "to rank " << j;
    ASSERT_EQ(d.recv_counts[static_cast<size_t>(j)], from_j) << "from rank " << j;
    total += to_j;
  }
  ASSERT_EQ(total, x.numel() / kDim * 2);
}

// The capacity counts a rank's own tokens: over the world, each rank's outputs and input gradients
// are those of one process running the layer on that rank's tokens alone.
TEST(ExpertParallel, CapacityDropsEachRanksOwnTokensAsOneProcess) {
  const int64_t n = world_size(), e = 8;
  auto opts = MoEOptions(kDim, kHidden, e).capacity_factor(1.0);
  MoE ref = ept_make(opts, std::nullopt), moe = ept_make(opts, Group());
  at::Tensor x = ept_mine(ept_random({n * kBatch, kSeq, kDim}, 31)).clone().requires_grad_(true);
  at::Tensor xr = x.detach().clone().requires_grad_(true);
  const at::Tensor w = ept_random({kBatch, kSeq, kDim}, 32 + rank());
  at::Tensor y = moe(x), y_ref = ref(xr);
  EXPECT_LT(ept_diff(y, y_ref), 1e-10) << "output";
  EXPECT_EQ(moe->last_dispatch().tokens_per_expert, ref->last_dispatch().tokens_per_expert);
  const int64_t capacity = (kBatch * kSeq * 2 + e - 1) / e;  // ceil(1.0 * T * k / E)
  for (int64_t c : moe->last_dispatch().tokens_per_expert) EXPECT_LE(c, capacity);
  at::Tensor dropped = at::tensor({moe->last_dispatch().dropped}, at::kLong);
  all_reduce(dropped);
  EXPECT_GT(dropped.item<int64_t>(), 0) << "no choice was over capacity: the test would not see drops";
  auto g = torch::autograd::grad({(y * w).sum()}, {x});
  auto g_ref = torch::autograd::grad({(y_ref * w).sum()}, {xr});
  EXPECT_LT(ept_diff(g[0], g_ref[0]), 1e-10) << "input gradient";
}

// Which choices a full expert drops: first choices before second choices, then token order. Three
// tokens and capacity ceil(1.0 * 3 * 2 / 4) = 2: token 0 picks (1, 0), tokens 1 and 2 pick (0, 1);
// expert 0 keeps the first choices of tokens 1 and 2 (not token 0's second, which comes first in
// token order), expert 1 keeps token 0's first choice and token 1's second.
TEST(ExpertParallel, CapacityKeepsFirstChoicesFirst) {
  MoE m = ept_make(MoEOptions(4, kHidden, 4).capacity_factor(1.0), std::nullopt);
  {
    at::NoGradGuard no_grad;
    m->router->weight.zero_();
    m->router->weight[0][0] = 1.0;
    m->router->weight[1][1] = 1.0;
  }
  at::Tensor x = at::tensor({1.0, 2.0, 0.0, 0.0, 2.0, 1.0, 0.0, 0.0, 3.0, 1.0, 0.0, 0.0}, at::kDouble).view({3, 4});
  at::Tensor y = m(x).detach();
  EXPECT_EQ(m->last_dispatch().tokens_per_expert, (std::vector<int64_t>{2, 2, 0, 0}));
  EXPECT_EQ(m->last_dispatch().dropped, 2);
  at::Tensor p = at::softmax(m->router(x), -1).detach();
  auto expert = [&](int64_t e, int64_t t) {
    at::Tensor xt = x[t].unsqueeze(0);
    return at::matmul(at::silu(at::matmul(xt, m->w1[e])) * at::matmul(xt, m->w3[e]), m->w2[e]).squeeze(0).detach();
  };
  EXPECT_LT(ept_diff(y[0], p[0][1] * expert(1, 0)), 1e-12) << "token 0: its second choice (expert 0) dropped";
  EXPECT_LT(ept_diff(y[1], p[1][0] * expert(0, 1) + p[1][1] * expert(1, 1)), 1e-12) << "token 1: both kept";
  EXPECT_LT(ept_diff(y[2], p[2][0] * expert(0, 2)), 1e-12) << "token 2: its second choice (expert 1) dropped";
}

namespace {

// A replicated input layer before the MoE layer: under fully_shard (the experts ignored), its and
// the router's gradients are averaged over the ranks, the experts' divided by the ep size.
struct EptNetImpl : torch::nn::Module {
  explicit EptNetImpl(std::optional<Group> ep) {
    torch::manual_seed(7);
    inp = register_module("inp", torch::nn::Linear(kDim, kDim));
    moe = register_module("moe", MoE(MoEOptions(kDim, kHidden, 8).ep_group(std::move(ep))));
    to(at::kDouble);
  }
  at::Tensor forward(const at::Tensor& x) { return moe(at::tanh(inp(x))); }
  torch::nn::Linear inp{nullptr};
  MoE moe{nullptr};
};
TORCH_MODULE(EptNet);

}  // namespace

TEST(ExpertParallel, AdamStepsUnderFullyShardEqualOneProcess) {
  const int64_t n = world_size();
  const Group world;
  EptNet ref(std::nullopt), net(world);
  auto fsdp = fully_shard(
      net.ptr(), FullyShardOptions().ignored_params(std::vector<at::Tensor>{net->moe->w1, net->moe->w2, net->moe->w3}));
  ASSERT_TRUE(shard_spec_of(net->moe->w1).has_value());
  torch::optim::Adam opt_ref(ref->parameters(), torch::optim::AdamOptions(1e-2));
  torch::optim::Adam opt(net->parameters(), torch::optim::AdamOptions(1e-2));
  for (int step = 0; step < 10; ++step) {
    at::Tensor x = ept_random({n * kBatch, kSeq, kDim}, 100 + step),
               t = ept_random({n * kBatch, kSeq, kDim}, 200 + step);
    at::Tensor y_ref = ref(x);
    at::Tensor loss_ref = at::mse_loss(y_ref, t) + 0.01 * ref->moe->aux_loss();
    opt_ref.zero_grad();
    loss_ref.backward();
    opt_ref.step();
    at::Tensor y = fsdp(ept_mine(x));
    at::Tensor loss = at::mse_loss(y, ept_mine(t)) + 0.01 * net->moe->aux_loss();
    opt.zero_grad();
    loss.backward();
    // The experts' gradients are the whole batch's mean, as one process's (Adam alone would hide a
    // factor: its steps barely change with the gradients' scale).
    for (const char* name : {"w1", "w2", "w3"}) {
      EXPECT_LT(ept_diff(net->moe->named_parameters()[name].grad(),
                         ept_experts_of(ref->moe->named_parameters()[name].grad(), net->moe)),
                1e-10)
          << name << " gradient, step " << step;
    }
    if (step == 0) {
      // The experts' ShardSpec: clip_grad_norm_ completes their part of the norm over the ep group.
      const double total = dtrain::clip_grad_norm_(net->parameters(), 1e9);
      const double total_ref = torch::nn::utils::clip_grad_norm_(ref->parameters(), 1e9);
      EXPECT_LT(std::abs(total - total_ref), 1e-10 * total_ref) << "gradient norm";
    }
    opt.step();
    // Equal batches: the mean of the ranks' losses is the whole batch's.
    at::Tensor mean = loss.detach().clone();
    all_reduce(mean);
    EXPECT_LT(std::abs(mean.item<double>() / static_cast<double>(n) - loss_ref.item<double>()), 1e-10)
        << "step " << step;
  }
  auto whole = full_state_dict(*net);
  auto ref_params = ref->named_parameters();
  for (const auto& [name, tensor] : whole) {
    ASSERT_TRUE(ref_params.contains(name)) << name;
    EXPECT_LT(ept_diff(tensor, ref_params[name].detach()), 1e-10) << name << " after 10 steps";
  }
  EXPECT_EQ(whole.size(), ref_params.size());
}

namespace {

// Every parameter of `loaded` (first filled with -1: nothing of the load left to chance) as loaded
// from `dir` against `whole`, one process's model holding every expert.
void ept_expect_loads(EptNet& loaded, EptNet& whole, const std::string& dir, const std::string& what) {
  {
    at::NoGradGuard no_grad;
    for (auto& p : loaded->parameters()) p.fill_(-1.0);
  }
  auto sd = dcp::get_state_dict(*loaded);
  dcp::load(sd, dir);
  auto want = whole->named_parameters();
  for (const auto& kv : loaded->named_parameters()) {
    at::Tensor w = want[kv.key()].detach();
    if (kv.key().rfind("moe.w", 0) == 0) w = ept_experts_of(w, loaded->moe);
    EXPECT_LT(ept_diff(kv.value(), w), 1e-15) << what << ": " << kv.key();
  }
}

// The bytes of a DCP directory's data files (not its metadata).
uintmax_t ept_data_bytes(const std::string& dir) {
  uintmax_t total = 0;
  for (const auto& f : fs::directory_iterator(dir))
    if (f.path().extension() == ".distcp") total += f.file_size();
  return total;
}

}  // namespace

// Saved with the experts over the world (each rank its rows), loaded where every rank holds every
// expert (ep = 1), and on 4 ranks where ep groups of 2 hold half each.
TEST(ExpertParallel, DcpCheckpointLoadsOnOtherEpSizes) {
  const std::string dir = "/tmp/dtrain_ep_dcp_" + std::to_string(getppid());
  if (rank() == 0) fs::remove_all(dir);
  barrier();
  const Group world;
  EptNet saved(world), whole(std::nullopt);
  auto sd = dcp::get_state_dict(*saved);
  dcp::save(sd, dir);
  EptNet one(std::nullopt);
  ept_expect_loads(one, whole, dir, "ep 1");
  Group pairs = split_group(rank() / 2, rank());
  if (world_size() == 4) {
    EptNet two(pairs);
    ept_expect_loads(two, whole, dir, "ep 2");
  }
  barrier();
  if (rank() == 0) fs::remove_all(dir);
}

namespace {

// 10 Adam steps of `net` (run through `forward` on this rank's rows of each batch) against one
// process's `ref` on the whole batch. The world is `dp` ep groups of consecutive ranks, each rank's
// aux loss its ep group's (torchtitan's), so the reference trains the whole batch's mse plus 0.01
// times the mean over the ep groups of the aux loss on each group's rows: the mean of the ranks'
// losses. `sync_experts` runs after backward (the experts' average over dp). Each step: this rank's
// aux loss against its group's in the reference, every gradient against the reference's (the
// experts' rows of this rank), the mean loss; at the end every parameter.
void ept_train_like_one_process(EptNet& ref, EptNet& net, const std::function<at::Tensor(const at::Tensor&)>& forward,
                                int64_t dp, const std::function<void()>& sync_experts) {
  const int64_t n = world_size(), ep = n / dp, rows = ep * kBatch;
  torch::optim::Adam opt_ref(ref->parameters(), torch::optim::AdamOptions(1e-2));
  torch::optim::Adam opt(net->parameters(), torch::optim::AdamOptions(1e-2));
  for (int step = 0; step < 10; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    at::Tensor x = ept_random({n * kBatch, kSeq, kDim}, 300 + step),
               t = ept_random({n * kBatch, kSeq, kDim}, 400 + step);
    std::vector<at::Tensor> ys, auxes;
    for (int64_t g = 0; g < dp; ++g) {
      ys.push_back(ref(x.narrow(0, g * rows, rows)));
      auxes.push_back(ref->moe->aux_loss());
    }
    at::Tensor loss_ref = at::mse_loss(at::cat(ys, 0), t) + 0.01 * at::stack(auxes).mean();
    opt_ref.zero_grad();
    loss_ref.backward();
    opt_ref.step();
    at::Tensor y = forward(ept_mine(x));
    EXPECT_LT(std::abs(net->moe->aux_loss().item<double>() - auxes[static_cast<size_t>(rank() / ep)].item<double>()),
              1e-10)
        << "aux loss: one process's on this ep group's tokens";
    at::Tensor loss = at::mse_loss(y, ept_mine(t)) + 0.01 * net->moe->aux_loss();
    opt.zero_grad();
    loss.backward();
    sync_experts();
    auto ref_params = ref->named_parameters();
    for (const auto& kv : net->named_parameters()) {
      // This rank's box of the whole gradient: the experts' rows over ep, fully_shard's over the world.
      at::Tensor want = ref_params[kv.key()].grad();
      if (auto spec = shard_spec_of(kv.value())) {
        const auto offsets = spec->offsets(), sizes = spec->local_sizes();
        for (size_t d = 0; d < offsets.size(); ++d) want = want.narrow(static_cast<int64_t>(d), offsets[d], sizes[d]);
      }
      EXPECT_LT(ept_diff(kv.value().grad(), want), 1e-10) << kv.key() << " gradient";
    }
    opt.step();
    at::Tensor mean = loss.detach().clone();
    all_reduce(mean);
    EXPECT_LT(std::abs(mean.item<double>() / static_cast<double>(n) - loss_ref.item<double>()), 1e-10) << "loss";
  }
  auto whole = full_state_dict(*net);
  auto ref_params = ref->named_parameters();
  for (const auto& [name, tensor] : whole)
    EXPECT_LT(ept_diff(tensor, ref_params[name].detach()), 1e-10) << name << " after 10 steps";
  EXPECT_EQ(whole.size(), ref_params.size());
}

// The checkpoint in `dir` lists `ep` chunks of the experts' w1, each stored once, and its data files
// hold nothing that no item lists (a chunk written by both dp replicas would be).
void ept_expect_stored_once(const std::string& dir, int64_t ep) {
  std::ifstream in(dir + "/.metadata", std::ios::binary);
  const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const dcp::detail::Metadata m = dcp::detail::decode(bytes);
  int64_t listed = 0, w1_items = 0;
  for (const auto& item : m.items) {
    listed += item.storage.length;
    if (item.fqn == "model.moe.w1") ++w1_items;
  }
  auto w1 = m.tensors.find("model.moe.w1");
  ASSERT_NE(w1, m.tensors.end()) << "model.moe.w1 is not in the checkpoint";
  EXPECT_EQ(w1->second.chunks.size(), static_cast<size_t>(ep)) << "one chunk per ep rank";
  EXPECT_EQ(w1_items, ep) << "each expert chunk stored once";
  EXPECT_EQ(static_cast<int64_t>(ept_data_bytes(dir)), listed) << "bytes written that no item lists";
}

std::vector<at::Tensor> ept_experts(const EptNet& net) { return {net->moe->w1, net->moe->w2, net->moe->w3}; }

// After backward: the experts' gradients averaged over their replicas, the dp group (the ep size
// divided them already: with dp that makes the mean over every rank's loss).
void ept_average_experts(const EptNet& net, const Group& dp_group) {
  for (const at::Tensor& w : ept_experts(net)) {
    at::Tensor g = w.grad();
    all_reduce(g, ReduceOp::AVG, dp_group);
  }
}

}  // namespace

// DDP over the world with the experts ignored (ep = world): DDP averages the input layer and the
// router; it neither buckets nor averages the experts, nor broadcasts rank 0's experts over the
// others' (each rank holds other rows).
TEST(ExpertParallel, AdamStepsUnderDdpWithExpertsIgnoredEqualOneProcess) {
  EptNet ref(std::nullopt), net{Group()};
  DistributedDataParallel<EptNetImpl> ddp(net.ptr(), DDPOptions().ignored_params(ept_experts(net)));
  size_t bucketed = 0;
  for (const auto& b : ddp.bucket_param_indices()) bucketed += b.size();
  EXPECT_EQ(bucketed, net->parameters().size() - 3) << "the experts are in no bucket";
  ept_train_like_one_process(
      ref, net, [&](const at::Tensor& x) { return ddp(x); }, /*dp=*/1, [] {});
}

// A 2-D mesh {dp, ep} (4 ranks: 2 x 2; 2 ranks: 2 x 1): experts cut over ep and replicated over dp,
// DDP over the world for the rest. The experts' gradient after backward is the sum over the ep
// group's losses divided by the ep size (expert_grad_divisor's default); the average over dp makes
// it the mean over all ranks' losses, as DDP's for the router.
TEST(ExpertParallel, DpByEpMeshEqualsOneProcess) {
  const int64_t dp = 2;
  DeviceMesh mesh = init_device_mesh({dp, world_size() / dp}, {"dp", "ep"});
  const Group dp_group = mesh.get_group("dp");
  EptNet ref(std::nullopt), net(mesh.get_group("ep"));
  DistributedDataParallel<EptNetImpl> ddp(net.ptr(), DDPOptions().ignored_params(ept_experts(net)));
  ept_train_like_one_process(
      ref, net, [&](const at::Tensor& x) { return ddp(x); }, dp, [&] { ept_average_experts(net, dp_group); });
}

// The same mesh with fully_shard over the world in place of DDP (the experts ignored): FSDP2's
// composition in torchtitan.
TEST(ExpertParallel, DpByEpMeshUnderFullyShardEqualsOneProcess) {
  const int64_t dp = 2;
  DeviceMesh mesh = init_device_mesh({dp, world_size() / dp}, {"dp", "ep"});
  const Group dp_group = mesh.get_group("dp");
  EptNet ref(std::nullopt), net(mesh.get_group("ep"));
  auto fsdp = fully_shard(net.ptr(), FullyShardOptions().ignored_params(ept_experts(net)));
  ASSERT_TRUE(shard_spec_of(net->inp->weight).has_value()) << "fully_shard shards the rest over the world";
  ept_train_like_one_process(
      ref, net, [&](const at::Tensor& x) { return fsdp(x); }, dp, [&] { ept_average_experts(net, dp_group); });
}

// Saved on dp x ep: each expert chunk once (the two dp replicas hold the same rows, and one of
// them writes them), loaded on ep = world and ep = 1.
TEST(ExpertParallel, DcpCheckpointOnDpByEpMeshLoadsOnOtherEpSizes) {
  const std::string dir = "/tmp/dtrain_ep_dpep_dcp_" + std::to_string(getppid());
  if (rank() == 0) fs::remove_all(dir);
  barrier();
  const int64_t dp = 2, ep = world_size() / dp;
  DeviceMesh mesh = init_device_mesh({dp, ep}, {"dp", "ep"});
  EptNet saved(mesh.get_group("ep")), whole(std::nullopt);
  auto sd = dcp::get_state_dict(*saved);
  dcp::save(sd, dir);
  if (rank() == 0) ept_expect_stored_once(dir, ep);
  EptNet all{Group()}, one(std::nullopt);
  ept_expect_loads(all, whole, dir, "ep world");
  ept_expect_loads(one, whole, dir, "ep 1");
  barrier();
  if (rank() == 0) fs::remove_all(dir);
}

TEST(ExpertParallel, BadInputIsRefusedInOneLine) {
  const Group world;
  const int64_t n = world_size();
  EXPECT_THAT([&] { MoE(MoEOptions(kDim, kHidden, n + 1).ep_group(world)); },
              ThrowsDtrainError(::testing::HasSubstr("is not divisible by the ep group's size")));
  EXPECT_THAT([&] { MoE(MoEOptions(kDim, kHidden, 4).top_k(5)); },
              ThrowsDtrainError(::testing::HasSubstr("give 1 <= top_k <= num_experts")));
  EXPECT_THAT([&] { MoE(MoEOptions(kDim, kHidden, 4).capacity_factor(0.0)); },
              ThrowsDtrainError(::testing::HasSubstr("capacity_factor 0 is not positive")));
  EptNet net(world);
  EXPECT_THAT(
      [&] { DistributedDataParallel<EptNetImpl>(net.ptr(), DDPOptions().ignored_params({net->moe->w1.clone()})); },
      ThrowsDtrainError(
          ::testing::HasSubstr("DistributedDataParallel: ignored_params[0] (shape [" + std::to_string(8 / n) +
                               ", 8, 12]) is not a parameter of the module: pass the module's own parameter tensors")));
  MoE m(MoEOptions(kDim, kHidden, 4));
  EXPECT_THAT([&] { m(at::zeros({2, kDim + 1})); }, ThrowsDtrainError(::testing::HasSubstr("MoE: input of shape")));
}

DTRAIN_DIST_TEST_MAIN()
