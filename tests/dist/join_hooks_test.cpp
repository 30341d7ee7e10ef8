// Join with DDP's other modes, on 3 real ranks with 7, 10 and 4 batches (as tests/dist/join_test.cpp):
// find_unused_parameters with a layer that ranks skip in some iterations, and the PowerSGD
// communication hook. Every rank ends with the same parameters, bit for bit, equal to PyTorch's
// semantics computed here in one process: a joined rank shadows every all-reduce with zeros as its
// gradients; DDP's own average divides by 3 (divide_by_initial_world_size) or by the ranks still
// active, a communication hook as it does itself (PowerSGD: by the group's size, either way); a
// parameter that no active rank used keeps the gradient zero_grad() left it. A joined rank's PowerSGD
// runs on that zero bucket as PyTorch's does: it adds its error memory, which it keeps updating, and
// counts the iterations with the others.
#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>

#include <algorithm>
#include <tuple>

#include "dist_main.h"
#include "dtrain/comm_hooks.h"
#include "dtrain/ddp.h"
#include "dtrain/join.h"

using namespace dtrain;

namespace {

const std::vector<int> kUneven{7, 10, 4};
constexpr int kIterations = 10;

// Weight decay moves a parameter whose gradient is defined, zero or not: a globally unused gradient
// written as zeros instead of left untouched would show.
torch::optim::SGDOptions sgd() { return torch::optim::SGDOptions(0.1).momentum(0.9).weight_decay(0.01); }

// Rank r's batch i: (4, 5) inputs, (4, 3) targets.
std::pair<at::Tensor, at::Tensor> batch(int r, int i) {
  auto g = at::make_generator<at::CPUGeneratorImpl>(2000 * r + i);
  return {at::randn({4, 5}, g, at::kDouble), at::randn({4, 3}, g, at::kDouble)};
}
at::Tensor loss_of(const at::Tensor& out, const at::Tensor& y) { return (out - y).pow(2).mean(); }

std::vector<int> active_at(int i) {
  std::vector<int> a;
  for (int r = 0; r < static_cast<int>(kUneven.size()); ++r)
    if (i < kUneven[r]) a.push_back(r);
  return a;
}

double max_rel_diff(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  double worst = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double scale = std::max(b[i].abs().max().item<double>(), 1e-12);
    worst = std::max(worst, (a[i] - b[i]).abs().max().item<double>() / scale);
  }
  return worst;
}

// Every rank holds the same bits as rank 0.
void expect_same_on_every_rank(const std::vector<at::Tensor>& params, const std::string& what) {
  for (size_t k = 0; k < params.size(); ++k) {
    at::Tensor root = params[k].detach().clone();
    broadcast(root, 0);
    EXPECT_TRUE(root.equal(params[k].detach())) << what << ": parameter " << k << " on rank " << rank();
  }
}

// --- find_unused_parameters under Join ---------------------------------------------------------------

// Head c is used by rank r in iteration i > 0 when (r + i) % 3 == 0. With 7, 10 and 4 batches that
// makes every kind of iteration: c used by no rank before any gradient of it exists (i = 0: its
// .grad() stays undefined, so SGD skips it, weight decay included); used by one active rank and not
// the others, while a rank has joined (i = 5, 6, 8) or not (i = 1 to 3); used by no active rank once
// rank 2 has joined (i = 4) and once only rank 1 is left (i = 7, 9).
bool uses_c(int r, int i) { return i > 0 && (r + i) % 3 == 0; }

struct BranchNetImpl : torch::nn::Module {
  BranchNetImpl() {
    torch::manual_seed(8);
    a = register_module("a", torch::nn::Linear(5, 8));
    b = register_module("b", torch::nn::Linear(8, 3));
    c = register_module("c", torch::nn::Linear(8, 3));
    to(at::kDouble);
  }
  at::Tensor forward(const at::Tensor& x, bool use_c) {
    at::Tensor h = at::tanh(a(x));
    return use_c ? b(h) + c(h) : b(h);
  }
  torch::nn::Linear a{nullptr}, b{nullptr}, c{nullptr};
};
TORCH_MODULE(BranchNet);

