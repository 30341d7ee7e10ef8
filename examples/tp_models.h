// Models for tensor parallelism (examples/tp_train.cpp and the tests in tests/dist/): an MLP block,
// a transformer block (attention heads split over the tp ranks, MLP column then row) and a
// language-model head over a vocab-parallel embedding, each with its plan. Unparallelized they are the one-process
// reference (ParallelLinear without a style is a Linear).
#pragma once

#include <torch/nn/functional/activation.h>
#include <torch/nn/modules/normalization.h>

#include <cmath>

#include "dtrain/tensor_parallel.h"

namespace tp_models {

struct MLPImpl : torch::nn::Module {
  MLPImpl(int64_t dim, int64_t hidden)
      : w1(register_module("w1", dtrain::ParallelLinear(dim, hidden))),
        w2(register_module("w2", dtrain::ParallelLinear(hidden, dim))) {}
  at::Tensor forward(const at::Tensor& x) { return w2(torch::tanh(w1(x))); }
  dtrain::ParallelLinear w1, w2;
};
TORCH_MODULE(MLP);

inline dtrain::ParallelizePlan mlp_plan(const std::string& prefix = "") {
  return {{prefix + "w1", dtrain::ColwiseParallel()}, {prefix + "w2", dtrain::RowwiseParallel()}};
}

// Pre-norm block: x + attn(ln1(x)), then + mlp(ln2(.)). q, k, v column-parallel: each rank computes
// its heads (q.size(-1) / head_dim of them); o row-parallel sums the heads' contributions.
struct BlockImpl : torch::nn::Module {
  BlockImpl(int64_t dim, int64_t heads)
      : head_dim(dim / heads),
        ln1(register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({dim})))),
        ln2(register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({dim})))),
        q(register_module("q", dtrain::ParallelLinear(dim, dim))),
        // No bias on k: softmax ignores it, so its gradient is rounding noise, which Adam would
        // turn into full steps, different on every split of the sums.
        k(register_module("k", dtrain::ParallelLinear(torch::nn::LinearOptions(dim, dim).bias(false)))),
        v(register_module("v", dtrain::ParallelLinear(dim, dim))),
        o(register_module("o", dtrain::ParallelLinear(dim, dim))),
        mlp(register_module("mlp", MLP(dim, 2 * dim))) {}

  at::Tensor attention(const at::Tensor& x) {  // x: [B, T, dim]
    auto heads = [&](const at::Tensor& t) {    // [B, T, h * hd] -> [B, h, T, hd]
      return t.view({t.size(0), t.size(1), -1, head_dim}).transpose(1, 2);
    };
    at::Tensor qh = heads(q(x)), kh = heads(k(x)), vh = heads(v(x));
    at::Tensor scores = qh.matmul(kh.transpose(-2, -1)) / std::sqrt(static_cast<double>(head_dim));
    at::Tensor y = torch::softmax(scores, -1).matmul(vh);  // [B, h, T, hd]
    return o(y.transpose(1, 2).reshape({x.size(0), x.size(1), -1}));
  }
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor h = x + attention(ln1(x));
    return h + mlp(ln2(h));
  }

  int64_t head_dim;
  torch::nn::LayerNorm ln1, ln2;
  dtrain::ParallelLinear q, k, v, o;
  MLP mlp;
};
TORCH_MODULE(Block);

// prefix: the block's name inside a larger model ("blocks.*." for each block of a ModuleList).
inline dtrain::ParallelizePlan block_plan(const std::string& prefix = "") {
  return {{prefix + "q", dtrain::ColwiseParallel()},      {prefix + "k", dtrain::ColwiseParallel()},
          {prefix + "v", dtrain::ColwiseParallel()},      {prefix + "o", dtrain::RowwiseParallel()},
          {prefix + "mlp.w1", dtrain::ColwiseParallel()}, {prefix + "mlp.w2", dtrain::RowwiseParallel()}};
}

// Tokens -> vocab-parallel embedding -> tanh -> column-parallel head: logits sharded by class.
struct LMImpl : torch::nn::Module {
  LMImpl(int64_t vocab, int64_t dim, int64_t classes)
      : emb(register_module("emb", dtrain::ParallelEmbedding(vocab, dim))),
        head(register_module("head", dtrain::ParallelLinear(dim, classes))) {}
  at::Tensor forward(const at::Tensor& tokens) { return head(torch::tanh(emb(tokens))); }
  dtrain::ParallelEmbedding emb;
  dtrain::ParallelLinear head;
};
TORCH_MODULE(LM);

inline dtrain::ParallelizePlan lm_plan() {
  return {{"emb", dtrain::RowwiseParallel().input_layouts(dtrain::Replicate())}, {"head", dtrain::ColwiseParallel()}};
}

}  // namespace tp_models
