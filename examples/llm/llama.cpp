#include "llm/llama.h"

#include <ATen/ATen.h>
#include <torch/nn/functional/loss.h>
#include <torch/version.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

#include "dtrain/activation_checkpoint.h"
#include "dtrain/errors.h"

namespace llama {

namespace {

// torch.nn.init.trunc_normal_ (PyTorch's algorithm): a uniform draw between the normal CDF's values
// at a and b, mapped back through the inverse CDF, so every value lands inside [a, b].
void trunc_normal_(at::Tensor& t, double std, double a = -2.0, double b = 2.0) {
  at::NoGradGuard no_grad;
  auto cdf = [](double x) { return (1.0 + std::erf(x / std::sqrt(2.0))) / 2.0; };
  const double l = cdf(a / std), u = cdf(b / std);
  t.uniform_(2 * l - 1, 2 * u - 1).erfinv_().mul_(std * std::sqrt(2.0)).clamp_(a, b);
}

dtrain::ParallelLinear linear(int64_t in, int64_t out) {
  return dtrain::ParallelLinear(torch::nn::LinearOptions(in, out).bias(false));
}

// [B, T, kv_heads, hd] -> [B, T, kv_heads * n_rep, hd], each k/v head serving n_rep query heads.
at::Tensor repeat_kv(const at::Tensor& x, int64_t n_rep) {
  if (n_rep == 1) return x;
  const auto s = x.sizes();
  return x.unsqueeze(3).expand({s[0], s[1], s[2], n_rep, s[3]}).reshape({s[0], s[1], s[2] * n_rep, s[3]});
}

}  // namespace

int64_t ffn_hidden_for(int64_t dim, int64_t multiple_of, std::optional<double> ffn_dim_multiplier) {
  auto hidden = static_cast<int64_t>(2 * (4 * dim) / 3);
  if (ffn_dim_multiplier) hidden = static_cast<int64_t>(*ffn_dim_multiplier * static_cast<double>(hidden));
  return multiple_of * ((hidden + multiple_of - 1) / multiple_of);
}

void ModelArgs::validate() const {
  DTRAIN_CHECK(vocab_size > 0 && dim > 0 && n_layers > 0 && n_heads > 0 && ffn_hidden > 0 && max_seq_len > 0,
               "llama::ModelArgs: vocab_size ", vocab_size, ", dim ", dim, ", n_layers ", n_layers, ", n_heads ",
               n_heads, ", ffn_hidden ", ffn_hidden, ", max_seq_len ", max_seq_len, "; each must be positive");
  DTRAIN_CHECK(dim % n_heads == 0 && head_dim() % 2 == 0, "llama::ModelArgs: dim ", dim, " over n_heads ", n_heads,
               " gives no even head size; pick dim a multiple of 2 * n_heads (rotary embeddings rotate pairs)");
  DTRAIN_CHECK(n_kv_heads >= 0 && n_heads % kv_heads() == 0, "llama::ModelArgs: n_kv_heads ", n_kv_heads,
               " does not divide n_heads ", n_heads, "; pick a divisor of n_heads, or 0 for n_heads");
}

int64_t ModelArgs::num_params() const {
  const int64_t hd = head_dim();
  const int64_t attention = dim * n_heads * hd * 2 + dim * kv_heads() * hd * 2;  // wq, wo; wk, wv
  const int64_t block = attention + 3 * dim * ffn_hidden + 2 * dim;              // w1, w2, w3; two norms
  return 2 * vocab_size * dim + n_layers * block + dim;                          // embedding, output; norm
}

RotaryTable precompute_rotary(int64_t head_dim, int64_t max_seq_len, double theta) {
  // freq_i = theta^(-2i / head_dim), angle(t, i) = t * freq_i: Llama's precompute_freqs_cis, in
  // float64 so that a float64 model rotates without float32's rounding.
  at::Tensor freqs = at::pow(theta, at::arange(0, head_dim, 2, at::kDouble).div(head_dim)).reciprocal();
  at::Tensor angles = at::outer(at::arange(max_seq_len, at::kDouble), freqs);
  return RotaryTable{angles.cos(), angles.sin()};
}

at::Tensor apply_rotary(const at::Tensor& x, const RotaryTable& table, int64_t offset) {
  const int64_t seq = x.size(1), half = x.size(-1) / 2;
  DTRAIN_CHECK(offset >= 0 && offset + seq <= table.cos.size(0), "llama: positions ", offset, " to ", offset + seq - 1,
               " pass max_seq_len ", table.cos.size(0), "; shorten the sequences or raise ModelArgs::max_seq_len");
  at::Tensor cos = table.cos.narrow(0, offset, seq).to(x.options()).view({1, seq, 1, half});
  at::Tensor sin = table.sin.narrow(0, offset, seq).to(x.options()).view({1, seq, 1, half});
  at::Tensor pairs = x.reshape({x.size(0), seq, x.size(2), half, 2});
  at::Tensor re = pairs.select(-1, 0), im = pairs.select(-1, 1);
  // (re + i im) * (cos + i sin)
  return at::stack({re * cos - im * sin, re * sin + im * cos}, -1).flatten(3);
}

at::Tensor causal_attention_reference(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  const int64_t seq = q.size(-2);
  at::Tensor scores = q.matmul(k.transpose(-2, -1)) / std::sqrt(static_cast<double>(q.size(-1)));
  at::Tensor future = at::ones({seq, seq}, q.options().dtype(at::kBool)).triu(1);
  scores = scores.masked_fill(future, -std::numeric_limits<double>::infinity());
  return at::softmax(scores, -1).matmul(v);
}

at::Tensor causal_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
#if TORCH_VERSION_MAJOR >= 2
  return at::scaled_dot_product_attention(q, k, v, /*attn_mask=*/{}, /*dropout_p=*/0.0, /*is_causal=*/true);
#else
  return causal_attention_reference(q, k, v);
#endif
}

