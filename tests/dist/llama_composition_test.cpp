// The Llama-style decoder (examples/llm/llama.h) under every data and model parallelism, composed as
// the LLM recipe composes them, in float64 against one process training the whole batch: 10 AdamW
// steps on fixed random token batches, then every parameter put together whole within 1e-10
// relative, for DDP, fully_shard and tensor parallelism over the world (each also with every block
// checkpointed), fully_shard over tensor parallelism on a {dp, tp} mesh, and HSDP on a
// {replicate, shard} mesh, pipeline parallelism (2 stages by blocks, 1F1B) alone, over tensor
// parallelism and over fully_shard, each stage cut as the recipe cuts it (each also checkpointed),
// a DCP checkpoint of fully_shard over tensor parallelism resumed under fully_shard alone,
// with clip_grad_norm_'s total over the stages; clip_grad_norm_ under each sharding against torch's
// on the whole model.
// The model itself: torchtitan's parameter names and counts, rotary embeddings as Llama's complex
// multiplication, the attention kernel against the arithmetic written out, causality, and which
// blocks each activation-checkpoint mode checkpoints.
#include <gmock/gmock.h>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/function.h>
#include <torch/nn/utils/clip_grad.h>
#include <torch/optim/adamw.h>

#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <functional>
#include <limits>
#include <map>
#include <string>
#include <utility>

#include "dist_main.h"
#include "dtrain/dcp.h"
#include "dtrain/ddp.h"
#include "dtrain/device_mesh.h"
#include "dtrain/fsdp.h"
#include "dtrain/pipeline.h"
#include "dtrain/shard_spec.h"
#include "llama_train_compare.h"
#include "llm/llama.h"
#include "matchers.h"

using namespace dtrain;

