// A Llama-style decoder (Llama 3's architecture, torchtitan's llama3 model and its parameter names)
// in torch::nn, written so that every dtrain parallelism applies to it by plan:
//
//   llama::ModelArgs args = llama::ModelArgs::debug();
//   llama::Transformer model(args);
//   llama::apply_tensor_parallel(*model, mesh["tp"]);              // heads, MLP and vocabulary split
//   llama::apply_activation_checkpoint(*model, llama::ActivationCheckpoint::full());
//   auto fsdp = llama::apply_fully_shard(model, dtrain::FullyShardOptions().mesh(mesh["dp"]));
//   at::Tensor logits = fsdp(tokens);                              // [B, T, vocab / tp]
//   at::Tensor loss = model->loss(logits, targets);                 // parallel cross-entropy under TP
//
// Context parallelism: llama::apply_context_parallel(*model, mesh.get_group("cp")), then each cp
// rank passes its part of the tokens, dtrain::context_parallel_shard(tokens, 1, cp) (and of the
// targets alike): attention runs as dtrain::ring_attention (or ulysses_attention) over the group,
// with each token rotated by its position in the whole sequence.
//
// tokens -> tok_embeddings -> layers.0 .. layers.N-1 -> norm -> output, each block
//   h = x + attention(attention_norm(x));  out = h + feed_forward(ffn_norm(h))
// with causal multi-head attention (rotary position embeddings on q and k, grouped k/v heads when
// n_kv_heads < n_heads) and a SwiGLU MLP w2(silu(w1(x)) * w3(x)). No biases, as Llama.
//
// How each parallelism finds its place (LibTorch modules have no forward hooks):
// - the blocks sit in a ModuleDict `layers` keyed by their index in the whole model (names
//   layers.N.*, a pipeline stage's blocks keep theirs) and the model's forward runs each through
//   FSDPModule<TransformerBlockImpl>, so a block that fully_shard made a unit runs as one;
// - a block checkpoints itself inside its forward (apply_activation_checkpoint), i.e. inside its
//   fully_shard unit, the order dtrain's activation checkpointing requires;
// - every linear layer is a dtrain::ParallelLinear and the embedding a dtrain::ParallelEmbedding,
//   which parallelize_module can give a style; the attention counts its heads from wq's and wk's
//   local output size, so it computes n_heads / tp of them on each tensor-parallel rank.
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/modules/container/moduledict.h>
#include <torch/nn/modules/container/sequential.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "dtrain/context_parallel.h"
#include "dtrain/device_mesh.h"
#include "dtrain/fsdp.h"
#include "dtrain/process_group.h"
#include "dtrain/tensor_parallel.h"

namespace llama {

// torchtitan's TransformerModelArgs, with the MLP's hidden size given outright (ffn_hidden_for
// computes Llama's rule from dim).
struct ModelArgs {
  int64_t vocab_size = 1024;
  int64_t dim = 128;
  int64_t n_layers = 4;
  int64_t n_heads = 4;
  int64_t n_kv_heads = 0;  // 0: n_heads (no grouped-query attention)
  int64_t ffn_hidden = 384;
  int64_t max_seq_len = 256;
  double rope_theta = 500000.0;  // Llama 3's
  double norm_eps = 1e-5;

  // About 1.1 M parameters: for tests and a first run of the trainer.
  static ModelArgs debug() { return ModelArgs(); }
  int64_t kv_heads() const { return n_kv_heads > 0 ? n_kv_heads : n_heads; }
  int64_t head_dim() const { return dim / n_heads; }
  // The number of parameters of the model these arguments build (every tensor counted once).
  int64_t num_params() const;
  // Refuses arguments the model cannot be built from, in one line naming the value.
  void validate() const;
};

// Llama's MLP width: 2/3 of 4 * dim, times an optional multiplier, rounded up to multiple_of.
int64_t ffn_hidden_for(int64_t dim, int64_t multiple_of = 256, std::optional<double> ffn_dim_multiplier = {});

// cos and sin of every position's rotation angles, [max_seq_len, head_dim / 2], in float64 (each
// forward casts them to its input's dtype and device). Not a buffer: they follow from the arguments,
// so a state dict holds the parameters alone.
struct RotaryTable {
  at::Tensor cos, sin;
};
RotaryTable precompute_rotary(int64_t head_dim, int64_t max_seq_len, double theta);
// x: [B, T, heads, head_dim]; rotates each adjacent pair (x[2i], x[2i+1]) of position t by t * freq_i,
// as Llama's complex multiplication by freqs_cis[t]. `offset`: the first row's position.
at::Tensor apply_rotary(const at::Tensor& x, const RotaryTable& table, int64_t offset = 0);

// softmax(q k^T / sqrt(head_dim) + causal mask) v over [B, heads, T, head_dim]:
// at::scaled_dot_product_attention(is_causal) on LibTorch 2.x, the same written out on 1.13.
at::Tensor causal_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v);
// The written-out arithmetic on every LibTorch (what the 2.x kernel is compared with).
at::Tensor causal_attention_reference(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v);