RMSNormImpl::RMSNormImpl(int64_t dim, double eps) : weight(register_parameter("weight", at::ones({dim}))), eps_(eps) {}

at::Tensor RMSNormImpl::forward(const at::Tensor& x) {
  return x * at::rsqrt(x.pow(2).mean(-1, /*keepdim=*/true) + eps_) * weight;
}

AttentionImpl::AttentionImpl(const ModelArgs& args, std::shared_ptr<const RotaryTable> rope)
    : head_dim_(args.head_dim()), n_rep_(args.n_heads / args.kv_heads()), rope_(std::move(rope)) {
  wq = register_module("wq", linear(args.dim, args.n_heads * head_dim_));
  wk = register_module("wk", linear(args.dim, args.kv_heads() * head_dim_));
  wv = register_module("wv", linear(args.dim, args.kv_heads() * head_dim_));
  wo = register_module("wo", linear(args.n_heads * head_dim_, args.dim));
}

at::Tensor AttentionImpl::forward(const at::Tensor& x) {
  const int64_t batch = x.size(0), seq = x.size(1);
  // -1 heads: as many as this rank's part of wq and wk holds (n_heads / tp under tensor parallelism).
  auto heads = [&](const at::Tensor& t) { return t.view({batch, seq, -1, head_dim_}); };
  at::Tensor q = rotate(heads(wq(x)));
  at::Tensor k = rotate(heads(wk(x)));
  at::Tensor v = heads(wv(x));
  k = repeat_kv(k, n_rep_);
  v = repeat_kv(v, n_rep_);
  at::Tensor y = attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2));  // [B, h, T, hd]
  return wo(y.transpose(1, 2).reshape({batch, seq, -1}));
}

at::Tensor AttentionImpl::rotate(const at::Tensor& x) const {
  if (!cp_) return apply_rotary(x, *rope_);
  const int64_t n = cp_->group.size(), half = x.size(1) / 2;
  DTRAIN_CHECK(x.size(1) % 2 == 0, "llama: context parallelism with a local sequence of ", x.size(1),
               " tokens; pass dtrain::context_parallel_shard(tokens, 1, cp), whose parts have even lengths");
  // The head-tail layout: this rank's rows are two runs of positions, each rotated from its start.
  const std::vector<int64_t> pos = dtrain::context_parallel_positions(x.size(1) * n, n, cp_->group.rank());
  return at::cat({apply_rotary(x.narrow(1, 0, half), *rope_, pos[0]),
                  apply_rotary(x.narrow(1, half, half), *rope_, pos[static_cast<size_t>(half)])},
                 1);
}