namespace {

// Each rank on its data-parallel part (dp_rank of dp_size) of every batch.
void expect_steps_like_one_process(llama::Transformer model, const LlmStep& step, int64_t dp_rank, int64_t dp_size,
                                   const std::string& what, const std::optional<Group>& pp_group = std::nullopt) {
  expect_llm_steps_like_one_process(
      std::move(model), step,
      [&](const at::Tensor& tokens, const at::Tensor& targets) {
        return std::make_pair(tokens.chunk(dp_size)[dp_rank], targets.chunk(dp_size)[dp_rank]);
      },
      what, pp_group);
}

void expect_trains_like_one_process(llama::Transformer model, const LlmForward& forward, int64_t dp_rank,
                                    int64_t dp_size, const std::string& what) {
  expect_steps_like_one_process(
      model,
      [&](const at::Tensor& tokens, const at::Tensor& targets, double, double) {
        model->loss(forward(tokens), targets).backward();
      },
      dp_rank, dp_size, what);
}

llama::ActivationCheckpoint llm_ac(bool checkpointed) {
  return checkpointed ? llama::ActivationCheckpoint::full() : llama::ActivationCheckpoint::none();
}

void expect_ddp_trains_like_one_process(bool checkpointed) {
  llama::Transformer model = llm_make_model();
  llama::apply_activation_checkpoint(*model, llm_ac(checkpointed));
  DistributedDataParallel ddp(model);
  expect_trains_like_one_process(
      model, [&](const at::Tensor& t) { return ddp(t); }, rank(), world_size(), "DDP");
}

void expect_fully_shard_trains_like_one_process(bool checkpointed) {
  llama::Transformer model = llm_make_model();
  llama::apply_activation_checkpoint(*model, llm_ac(checkpointed));
  auto fsdp = llama::apply_fully_shard(model);
  expect_trains_like_one_process(
      model, [&](const at::Tensor& t) { return fsdp(t); }, rank(), world_size(), "fully_shard");
}

void expect_tensor_parallel_trains_like_one_process(bool checkpointed) {
  llama::Transformer model = llm_make_model();
  llama::apply_tensor_parallel(*model, init_device_mesh({world_size()}, {"tp"}));
  llama::apply_activation_checkpoint(*model, llm_ac(checkpointed));
  // This rank's heads, MLP columns and vocabulary rows.
  EXPECT_EQ(model->block(0).attention->wq->weight.size(0), 32 / world_size());
  EXPECT_EQ(model->output->weight.size(0), 64 / world_size());
  expect_trains_like_one_process(
      model, [&](const at::Tensor& t) { return model(t); }, 0, 1, "tensor parallel");
}

// Pipeline parallelism as the recipe applies it, on a {pp 2, inner} mesh: every rank builds the
// whole model and keeps its stage (blocks, the embedding on the first, norm and head on the last),
// cut over `inner` ("tp": tensor parallel; "dp": fully_shard; "rest": nothing, world / 2 pipelines
// side by side on the same batch), then trains through a 1F1B Pipeline of 2 micro-batches. The loss
// every stage reports and clip_grad_norm_'s total over the stages equal the one process's.
void expect_pipeline_trains_like_one_process(const std::string& inner, bool checkpointed) {
  DeviceMesh mesh = init_device_mesh({2, world_size() / 2}, {"pp", inner});
  const int64_t mine = mesh.get_local_rank("pp");
  llama::Transformer whole = llm_make_model(), model{nullptr};
  std::vector<torch::nn::Sequential> stages;
  for (int64_t s = 0; s < 2; ++s) {
    llama::Transformer stage = llama::pipeline_stage(*whole, s, 2);
    if (s == mine) model = stage;
    stages.push_back(llama::pipeline_stage_module(stage));
  }
  EXPECT_EQ(model->has_embedding(), mine == 0);
  EXPECT_EQ(model->has_output(), mine == 1);
  if (inner == "tp") llama::apply_tensor_parallel(*model, mesh["tp"]);
  llama::apply_activation_checkpoint(*model, llm_ac(checkpointed));
  std::optional<FSDPModule<llama::TransformerImpl>> fsdp;
  if (inner == "dp") fsdp.emplace(llama::apply_fully_shard(model, FullyShardOptions().mesh(mesh["dp"])));
  Pipeline pipe(stages, PipelineOptions().mesh(mesh["pp"]).schedule(Schedule::k1F1B).chunks(2));
  const Group pp_group = mesh.get_group("pp");
  const int64_t dp_rank = inner == "dp" ? mesh.get_local_rank("dp") : 0, dp_size = inner == "dp" ? mesh.size("dp") : 1;
  expect_steps_like_one_process(
      model,
      [&](const at::Tensor& tokens, const at::Tensor& targets, double ref_loss, double ref_norm) {
        const double loss =
            pipe.step(tokens, targets, [&](const at::Tensor& out, const at::Tensor& t) { return model->loss(out, t); })
                .loss;
        if (dp_size == 1) {
          EXPECT_NEAR(loss, ref_loss, 1e-10 * ref_loss) << "stage " << mine << "'s loss";
        }
        const double norm =
            clip_grad_norm_(model->parameters(), std::numeric_limits<double>::infinity(), 2.0, std::nullopt, pp_group);
        EXPECT_NEAR(norm, ref_norm, 1e-10 * ref_norm) << "the gradient norm over both stages";
      },
      dp_rank, dp_size, "pipeline x " + inner, pp_group);
}

// The part of `whole` this rank holds of a parameter cut as `spec` (whole without one).
at::Tensor llm_my_part(const at::Tensor& whole, const std::optional<ShardSpec>& spec) {
  if (!spec) return whole;
  at::Tensor part = whole.dim() == 0 ? whole.reshape({1}) : whole;
  for (int64_t d = 0; d < part.dim(); ++d) part = part.narrow(d, spec->offsets()[d], spec->local_sizes()[d]);
  return part;
}

// clip_grad_norm_ over `model`'s cut gradients against torch::nn::utils::clip_grad_norm_ on one
// process's whole model, after one backward of the same batch (each rank its dp_rank part), for the
// 2-norm and the infinite norm: the total norm, and every rank's part of every clipped gradient.
void expect_clips_like_one_process(llama::Transformer model, const LlmForward& forward, int64_t dp_rank,
                                   int64_t dp_size, const std::string& what) {
  llama::Transformer ref = llm_make_model();
  auto [tokens, targets] = llm_batch(0);
  for (double norm_type : {2.0, std::numeric_limits<double>::infinity()}) {
    SCOPED_TRACE(what + ", norm_type " + std::to_string(norm_type));
    ref->zero_grad();
    ref->loss(ref(tokens), targets).backward();
    const double max_norm = 0.01;  // below either norm: every gradient is scaled
    const double expected = torch::nn::utils::clip_grad_norm_(ref->parameters(), max_norm, norm_type);
    ASSERT_GT(expected, 10 * max_norm);
    model->zero_grad();
    model->loss(forward(tokens.chunk(dp_size)[dp_rank]), targets.chunk(dp_size)[dp_rank]).backward();
    const double got = clip_grad_norm_(model->parameters(), max_norm, norm_type);
    EXPECT_LT(std::abs(got - expected), 1e-10 * expected) << "total norm " << got << ", one process's " << expected;
    auto whole = ref->named_parameters();
    for (const auto& kv : model->named_parameters()) {
      const at::Tensor want = llm_my_part(whole[kv.key()].grad(), shard_spec_of(kv.value()));
      ASSERT_EQ(kv.value().grad().sizes(), want.sizes()) << kv.key();
      EXPECT_LT(llm_rel_diff(kv.value().grad(), want), 1e-10) << kv.key() << "'s clipped gradient";
    }
  }
}

}  // namespace

