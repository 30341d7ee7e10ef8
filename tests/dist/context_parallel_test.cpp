// Context parallelism against one process in float64: ring and Ulysses attention, causal and not,
// their outputs and q/k/v gradients within 1e-10 of attention over the whole sequence; the head-tail
// layout (shard, unshard, positions) and the causal blocks each rank computes, the same number on
// every rank; bad input refused in one line; and the Llama-style decoder with its attention context
// parallel, under fully_shard and activation checkpointing, training 10 AdamW steps like one process.
#include <gmock/gmock.h>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/autograd.h>

#include <algorithm>
#include <limits>
#include <map>
#include <set>
#include <string>
#include <utility>

#include "dist_main.h"
#include "dtrain/context_parallel.h"
#include "dtrain/fsdp.h"
#include "dtrain/functional_collectives.h"
#include "dtrain/shard_spec.h"
#include "llama_train_compare.h"
#include "llm/llama.h"
#include "matchers.h"

using namespace dtrain;

namespace {

constexpr int64_t kB = 2, kH = 4, kS = 16, kD = 8;

double cpt_max_diff(const at::Tensor& a, const at::Tensor& b) { return (a - b).abs().max().item<double>(); }

// Attention over the whole sequence, written out (what both context-parallel kinds must equal).
at::Tensor cpt_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal, double scale) {
  at::Tensor s = at::matmul(q, k.transpose(-2, -1)) * scale;
  if (causal) {
    at::Tensor future = at::ones({q.size(2), k.size(2)}, q.options().dtype(at::kBool)).triu(1);
    s = s.masked_fill(future, -std::numeric_limits<double>::infinity());
  }
  return at::matmul(at::softmax(s, -1), v);
}

at::Tensor cpt_random(std::vector<int64_t> shape, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  return at::randn(shape, gen, at::TensorOptions(at::kDouble)).requires_grad_(true);
}

enum class CptKind { kRing, kUlysses };

// Output and gradients of q, k, v (for a random weighting of the output) through `kind` over the
// world, each rank its head-tail part, against one process on the whole sequence.
void expect_attention_like_one_process(CptKind kind, bool causal, std::optional<double> scale = std::nullopt) {
  SCOPED_TRACE(std::string(kind == CptKind::kRing ? "ring" : "ulysses") + (causal ? ", causal" : ", not causal"));
  const Group world;
  const at::Tensor q = cpt_random({kB, kH, kS, kD}, 1), k = cpt_random({kB, kH, kS, kD}, 2),
                   v = cpt_random({kB, kH, kS, kD}, 3);
  const at::Tensor w = cpt_random({kB, kH, kS, kD}, 4).detach();
  const double s = scale ? *scale : 1.0 / std::sqrt(static_cast<double>(kD));
  at::Tensor ref = cpt_attention(q, k, v, causal, s);
  auto ref_grads = torch::autograd::grad({(ref * w).sum()}, {q, k, v});

  at::Tensor ql = context_parallel_shard(q, 2, world), kl = context_parallel_shard(k, 2, world),
             vl = context_parallel_shard(v, 2, world);
  ASSERT_EQ(ql.size(2), kS / world_size());
  at::Tensor out = kind == CptKind::kRing ? ring_attention(ql, kl, vl, world, causal, scale)
                                          : ulysses_attention(ql, kl, vl, world, causal, scale);
  ASSERT_EQ(out.sizes(), ql.sizes());
  EXPECT_LT(cpt_max_diff(context_parallel_unshard(out.detach(), 2, world), ref), 1e-10) << "output";
  // Each rank's gradients reach the whole tensors' rows it holds; their sum over ranks is the whole.
  auto grads = torch::autograd::grad({(out * context_parallel_shard(w, 2, world)).sum()}, {q, k, v});
  const char* names[] = {"dq", "dk", "dv"};
  for (size_t i = 0; i < 3; ++i) {
    at::Tensor g = grads[i].clone();
    all_reduce(g);
    EXPECT_LT(cpt_max_diff(g, ref_grads[i]), 1e-10) << names[i];
  }
}

}  // namespace

TEST(ContextParallel, RingAttentionEqualsOneProcess) {
  for (bool causal : {false, true}) expect_attention_like_one_process(CptKind::kRing, causal);
  expect_attention_like_one_process(CptKind::kRing, true, 0.3);
}

TEST(ContextParallel, UlyssesAttentionEqualsOneProcess) {
  for (bool causal : {false, true}) expect_attention_like_one_process(CptKind::kUlysses, causal);
  expect_attention_like_one_process(CptKind::kUlysses, true, 0.3);
}

TEST(ContextParallel, ShardUnshardAndPositionsAreHeadTail) {
  const Group world;
  const int64_t n = world_size(), r = rank(), c = kS / (2 * n);
  at::Tensor seq = at::arange(kS, at::kLong).unsqueeze(0).expand({2, kS}).contiguous();  // [B, S]
  at::Tensor mine = context_parallel_shard(seq, 1, world);
  std::vector<int64_t> want;
  for (int64_t i = 0; i < c; ++i) want.push_back(r * c + i);
  for (int64_t i = 0; i < c; ++i) want.push_back((2 * n - 1 - r) * c + i);
  EXPECT_EQ(context_parallel_positions(kS, n, r), want);
  EXPECT_TRUE(mine.equal(at::tensor(want, at::kLong).unsqueeze(0).expand({2, 2 * c})));
  EXPECT_TRUE(context_parallel_unshard(mine.to(at::kDouble), 1, world).equal(seq.to(at::kDouble)));
}