// PyTorch's semantics in one process. Each iteration: the active ranks' local gradients (an unused
// parameter's is zero) summed and divided; a parameter used by no active rank keeps what zero_grad()
// left (DDP leaves a globally unused gradient untouched); one SGD step.
std::vector<at::Tensor> unused_reference(bool divide_by_initial_world_size) {
  BranchNet net, scratch;
  torch::optim::SGD opt(net->parameters(), sgd());
  auto params = net->parameters(), local = scratch->parameters();
  for (int i = 0; i < kIterations; ++i) {
    const auto active = active_at(i);
    std::vector<at::Tensor> sum;
    std::vector<bool> used(params.size(), false);
    for (int r : active) {
      {
        at::NoGradGuard ng;
        for (size_t k = 0; k < params.size(); ++k) local[k].copy_(params[k]);
      }
      for (auto& p : local) p.mutable_grad() = at::Tensor();
      auto [x, y] = batch(r, i);
      loss_of(scratch->forward(x, uses_c(r, i)), y).backward();
      for (size_t k = 0; k < local.size(); ++k) {
        const bool u = local[k].grad().defined();
        used[k] = used[k] || u;
        at::Tensor g = u ? local[k].grad().clone() : at::zeros_like(local[k]);
        if (sum.size() <= k)
          sum.push_back(g);
        else
          sum[k] += g;
      }
    }
    const double d = divide_by_initial_world_size ? static_cast<double>(kUneven.size()) : active.size();
    opt.zero_grad();
    for (size_t k = 0; k < params.size(); ++k)
      if (used[k]) params[k].mutable_grad() = sum[k] / d;
    opt.step();
  }
  return net->parameters();
}

std::vector<at::Tensor> train_unused(const JoinOptions& options) {
  BranchNet net;
  DistributedDataParallel ddp(net, DDPOptions().find_unused_parameters(true));
  torch::optim::SGD opt(ddp.parameters(), sgd());
  Join join({&ddp}, options);
  for (int i = 0; i < kUneven[rank()]; ++i) {
    auto [x, y] = batch(rank(), i);
    opt.zero_grad();
    loss_of(ddp(x, uses_c(rank(), i)), y).backward();
    opt.step();
  }
  join.join();
  return net->parameters();
}

// --- PowerSGD under Join -----------------------------------------------------------------------------

struct NetImpl : torch::nn::Module {
  NetImpl() {
    torch::manual_seed(5);
    a = register_module("a", torch::nn::Linear(5, 8));
    b = register_module("b", torch::nn::Linear(8, 3));
    to(at::kDouble);
  }
  at::Tensor forward(const at::Tensor& x) { return b(at::tanh(a(x))); }
  torch::nn::Linear a{nullptr}, b{nullptr};
};
TORCH_MODULE(Net);

constexpr int64_t kStartIter = 2;
// numpy.random.RandomState(0).randint(1_000_000_000): PyTorch's seed of the first random Qs with
// random_seed=0 (with warm start, the only draw of a bucket).
constexpr uint64_t kFirstNumpySeed = 209652396;

PowerSGDOptions powersgd_options() {
  return PowerSGDOptions().matrix_approximation_rank(1).start_powerSGD_iter(kStartIter);
}

// PyTorch's powerSGD_hook (rank 1, warm start, error feedback) on one bucket over every rank in one
// process. flats[r]: rank r's bucket as its hook sees it (zeros for a rank that has joined);
// shapes: the bucket's parameters in its order. Returns the averaged bucket (the same on every rank).
struct RefPowerSGD {
  int world;
  std::vector<std::vector<int64_t>> shapes;
  int64_t iter = 0;
  std::vector<at::Tensor> error;  // per rank
  at::Tensor q;                   // the last step's Qs, flat
  // joined_error: whether a rank that has joined adds its error memory (PyTorch's), or zeros alone.
  bool joined_error = true;