TEST(LlamaModel, ParameterNamesAndCountsAreTorchtitans) {
  llama::Transformer model(llama::ModelArgs::debug());
  std::vector<std::string> names;
  int64_t count = 0;
  for (const auto& p : model->named_parameters()) {
    if (p.key().rfind("layers.", 0) != 0 || p.key().rfind("layers.0.", 0) == 0) names.push_back(p.key());
    count += p.value().numel();
  }
  EXPECT_THAT(
      names, ::testing::UnorderedElementsAre(
                 "tok_embeddings.weight", "layers.0.attention.wq.weight", "layers.0.attention.wk.weight",
                 "layers.0.attention.wv.weight", "layers.0.attention.wo.weight", "layers.0.feed_forward.w1.weight",
                 "layers.0.feed_forward.w2.weight", "layers.0.feed_forward.w3.weight", "layers.0.attention_norm.weight",
                 "layers.0.ffn_norm.weight", "norm.weight", "output.weight"));
  EXPECT_EQ(count, llama::ModelArgs::debug().num_params());
  EXPECT_EQ(count, 1115264);
  EXPECT_EQ(llama::ffn_hidden_for(4096, 1024, 1.3), 14336) << "Llama 3 8B's MLP";
  int64_t small = 0;
  for (const auto& p : llm_make_model()->parameters()) small += p.numel();
  EXPECT_EQ(small, llm_test_args().num_params());
  EXPECT_THAT(
      [] {
        llama::Transformer bad(llama::ModelArgs{64, 30, 1, 4});
      },
      ThrowsDtrainError(::testing::HasSubstr("dim 30 over n_heads 4 gives no even head size")));
}