at::Tensor AttentionImpl::attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) const {
  if (!cp_) return causal_attention(q, k, v);
  if (cp_->kind == CpAttention::kUlysses) return dtrain::ulysses_attention(q, k, v, cp_->group, /*is_causal=*/true);
  return dtrain::ring_attention(q, k, v, cp_->group, /*is_causal=*/true);
}

FeedForwardImpl::FeedForwardImpl(int64_t dim, int64_t hidden) {
  w1 = register_module("w1", linear(dim, hidden));
  w2 = register_module("w2", linear(hidden, dim));
  w3 = register_module("w3", linear(dim, hidden));
}

TransformerBlockImpl::TransformerBlockImpl(int64_t layer_id, const ModelArgs& args,
                                           std::shared_ptr<const RotaryTable> rope)
    : layer_id_(layer_id) {
  attention = register_module("attention", Attention(args, std::move(rope)));
  feed_forward = register_module("feed_forward", FeedForward(args.dim, args.ffn_hidden));
  attention_norm = register_module("attention_norm", RMSNorm(args.dim, args.norm_eps));
  ffn_norm = register_module("ffn_norm", RMSNorm(args.dim, args.norm_eps));
}

at::Tensor TransformerBlockImpl::block(const at::Tensor& x) {
  at::Tensor h = x + attention(attention_norm(x));
  return h + feed_forward(ffn_norm(h));
}

at::Tensor TransformerBlockImpl::forward(const at::Tensor& x) {
  if (!checkpointed_) return block(x);
  // The parameters named, so DDP's and fully_shard's gradient hooks see them in the running backward;
  // no RNG state to keep (no dropout), as torchtitan's preserve_rng_state=False.
  return dtrain::checkpoint([this](const std::vector<at::Tensor>& in) { return block(in[0]); }, {x},
                            dtrain::ActivationCheckpointOptions().parameters(parameters()).preserve_rng_state(false));
}

void TransformerBlockImpl::init_weights() {
  // torchtitan's depth_init: the projections back into the residual stream shrink with depth.
  const double std = 0.02 / std::sqrt(2.0 * static_cast<double>(layer_id_ + 1));
  for (auto* w : {&attention->wq->weight, &attention->wk->weight, &attention->wv->weight, &feed_forward->w1->weight})
    trunc_normal_(*w, 0.02);
  for (auto* w : {&attention->wo->weight, &feed_forward->w2->weight, &feed_forward->w3->weight}) trunc_normal_(*w, std);
  at::NoGradGuard no_grad;
  attention_norm->weight.fill_(1);
  ffn_norm->weight.fill_(1);
}

TransformerImpl::TransformerImpl(const ModelArgs& args) : args_(args) {
  args.validate();
  auto rope =
      std::make_shared<const RotaryTable>(precompute_rotary(args.head_dim(), args.max_seq_len, args.rope_theta));
  tok_embeddings = register_module("tok_embeddings", dtrain::ParallelEmbedding(args.vocab_size, args.dim));
  layers = register_module("layers", torch::nn::ModuleDict());
  for (int64_t i = 0; i < args.n_layers; ++i) {
    auto block = std::make_shared<TransformerBlockImpl>(i, args, rope);
    layers->update({{std::to_string(i), std::shared_ptr<torch::nn::Module>(block)}});
    blocks_.push_back(std::move(block));
  }
  norm = register_module("norm", RMSNorm(args.dim, args.norm_eps));
  output = register_module("output", linear(args.dim, args.vocab_size));
  init_weights();
}

TransformerImpl::TransformerImpl(const TransformerImpl& whole, int64_t first_layer, int64_t end_layer)
    : args_(whole.args_), first_layer_(first_layer), loss_group_(whole.loss_group_) {
  const int64_t n = static_cast<int64_t>(whole.num_blocks());
  DTRAIN_CHECK(0 <= first_layer && first_layer < end_layer && end_layer <= n && whole.first_layer_ == 0 &&
                   whole.has_embedding() && whole.has_output(),
               "llama: a pipeline stage of blocks ", first_layer, " to ", end_layer - 1, " of a model of ", n,
               " blocks; take a non-empty range of a whole model's blocks");
  if (first_layer == 0) tok_embeddings = register_module("tok_embeddings", whole.tok_embeddings);
  layers = register_module("layers", torch::nn::ModuleDict());
  for (int64_t i = first_layer; i < end_layer; ++i) {
    layers->update({{std::to_string(i), std::shared_ptr<torch::nn::Module>(whole.blocks_[i])}});
    blocks_.push_back(whole.blocks_[i]);
  }
  if (end_layer == n) {
    norm = register_module("norm", whole.norm);
    output = register_module("output", whole.output);
  }
}