// The load balance itself: under the causal mask every rank computes 2 cp + 1 chunk blocks (two of
// them diagonal), and over all ranks the blocks are the chunk grid's lower triangle, each once.
TEST(ContextParallel, CausalBlocksAreBalancedAcrossRanks) {
  for (int64_t n = 1; n <= 8; ++n) {
    std::set<std::pair<int64_t, int64_t>> seen;
    for (int64_t r = 0; r < n; ++r) {
      const auto blocks = ring_attention_blocks(n, r, /*is_causal=*/true);
      EXPECT_EQ(static_cast<int64_t>(blocks.size()), 2 * n + 1) << "cp " << n << ", rank " << r;
      const auto pos = context_parallel_positions(2 * n, n, r);  // chunk length 1: positions are chunks
      for (const RingBlock& b : blocks) {
        const int64_t src = ((r - b.step) % n + n) % n;
        const int64_t qs = pos[static_cast<size_t>(b.q_chunk)];
        const int64_t ks = context_parallel_positions(2 * n, n, src)[static_cast<size_t>(b.kv_chunk)];
        EXPECT_LE(ks, qs);
        EXPECT_EQ(b.mask == BlockMask::kCausal, ks == qs);
        EXPECT_TRUE(seen.insert({qs, ks}).second) << "block (" << qs << ", " << ks << ") twice";
      }
    }
    EXPECT_EQ(static_cast<int64_t>(seen.size()), n * (2 * n + 1));
    EXPECT_EQ(static_cast<int64_t>(ring_attention_blocks(n, 0, false).size()), n);
  }
  // The job's own ranks agree: each computes as many blocks.
  const int64_t mine = static_cast<int64_t>(ring_attention_blocks(world_size(), rank(), true).size());
  for (const auto& theirs : all_gather_values(std::vector<int64_t>{mine})) EXPECT_EQ(theirs[0], mine);
}

TEST(ContextParallel, BadInputIsRefusedInOneLine) {
  const Group world;
  const int64_t n = world_size();
  at::Tensor odd_heads = at::zeros({1, n + 1, 2, kD}, at::kDouble);
  EXPECT_THAT([&] { ulysses_attention(odd_heads, odd_heads, odd_heads, world, true); },
              ThrowsDtrainError(::testing::HasSubstr("heads do not divide by the cp group's size")));
  EXPECT_THAT(
      [&] {
        context_parallel_shard(at::zeros({1, 2 * n + 2}), 1, world);
      },
      ThrowsDtrainError(::testing::HasSubstr("is not divisible by 2 * cp")));
  at::Tensor q = at::zeros({1, 2, 3, kD}, at::kDouble);
  EXPECT_THAT([&] { ring_attention(q, q, q, world, /*is_causal=*/true); },
              ThrowsDtrainError(::testing::HasSubstr("give both the same even length")));
}

namespace {

// The decoder with context-parallel attention over the world (each rank its head-tail part of every
// sequence, parameters fully_shard-ed over the same ranks, every block checkpointed or not) against
// one process on whole sequences: every step's loss, averaged over ranks, and the parameters after.
void expect_cp_llama_trains_like_one_process(llama::CpAttention kind, bool checkpointed) {
  const std::string what =
      std::string(kind == llama::CpAttention::kRing ? "ring" : "ulysses") + (checkpointed ? ", checkpointed" : "");
  const Group world;
  llama::Transformer model = llm_make_model();
  llama::apply_context_parallel(*model, world, kind);
  llama::apply_activation_checkpoint(
      *model, checkpointed ? llama::ActivationCheckpoint::full() : llama::ActivationCheckpoint::none());
  auto fsdp = llama::apply_fully_shard(model);
  // Equal parts: the mean of the ranks' mean losses (fully_shard's averaged gradients) is the whole's.
  expect_llm_trains_like_one_process(
      model, [&](const at::Tensor& t) { return fsdp(t); },
      [&](const at::Tensor& tokens, const at::Tensor& targets) {
        return std::make_pair(context_parallel_shard(tokens, 1, world), context_parallel_shard(targets, 1, world));
      },
      what,
      [&](int64_t step, const at::Tensor& loss, double ref_loss) {
        at::Tensor whole = functional::all_reduce(loss, ReduceOp::AVG, world);
        EXPECT_LT(std::abs(whole.item<double>() - ref_loss), 1e-10) << what << ", step " << step;
      });
}

}  // namespace

TEST(ContextParallelLlama, RingUnderFullyShardTrainsLikeOneProcess) {
  expect_cp_llama_trains_like_one_process(llama::CpAttention::kRing, false);
}

TEST(ContextParallelLlama, RingCheckpointedTrainsLikeOneProcess) {
  expect_cp_llama_trains_like_one_process(llama::CpAttention::kRing, true);
}

TEST(ContextParallelLlama, UlyssesCheckpointedTrainsLikeOneProcess) {
  expect_cp_llama_trains_like_one_process(llama::CpAttention::kUlysses, true);
}

DTRAIN_DIST_TEST_MAIN()