// Llama's definition: x's adjacent pairs as complex numbers times freqs_cis[t] = e^(i t theta^(-2j/d)).
TEST(LlamaModel, RotaryIsLlamasComplexMultiplication) {
  const int64_t hd = 8, seq = 5, offset = 3;
  const double theta = 10000.0;
  llama::RotaryTable table = llama::precompute_rotary(hd, 16, theta);
  at::Tensor x = at::randn({2, seq, 3, hd}, at::kDouble);
  at::Tensor freqs = at::pow(theta, at::arange(0, hd, 2, at::kDouble) / hd).reciprocal();
  at::Tensor angles = at::outer(at::arange(offset, offset + seq, at::kDouble), freqs);
  at::Tensor cis = at::polar(at::ones_like(angles), angles).view({1, seq, 1, hd / 2});
  at::Tensor expected = at::view_as_real(at::view_as_complex(x.reshape({2, seq, 3, hd / 2, 2})) * cis).flatten(3);
  EXPECT_LT(llm_rel_diff(llama::apply_rotary(x, table, offset), expected), 1e-14);
  // Attention sees relative positions only: one offset for q and k alike leaves every score as it
  // was (so a rank that shifted both would go unnoticed; a shift of one of them changes the scores).
  at::Tensor y = at::randn_like(x);
  auto scores = [&](int64_t q_offset, int64_t k_offset) {
    at::Tensor q = llama::apply_rotary(x, table, q_offset).transpose(1, 2);
    return q.matmul(llama::apply_rotary(y, table, k_offset).transpose(1, 2).transpose(-2, -1));
  };
  EXPECT_LT(llm_rel_diff(scores(offset, offset), scores(0, 0)), 1e-12);
  EXPECT_GT(llm_rel_diff(scores(1, 0), scores(0, 0)), 1e-3);
  EXPECT_THAT([&] { llama::apply_rotary(x, table, 12); },
              ThrowsDtrainError(::testing::HasSubstr("positions 12 to 16 pass max_seq_len 16")));
}

// The kernel (scaled_dot_product_attention on LibTorch 2.x) and the written-out arithmetic agree, and
// no position sees a later one.
TEST(LlamaModel, AttentionIsCausalAndMatchesTheWrittenOutArithmetic) {
  at::Tensor q = at::randn({2, 3, 7, 4}, at::kDouble), k = at::randn_like(q), v = at::randn_like(q);
  EXPECT_LT(llm_rel_diff(llama::causal_attention(q, k, v), llama::causal_attention_reference(q, k, v)), 1e-13);
  llama::Transformer model = llm_make_model();
  at::Tensor tokens = llm_batch(0).first, changed = tokens.clone();
  changed.select(1, kLlmSeq - 1).add_(1).remainder_(llm_test_args().vocab_size);
  at::NoGradGuard no_grad;
  at::Tensor a = model(tokens), b = model(changed);
  EXPECT_TRUE(a.narrow(1, 0, kLlmSeq - 1).equal(b.narrow(1, 0, kLlmSeq - 1))) << "earlier positions unchanged";
  EXPECT_FALSE(a.select(1, kLlmSeq - 1).equal(b.select(1, kLlmSeq - 1)));
}

// torchtitan's split: n_layers / stages blocks each, the first n_layers % stages stages one more.
TEST(LlamaModel, PipelineStagesSplitByBlocks) {
  using Range = std::pair<int64_t, int64_t>;
  EXPECT_EQ(llama::pipeline_stage_layers(4, 0, 2), Range(0, 2));
  EXPECT_EQ(llama::pipeline_stage_layers(4, 1, 2), Range(2, 4));
  EXPECT_EQ(llama::pipeline_stage_layers(5, 0, 3), Range(0, 2));
  EXPECT_EQ(llama::pipeline_stage_layers(5, 1, 3), Range(2, 4));
  EXPECT_EQ(llama::pipeline_stage_layers(5, 2, 3), Range(4, 5));
  EXPECT_THAT([] { llama::pipeline_stage_layers(2, 0, 3); },
              ThrowsDtrainError(::testing::HasSubstr("every stage needs a block")));
  llama::ModelArgs args = llm_test_args();
  args.n_layers = 3;
  llama::Transformer whole(args);
  std::vector<std::string> names;
  for (const auto& p : llama::pipeline_stage(*whole, 1, 2)->named_parameters())
    if (p.key().find("norm") == std::string::npos) names.push_back(p.key());
  EXPECT_THAT(names, ::testing::ElementsAre("layers.2.attention.wq.weight", "layers.2.attention.wk.weight",
                                            "layers.2.attention.wv.weight", "layers.2.attention.wo.weight",
                                            "layers.2.feed_forward.w1.weight", "layers.2.feed_forward.w2.weight",
                                            "layers.2.feed_forward.w3.weight", "output.weight"))
      << "the last stage: its block under its whole-model name, and the head";
  EXPECT_TRUE(llama::pipeline_stage(*whole, 0, 2)->has_embedding());
}