void TransformerImpl::init_weights() {
  {
    at::NoGradGuard no_grad;
    tok_embeddings->weight.normal_();
    norm->weight.fill_(1);
  }
  for (auto& block : blocks_) block->init_weights();
  const double out_std = 1.0 / std::sqrt(static_cast<double>(args_.dim)), cutoff = 3.0;
  trunc_normal_(output->weight, out_std, -cutoff * out_std, cutoff * out_std);
}

at::Tensor TransformerImpl::forward(const at::Tensor& tokens) {
  if (has_embedding())
    DTRAIN_CHECK(tokens.dim() == 2 && tokens.scalar_type() == at::kLong, "llama::Transformer: tokens are ",
                 tokens.scalar_type(), tokens.sizes(), "; pass int64 token ids shaped [batch, sequence]");
  else
    DTRAIN_CHECK(tokens.dim() == 3 && tokens.size(2) == args_.dim, "llama::Transformer: the pipeline stage from block ",
                 first_layer_, " takes the previous stage's activations [batch, sequence, ", args_.dim, "], got ",
                 tokens.scalar_type(), tokens.sizes());
  at::Tensor h = has_embedding() ? tok_embeddings(tokens) : tokens;
  // Through FSDPModule: a block fully_shard made a unit gathers its parameters around its forward.
  for (auto& block : blocks_) h = dtrain::FSDPModule<TransformerBlockImpl>(block)(h);
  return has_output() ? output(norm(h)) : h;
}

at::Tensor TransformerImpl::loss(const at::Tensor& logits, const at::Tensor& targets) const {
  if (loss_group_) return dtrain::parallel_cross_entropy(logits, targets, *loss_group_);
  return torch::nn::functional::cross_entropy(logits.reshape({-1, logits.size(-1)}), targets.reshape(-1));
}

dtrain::ParallelizePlan tensor_parallel_plan(bool loss_parallel) {
  using dtrain::ColwiseParallel;
  using dtrain::RowwiseParallel;
  // doc:begin tp_plan
  return {
      // Every rank holds all the token ids: each looks up its rows of the vocabulary, the all-reduce sums.
      {"tok_embeddings", RowwiseParallel().input_layouts(dtrain::Replicate())},
      {"layers.*.attention.wq", ColwiseParallel()},
      {"layers.*.attention.wk", ColwiseParallel()},
      {"layers.*.attention.wv", ColwiseParallel()},
      {"layers.*.attention.wo", RowwiseParallel()},
      {"layers.*.feed_forward.w1", ColwiseParallel()},
      {"layers.*.feed_forward.w2", RowwiseParallel()},
      {"layers.*.feed_forward.w3", ColwiseParallel()},
      {"output", loss_parallel ? ColwiseParallel() : ColwiseParallel().output_layouts(dtrain::Replicate())},
  };
  // doc:end tp_plan
}

void apply_tensor_parallel(TransformerImpl& model, const dtrain::Group& tp_group, bool loss_parallel) {
  const ModelArgs& a = model.args();
  const int64_t tp = tp_group.size();
  DTRAIN_CHECK(a.n_heads % tp == 0 && a.kv_heads() % tp == 0, "llama::apply_tensor_parallel: n_heads ", a.n_heads,
               " and n_kv_heads ", a.kv_heads(), " must divide by the tensor-parallel size ", tp,
               " (each rank computes whole heads); pick a tp size that divides both");
  dtrain::ParallelizePlan plan;
  for (auto& entry : tensor_parallel_plan(loss_parallel)) {
    // A pipeline stage holds the embedding (the first) or the output head (the last), or neither.
    if ((entry.first == "tok_embeddings" && !model.has_embedding()) || (entry.first == "output" && !model.has_output()))
      continue;
    plan.push_back(entry);
  }
  dtrain::parallelize_module(model, tp_group, plan);
  model.set_loss_group(loss_parallel ? std::optional<dtrain::Group>(tp_group) : std::nullopt);
}