  at::Tensor step(std::vector<at::Tensor> flats, const std::vector<bool>& joined) {
    const int64_t total = flats[0].numel();
    if (iter++ < kStartIter) {
      at::Tensor sum = at::zeros({total}, flats[0].options());
      for (auto& f : flats) sum += f;
      return sum / world;
    }
    if (error.empty()) error.assign(world, at::zeros({total}, flats[0].options()));
    for (int r = 0; r < world; ++r)
      if (joined_error || !joined[r]) flats[r] = flats[r] + error[r];
    at::Tensor result = at::zeros({total}, flats[0].options());
    // The matrices to compress, grouped by shape in first-seen order (each (offset, n, m)); the rest
    // averaged as they are.
    std::vector<std::vector<int64_t>> group_shapes;
    std::vector<std::vector<std::tuple<int64_t, int64_t, int64_t>>> groups;
    int64_t off = 0;
    for (const auto& s : shapes) {
      int64_t numel = 1;
      for (int64_t d : s) numel *= d;
      const int64_t n = s[0], m = numel / n;
      if ((n + m) * 2 < n * m) {  // rank 1, min_compression_rate 2
        auto it = std::find(group_shapes.begin(), group_shapes.end(), std::vector<int64_t>{n, m});
        if (it == group_shapes.end()) {
          group_shapes.push_back({n, m});
          groups.emplace_back();
          it = group_shapes.end() - 1;
        }
        groups[it - group_shapes.begin()].emplace_back(off, n, m);
      } else {
        for (int r = 0; r < world; ++r) result.narrow(0, off, numel) += flats[r].narrow(0, off, numel) / world;
      }
      off += numel;
    }
    auto unit = [](at::Tensor v) { return v / v.norm().item<double>(); };
    std::vector<at::Tensor> new_q;
    auto gen = at::make_generator<at::CPUGeneratorImpl>(kFirstNumpySeed);
    int64_t q_at = 0;
    for (auto& g : groups)
      for (auto& [o, n, m] : g) {
        at::Tensor qj = q.defined() ? q.narrow(0, q_at, m).clone() : at::randn({m}, gen, at::kDouble);
        q_at += m;
        qj = unit(qj);
        at::Tensor p = at::zeros({n}, qj.options());
        for (int r = 0; r < world; ++r) p += at::mv(flats[r].narrow(0, o, n * m).view({n, m}), qj);
        p = unit(p);
        at::Tensor qs = at::zeros({m}, qj.options());
        for (int r = 0; r < world; ++r) qs += at::mv(flats[r].narrow(0, o, n * m).view({n, m}).t(), p);
        qs = qs / world;
        result.narrow(0, o, n * m).copy_(at::outer(p, qs).reshape({-1}));
        new_q.push_back(qs);
      }
    q = at::cat(new_q);
    for (int r = 0; r < world; ++r) error[r] = flats[r] - result;
    return result;
  }
};

// The reference run: every iteration each rank's bucket (its local gradients, zeros once it has
// joined) through RefPowerSGD, one SGD step with the result.
std::vector<at::Tensor> powersgd_reference(const std::vector<std::vector<int>>& buckets, bool joined_error) {
  EXPECT_EQ(buckets.size(), 1u) << "the reference is written for one bucket";
  Net net, scratch;
  torch::optim::SGD opt(net->parameters(), sgd());
  auto params = net->parameters(), local = scratch->parameters();
  RefPowerSGD ref;
  ref.world = static_cast<int>(kUneven.size());
  ref.joined_error = joined_error;
  for (int k : buckets[0]) ref.shapes.push_back(params[k].sizes().vec());
  for (int i = 0; i < kIterations; ++i) {
    std::vector<at::Tensor> flats;
    std::vector<bool> joined;
    for (int r = 0; r < ref.world; ++r) {
      joined.push_back(i >= kUneven[r]);
      std::vector<at::Tensor> parts;
      if (joined.back()) {
        for (int k : buckets[0]) parts.push_back(at::zeros({params[k].numel()}, at::kDouble));
      } else {
        {
          at::NoGradGuard ng;
          for (size_t k = 0; k < params.size(); ++k) local[k].copy_(params[k]);
        }
        for (auto& p : local) p.mutable_grad() = at::Tensor();
        auto [x, y] = batch(r, i);
        loss_of(scratch->forward(x), y).backward();
        for (int k : buckets[0]) parts.push_back(local[k].grad().reshape({-1}));
      }
      flats.push_back(at::cat(parts));
    }
    const at::Tensor avg = ref.step(flats, joined);
    int64_t off = 0;
    for (int k : buckets[0]) {
      params[k].mutable_grad() = avg.narrow(0, off, params[k].numel()).view(params[k].sizes()).clone();
      off += params[k].numel();
    }
    opt.step();
  }
  return net->parameters();
}