TEST(LlamaModel, ActivationCheckpointModesPickTheirBlocks) {
  llama::ModelArgs args = llm_test_args();
  args.n_layers = 4;
  llama::Transformer model(args);
  auto picked = [&] {
    std::vector<bool> on;
    for (size_t i = 0; i < model->num_blocks(); ++i) on.push_back(model->block(i).checkpointed());
    return on;
  };
  llama::apply_activation_checkpoint(*model, llama::ActivationCheckpoint::every_k(2));
  EXPECT_EQ(picked(), (std::vector<bool>{false, true, false, true})) << "torchtitan's blocks k-1, 2k-1";
  // A checkpointed block's output comes from the checkpoint's autograd node.
  at::Tensor x = at::randn({1, 4, args.dim}).requires_grad_(true);
  EXPECT_THAT(model->block(1).forward(x).grad_fn()->name(), ::testing::HasSubstr("CheckpointNode"));
  EXPECT_THAT(model->block(0).forward(x).grad_fn()->name(), ::testing::Not(::testing::HasSubstr("CheckpointNode")));
  llama::apply_activation_checkpoint(*model, llama::ActivationCheckpoint::full());
  EXPECT_EQ(picked(), (std::vector<bool>(4, true)));
  llama::apply_activation_checkpoint(*model, llama::ActivationCheckpoint::none());
  EXPECT_EQ(picked(), (std::vector<bool>(4, false)));
}

TEST(LlamaComposition, DDPEqualsOneProcess) { expect_ddp_trains_like_one_process(false); }
TEST(LlamaComposition, FullyShardEqualsOneProcess) { expect_fully_shard_trains_like_one_process(false); }
TEST(LlamaComposition, TensorParallelEqualsOneProcess) { expect_tensor_parallel_trains_like_one_process(false); }
TEST(LlamaComposition, CheckpointedDDPEqualsOneProcess) { expect_ddp_trains_like_one_process(true); }
TEST(LlamaComposition, CheckpointedFullyShardEqualsOneProcess) { expect_fully_shard_trains_like_one_process(true); }
TEST(LlamaComposition, CheckpointedTensorParallelEqualsOneProcess) {
  expect_tensor_parallel_trains_like_one_process(true);
}

// torchtitan's 2-D layout: tensor parallelism inside each dp row, fully_shard across the rows.
TEST(LlamaComposition, FullyShardOverTensorParallelEqualsOneProcess) {
  DeviceMesh mesh = init_device_mesh({world_size() / 2, 2}, {"dp", "tp"});
  llama::Transformer model = llm_make_model();
  llama::apply_tensor_parallel(*model, mesh["tp"]);
  auto fsdp = llama::apply_fully_shard(model, FullyShardOptions().mesh(mesh["dp"]));
  expect_trains_like_one_process(
      model, [&](const at::Tensor& t) { return fsdp(t); }, mesh.get_local_rank("dp"), mesh.size("dp"),
      "fully_shard x tensor parallel");
}