void apply_tensor_parallel(TransformerImpl& model, const dtrain::DeviceMesh& tp_mesh, bool loss_parallel) {
  DTRAIN_CHECK(tp_mesh.ndim() == 1, "llama::apply_tensor_parallel: the mesh has ", tp_mesh.ndim(),
               " dimensions; pass the tensor-parallel one, e.g. mesh[\"tp\"]");
  apply_tensor_parallel(model, tp_mesh.get_group(), loss_parallel);
}

dtrain::FSDPModule<TransformerImpl> apply_fully_shard(const Transformer& model,
                                                      const dtrain::FullyShardOptions& options) {
  for (size_t i = 0; i < model->num_blocks(); ++i) {
    dtrain::FullyShardOptions unit = options;
    // torchtitan's choice: the last block's gathered parameters are the first backward needs.
    if (!options.reshard_after_forward() && i + 1 == model->num_blocks()) unit.reshard_after_forward(false);
    dtrain::fully_shard(model->block_ptr(i), unit);
  }
  return dtrain::fully_shard(model.ptr(), options);
}

std::pair<int64_t, int64_t> pipeline_stage_layers(int64_t n_layers, int64_t stage, int64_t stages) {
  DTRAIN_CHECK(stages >= 1 && stages <= n_layers && stage >= 0 && stage < stages, "llama: pipeline stage ", stage,
               " of ", stages, " over ", n_layers, " blocks; every stage needs a block: use at most n_layers stages");
  const int64_t base = n_layers / stages, extra = n_layers % stages;
  const int64_t first = stage * base + std::min(stage, extra);
  return {first, first + base + (stage < extra ? 1 : 0)};
}

Transformer pipeline_stage(const TransformerImpl& whole, int64_t stage, int64_t stages) {
  const auto [first, end] = pipeline_stage_layers(static_cast<int64_t>(whole.num_blocks()), stage, stages);
  return Transformer(std::make_shared<TransformerImpl>(whole, first, end));
}

namespace {

// A pipeline stage as one Sequential element: its forward through the stage's fully_shard root (its
// parameters gathered around it, its backward followed), or as is without one.
class PipelineStageImpl : public torch::nn::Module {
 public:
  explicit PipelineStageImpl(Transformer stage) : stage_(register_module("stage", stage.ptr())) {}
  at::Tensor forward(const at::Tensor& x) { return dtrain::FSDPModule<TransformerImpl>(stage_)(x); }

 private:
  std::shared_ptr<TransformerImpl> stage_;
};

}  // namespace

torch::nn::Sequential pipeline_stage_module(const Transformer& stage) {
  torch::nn::Sequential seq;
  seq->push_back(std::make_shared<PipelineStageImpl>(stage));
  return seq;
}

void apply_activation_checkpoint(TransformerImpl& model, const ActivationCheckpoint& ac) {
  DTRAIN_CHECK(ac.mode != ActivationCheckpoint::Mode::kEveryK || ac.every >= 1,
               "llama::apply_activation_checkpoint: every ", ac.every, "; checkpoint every k-th block with k >= 1");
  for (size_t i = 0; i < model.num_blocks(); ++i) {
    const bool on = ac.mode == ActivationCheckpoint::Mode::kFull ||
                    (ac.mode == ActivationCheckpoint::Mode::kEveryK && (static_cast<int64_t>(i) + 1) % ac.every == 0);
    model.block(i).set_checkpointed(on);
  }
}

void apply_context_parallel(TransformerImpl& model, const dtrain::Group& cp_group, CpAttention kind) {
  for (size_t i = 0; i < model.num_blocks(); ++i)
    model.block(i).attention->set_context_parallel(ContextParallel{cp_group, kind});
}

void remove_context_parallel(TransformerImpl& model) {
  for (size_t i = 0; i < model.num_blocks(); ++i) model.block(i).attention->set_context_parallel(std::nullopt);
}

}  // namespace llama