// Llama's RMSNorm: x / sqrt(mean(x^2) + eps) * weight (torch.nn.RMSNorm; parameter `weight`).
class RMSNormImpl : public torch::nn::Module {
 public:
  RMSNormImpl(int64_t dim, double eps);
  at::Tensor forward(const at::Tensor& x);
  at::Tensor weight;

 private:
  double eps_;
};
TORCH_MODULE(RMSNorm);

// Which context-parallel attention a model runs: K/V around a ring, or heads traded by all-to-all
// (the local heads must then divide by the cp size).
enum class CpAttention { kRing, kUlysses };
struct ContextParallel {
  dtrain::Group group;
  CpAttention kind = CpAttention::kRing;
};

class AttentionImpl : public torch::nn::Module {
 public:
  AttentionImpl(const ModelArgs& args, std::shared_ptr<const RotaryTable> rope);
  // [B, T, dim] -> [B, T, dim]; under context parallelism T is this rank's part of the sequence.
  at::Tensor forward(const at::Tensor& x);
  void set_context_parallel(std::optional<ContextParallel> cp) { cp_ = std::move(cp); }
  dtrain::ParallelLinear wq{nullptr}, wk{nullptr}, wv{nullptr}, wo{nullptr};

 private:
  at::Tensor rotate(const at::Tensor& x) const;  // at the positions this rank's rows hold
  at::Tensor attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) const;
  int64_t head_dim_, n_rep_;
  std::shared_ptr<const RotaryTable> rope_;
  std::optional<ContextParallel> cp_;
};
TORCH_MODULE(Attention);

class FeedForwardImpl : public torch::nn::Module {
 public:
  FeedForwardImpl(int64_t dim, int64_t hidden);
  at::Tensor forward(const at::Tensor& x) { return w2(at::silu(w1(x)) * w3(x)); }
  dtrain::ParallelLinear w1{nullptr}, w2{nullptr}, w3{nullptr};
};
TORCH_MODULE(FeedForward);

class TransformerBlockImpl : public torch::nn::Module {
 public:
  TransformerBlockImpl(int64_t layer_id, const ModelArgs& args, std::shared_ptr<const RotaryTable> rope);
  // Checkpointed (apply_activation_checkpoint) or as is.
  at::Tensor forward(const at::Tensor& x);
  void set_checkpointed(bool on) { checkpointed_ = on; }
  bool checkpointed() const { return checkpointed_; }
  // torchtitan's init_weights: truncated normals, the output projections' std shrinking with depth.
  void init_weights();

  Attention attention{nullptr};
  FeedForward feed_forward{nullptr};
  RMSNorm attention_norm{nullptr}, ffn_norm{nullptr};

 private:
  at::Tensor block(const at::Tensor& x);
  int64_t layer_id_;
  bool checkpointed_ = false;
};
TORCH_MODULE(TransformerBlock);

class TransformerImpl : public torch::nn::Module {
 public:
  explicit TransformerImpl(const ModelArgs& args);
  // A pipeline stage of `whole` (pipeline_stage below): its modules, shared, for blocks
  // [first_layer, end_layer), the embedding when first_layer is 0, the final norm and the output head
  // when end_layer is the last.
  TransformerImpl(const TransformerImpl& whole, int64_t first_layer, int64_t end_layer);
  // [B, T] int64 tokens (or, on a stage without the embedding, [B, T, dim] activations) -> logits
  // [B, T, vocab (/ tp)] (or, on a stage without the output head, the activations after its blocks).
  at::Tensor forward(const at::Tensor& tokens);
  // Mean cross-entropy over every token: over the vocabulary-sharded logits with
  // dtrain::parallel_cross_entropy when apply_tensor_parallel sharded the output (loss_parallel),
  // else torch's cross_entropy.
  at::Tensor loss(const at::Tensor& logits, const at::Tensor& targets) const;
  void init_weights();
  const ModelArgs& args() const { return args_; }
  TransformerBlockImpl& block(size_t i) { return *blocks_.at(i); }
  const std::shared_ptr<TransformerBlockImpl>& block_ptr(size_t i) const { return blocks_.at(i); }
  size_t num_blocks() const { return blocks_.size(); }  // this model's (a stage's: its own)
  int64_t first_layer() const { return first_layer_; }  // the index of block(0) in the whole model
  bool has_embedding() const { return !tok_embeddings.is_empty(); }
  bool has_output() const { return !output.is_empty(); }
  // The group the logits' vocabulary is sharded over (apply_tensor_parallel sets it), or none.
  void set_loss_group(std::optional<dtrain::Group> group) { loss_group_ = std::move(group); }