// A run resumed onto another layout: 5 AdamW steps under fully_shard over tensor parallelism ({dp
// world / 2, tp 2}), saved with dcp::save (the parameters and AdamW's state, each rank its box), loaded
// by dcp::load into a model of other initial weights fully_shard over the whole world (every tensor
// cut otherwise), and 5 more steps there: every parameter as one process's 10 steps, within 1e-10.
TEST(LlamaComposition, DcpOfFullyShardOverTensorParallelResumesUnderFullyShard) {
  const std::string dir = "/tmp/dtrain_llama_resume_" + std::to_string(getppid());
  if (rank() == 0) std::filesystem::remove_all(dir);
  barrier();
  auto adamw = [](std::vector<at::Tensor> params) {
    return torch::optim::AdamW(std::move(params), torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
  };
  llama::Transformer ref = llm_make_model();
  torch::optim::AdamW ref_opt = adamw(ref->parameters());
  DeviceMesh mesh = init_device_mesh({world_size() / 2, 2}, {"dp", "tp"});
  llama::Transformer before = llm_make_model();
  llama::apply_tensor_parallel(*before, mesh["tp"]);
  auto before_fsdp = llama::apply_fully_shard(before, FullyShardOptions().mesh(mesh["dp"]));
  torch::optim::AdamW before_opt = adamw(before->parameters());
  torch::manual_seed(7);  // other weights and no AdamW state until the load
  llama::Transformer after(llm_test_args());
  after->to(at::kDouble);
  auto after_fsdp = llama::apply_fully_shard(after);
  torch::optim::AdamW after_opt = adamw(after->parameters());
  for (int64_t s = 0; s < 10; ++s) {
    auto [tokens, targets] = llm_batch(s);
    ref_opt.zero_grad();
    ref->loss(ref(tokens), targets).backward();
    ref_opt.step();
    if (s == 5) {
      dcp::save(dcp::get_state_dict(*before, &before_opt), dir);
      dcp::StateDict sd = dcp::get_state_dict(*after, &after_opt);
      dcp::load(sd, dir);
      dcp::set_state_dict(*after, &after_opt, sd);
    }
    const bool resumed = s >= 5;
    auto& fsdp = resumed ? after_fsdp : before_fsdp;
    llama::Transformer& model = resumed ? after : before;
    torch::optim::AdamW& opt = resumed ? after_opt : before_opt;
    const int64_t part = resumed ? rank() : mesh.get_local_rank("dp");
    const int64_t parts = resumed ? world_size() : mesh.size("dp");
    opt.zero_grad();
    model->loss(fsdp(tokens.chunk(parts)[part]), targets.chunk(parts)[part]).backward();
    opt.step();
  }
  auto whole = ref->named_parameters();
  const auto got = full_state_dict(*after);
  ASSERT_EQ(got.size(), whole.size());
  for (const auto& [name, t] : got)
    EXPECT_LT(llm_rel_diff(t, whole[name]), 1e-10) << name << " after 5 steps on {dp, tp} and 5 on fully_shard";
  barrier();
  if (rank() == 0) std::filesystem::remove_all(dir);
}

TEST(LlamaComposition, PipelineEqualsOneProcess) { expect_pipeline_trains_like_one_process("rest", false); }
TEST(LlamaComposition, CheckpointedPipelineEqualsOneProcess) { expect_pipeline_trains_like_one_process("rest", true); }
TEST(LlamaComposition, PipelineOverTensorParallelEqualsOneProcess) {
  if (world_size() != 4) GTEST_SKIP() << "pp 2 x tp 2: 4 ranks";
  expect_pipeline_trains_like_one_process("tp", false);
}
TEST(LlamaComposition, CheckpointedPipelineOverTensorParallelEqualsOneProcess) {
  if (world_size() != 4) GTEST_SKIP() << "pp 2 x tp 2: 4 ranks";
  expect_pipeline_trains_like_one_process("tp", true);
}
TEST(LlamaComposition, PipelineOverFullyShardEqualsOneProcess) {
  if (world_size() != 4) GTEST_SKIP() << "pp 2 x fully_shard 2: 4 ranks";
  expect_pipeline_trains_like_one_process("dp", false);
}
TEST(LlamaComposition, CheckpointedPipelineOverFullyShardEqualsOneProcess) {
  if (world_size() != 4) GTEST_SKIP() << "pp 2 x fully_shard 2: 4 ranks";
  expect_pipeline_trains_like_one_process("dp", true);
}

TEST(LlamaComposition, HsdpEqualsOneProcess) {
  DeviceMesh mesh = init_device_mesh({world_size() / 2, 2}, {"replicate", "shard"});
  llama::Transformer model = llm_make_model();
  auto fsdp = llama::apply_fully_shard(model, FullyShardOptions().mesh(mesh));
  expect_trains_like_one_process(
      model, [&](const at::Tensor& t) { return fsdp(t); }, rank(), world_size(), "HSDP");
}

// clip_grad_norm_ reads each gradient's cuts: the RMSNorm weights, whole across tp and cut over dp
// alone, count once, and so does each shard held by HSDP's replicas.
TEST(LlamaClipGradNorm, FullyShardOverTensorParallelEqualsOneProcess) {
  DeviceMesh mesh = init_device_mesh({world_size() / 2, 2}, {"dp", "tp"});
  llama::Transformer model = llm_make_model();
  llama::apply_tensor_parallel(*model, mesh["tp"]);
  auto fsdp = llama::apply_fully_shard(model, FullyShardOptions().mesh(mesh["dp"]));
  expect_clips_like_one_process(
      model, [&](const at::Tensor& t) { return fsdp(t); }, mesh.get_local_rank("dp"), mesh.size("dp"),
      "fully_shard x tensor parallel");
}

TEST(LlamaClipGradNorm, TensorParallelEqualsOneProcess) {
  llama::Transformer model = llm_make_model();
  llama::apply_tensor_parallel(*model, init_device_mesh({world_size()}, {"tp"}));
  expect_clips_like_one_process(
      model, [&](const at::Tensor& t) { return model(t); }, 0, 1, "tensor parallel");
}

TEST(LlamaClipGradNorm, FullyShardEqualsOneProcess) {
  llama::Transformer model = llm_make_model();
  auto fsdp = llama::apply_fully_shard(model);
  expect_clips_like_one_process(
      model, [&](const at::Tensor& t) { return fsdp(t); }, rank(), world_size(), "fully_shard");
}

TEST(LlamaClipGradNorm, HsdpEqualsOneProcess) {
  DeviceMesh mesh = init_device_mesh({world_size() / 2, 2}, {"replicate", "shard"});
  llama::Transformer model = llm_make_model();
  auto fsdp = llama::apply_fully_shard(model, FullyShardOptions().mesh(mesh));
  expect_clips_like_one_process(
      model, [&](const at::Tensor& t) { return fsdp(t); }, rank(), world_size(), "HSDP");
}

// Tensors without a spec: whole on every rank unless a group is given, then each rank's a part of
// one gradient over it (the form clip_grad_norm_ took before parameters carried specs).
TEST(LlamaClipGradNorm, ParametersWithoutSpecsAreWholeUnlessAGroupIsGiven) {
  at::Tensor full = at::arange(1, 2 * world_size() + 1, at::kDouble);
  auto my_part = [&] {
    at::Tensor p = at::zeros({2}, at::kDouble).requires_grad_(true);
    p.mutable_grad() = full.narrow(0, 2 * rank(), 2).clone();
    return p;
  };
  at::Tensor part = my_part();
  EXPECT_NEAR(clip_grad_norm_({part}, 1e9, 2.0, Group()), full.norm().item<double>(), 1e-12);
  EXPECT_NEAR(clip_grad_norm_({part}, 1e9, std::numeric_limits<double>::infinity(), Group()), 2.0 * world_size(), 0);
  at::Tensor whole = at::zeros({2}, at::kDouble).requires_grad_(true);
  whole.mutable_grad() = at::tensor({3.0, 4.0}, at::kDouble);
  EXPECT_NEAR(clip_grad_norm_({whole}, 1.0), 5.0, 1e-12) << "counted once, not once per rank";
  EXPECT_LT((whole.grad() - at::tensor({0.6, 0.8}, at::kDouble)).abs().max().item<double>(), 1e-6);
}

DTRAIN_DIST_TEST_MAIN()