struct PowerSGDRun {
  std::vector<at::Tensor> params;
  std::vector<std::vector<int>> buckets;
  int64_t iter = 0;
};

PowerSGDRun train_powersgd(const JoinOptions& options) {
  Net net;
  DistributedDataParallel ddp(net);
  PowerSGDState state(powersgd_options());
  ddp.register_comm_hook(state, powerSGD_hook);
  torch::optim::SGD opt(ddp.parameters(), sgd());
  Join join({&ddp}, options);
  for (int i = 0; i < kUneven[rank()]; ++i) {
    auto [x, y] = batch(rank(), i);
    opt.zero_grad();
    loss_of(ddp(x), y).backward();
    opt.step();
  }
  join.join();
  return {net->parameters(), ddp.bucket_param_indices(), state.iter()};
}

}  // namespace

// ctest runs this program over shared memory and, as dist_join_hooks_test_gloo_3, over Gloo alone.
TEST(JoinHooks, DefaultGroupRunsOverTheTransportThisRunTests) { expect_default_group_transport_from_env(); }

TEST(JoinHooks, FindUnusedParametersUnderJoinEndsWithPyTorchsParameters) {
  ASSERT_EQ(world_size(), 3) << "this test is written for 3 ranks with 7, 10 and 4 batches";
  for (const bool by_initial : {true, false}) {
    const auto got = train_unused(JoinOptions().divide_by_initial_world_size(by_initial));
    expect_same_on_every_rank(got, "find_unused_parameters");
    const auto want = unused_reference(by_initial);
    EXPECT_LE(max_rel_diff(got, want), 1e-10) << "divide_by_initial_world_size=" << by_initial;
    // The divisors give different models, so the comparison tells them apart.
    EXPECT_GT(max_rel_diff(got, unused_reference(!by_initial)), 1e-6);
  }
}

TEST(JoinHooks, PowerSGDUnderJoinEndsWithPyTorchsParameters) {
  ASSERT_EQ(world_size(), 3) << "this test is written for 3 ranks with 7, 10 and 4 batches";
  std::vector<at::Tensor> first;
  for (const bool by_initial : {true, false}) {
    const PowerSGDRun got = train_powersgd(JoinOptions().divide_by_initial_world_size(by_initial));
    expect_same_on_every_rank(got.params, "PowerSGD");
    // A joined rank's hook ran in every iteration it shadowed: every rank counted all 10.
    EXPECT_EQ(got.iter, kIterations) << "rank " << rank();
    const auto want = powersgd_reference(got.buckets, /*joined_error=*/true);
    EXPECT_LE(max_rel_diff(got.params, want), 1e-10) << "divide_by_initial_world_size=" << by_initial;
    // The hook divides by the group's size whatever Join's divisor: both runs are one model.
    if (first.empty())
      first = got.params;
    else
      for (size_t k = 0; k < first.size(); ++k) EXPECT_TRUE(first[k].equal(got.params[k])) << "parameter " << k;
    // Whether a joined rank adds its error memory changes the model: the comparison sees it.
    EXPECT_GT(max_rel_diff(got.params, powersgd_reference(got.buckets, /*joined_error=*/false)), 1e-6);
  }
}

DTRAIN_DIST_TEST_MAIN()