  dtrain::ParallelEmbedding tok_embeddings{nullptr};
  torch::nn::ModuleDict layers{nullptr};
  RMSNorm norm{nullptr};  // null on a pipeline stage before the last
  dtrain::ParallelLinear output{nullptr};

 private:
  ModelArgs args_;
  int64_t first_layer_ = 0;
  std::vector<std::shared_ptr<TransformerBlockImpl>> blocks_;
  std::optional<dtrain::Group> loss_group_;  // set when the logits are sharded over it
};
TORCH_MODULE(Transformer);

// Pipeline parallelism by blocks, as torchtitan's pipeline_llama splits the model: stage s of
// `stages` holds blocks [first, end) (n_layers / stages each, the first n_layers % stages stages one
// more), stage 0 also the embedding, the last stage also the final norm and the output head (so the
// loss is computed there). pipeline_stage shares the whole model's modules and keeps their names
// (layers.N.*); apply_tensor_parallel, apply_activation_checkpoint and apply_fully_shard then apply
// to the stage as to a whole model. pipeline_stage_module wraps a stage for dtrain::Pipeline: one
// Sequential element that runs it through its fully_shard root, when it has one.
std::pair<int64_t, int64_t> pipeline_stage_layers(int64_t n_layers, int64_t stage, int64_t stages);
Transformer pipeline_stage(const TransformerImpl& whole, int64_t stage, int64_t stages);
torch::nn::Sequential pipeline_stage_module(const Transformer& stage);

// torchtitan's tensor-parallel plan (without sequence parallelism): the embedding vocab-parallel
// (its output all-reduced, whole on every rank), wq/wk/wv and w1/w3 column-parallel, wo and w2
// row-parallel, the output head column-parallel. loss_parallel: the logits stay sharded by
// vocabulary and loss() takes dtrain::parallel_cross_entropy; otherwise they are gathered. A pipeline
// stage's plan leaves out the embedding or the output head it does not hold.
// n_heads, n_kv_heads, ffn_hidden and vocab_size must divide by the group's size.
dtrain::ParallelizePlan tensor_parallel_plan(bool loss_parallel = true);
void apply_tensor_parallel(TransformerImpl& model, const dtrain::Group& tp_group, bool loss_parallel = true);
void apply_tensor_parallel(TransformerImpl& model, const dtrain::DeviceMesh& tp_mesh, bool loss_parallel = true);

// Each block a fully_shard unit, then the root (the embedding, final norm and output) last, as
// torchtitan's apply_fsdp; with reshard_after_forward unset, the last block keeps its parameters
// after forward, since backward needs them first. Call after apply_tensor_parallel and
// apply_activation_checkpoint; forward through the handle returned.
dtrain::FSDPModule<TransformerImpl> apply_fully_shard(const Transformer& model,
                                                      const dtrain::FullyShardOptions& options = {});

// Which blocks recompute their activations in backward: none, every block (full), or every k-th
// (torchtitan's selective layer checkpointing: blocks k-1, 2k-1, ...).
struct ActivationCheckpoint {
  enum class Mode { kNone, kFull, kEveryK };
  Mode mode = Mode::kNone;
  int64_t every = 1;
  static ActivationCheckpoint none() { return {}; }
  static ActivationCheckpoint full() { return {Mode::kFull, 1}; }
  static ActivationCheckpoint every_k(int64_t k) { return {Mode::kEveryK, k}; }
};
void apply_activation_checkpoint(TransformerImpl& model, const ActivationCheckpoint& ac);

// Context parallelism over cp_group (torchtitan's context_parallel around the train step): every
// block's attention becomes ring (or Ulysses) attention over the group, and the model then takes
// each rank's head-tail part of the tokens (dtrain::context_parallel_shard(tokens, 1, cp_group)),
// whose length must be even. The parameters stay whole on every cp rank: their gradients are the
// mean over the group's ranks of each rank's loss, so shard or average them over a mesh dimension
// that includes cp (torchtitan's dp_shard_cp). Ulysses needs the local heads (n_heads / tp) to
// divide by the cp size.
void apply_context_parallel(TransformerImpl& model, const dtrain::Group& cp_group,
                            CpAttention kind = CpAttention::kRing);
// Every block's attention back to the whole sequence on every rank (e.g. to decode a context of any
// length); apply_context_parallel splits it again.
void remove_context_parallel(TransformerImpl& model);

}  // namespace llama
