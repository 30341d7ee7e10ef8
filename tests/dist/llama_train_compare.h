// The Llama-style decoder's test configuration and the comparison with one process that the
// distributed Llama tests share (llama_composition_test, context_parallel_test).
#pragma once

#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <torch/nn/utils/clip_grad.h>
#include <torch/optim/adamw.h>

#include <algorithm>
#include <limits>
#include <optional>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "dtrain/process_group.h"
#include "dtrain/shard_spec.h"
#include "llm/llama.h"

// Small enough for seconds on CI; grouped-query attention (8 query heads over 4 k/v heads) and
// head, MLP and vocabulary sizes that divide by 2 and 4 tensor-parallel ranks.
inline llama::ModelArgs llm_test_args() {
  llama::ModelArgs a;
  a.vocab_size = 64;
  a.dim = 32;
  a.n_layers = 2;
  a.n_heads = 8;
  a.n_kv_heads = 4;
  a.ffn_hidden = 64;
  a.max_seq_len = 32;
  return a;
}

constexpr int64_t kLlmBatch = 4, kLlmSeq = 16;

// Every rank builds the same model from the same seed (fully_shard does not broadcast).
inline llama::Transformer llm_make_model() {
  torch::manual_seed(1);
  llama::Transformer model(llm_test_args());
  model->to(at::kDouble);
  return model;
}

// Step s's batch, the same on every rank: inputs and next-token targets.
inline std::pair<at::Tensor, at::Tensor> llm_batch(int64_t s) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1000 + s);
  at::Tensor seq = at::randint(llm_test_args().vocab_size, {kLlmBatch, kLlmSeq + 1}, gen, at::kLong);
  return {seq.narrow(1, 0, kLlmSeq), seq.narrow(1, 1, kLlmSeq)};
}

inline double llm_rel_diff(const at::Tensor& a, const at::Tensor& b) {
  return (a - b).abs().max().item<double>() / std::max(b.abs().max().item<double>(), 1e-6);
}

using LlmForward = std::function<at::Tensor(const at::Tensor&)>;
// This rank's part of a batch's tokens and targets.
using LlmCut = std::function<std::pair<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&)>;
// One step's forward and backward on this rank's part of the batch; ref_loss and ref_norm: the one
// process's loss and gradient 2-norm of the whole batch, for the step to check against.
using LlmStep =
    std::function<void(const at::Tensor& tokens, const at::Tensor& targets, double ref_loss, double ref_norm)>;
// Called after each step with this rank's loss and the one process's.
using LlmStepCheck = std::function<void(int64_t step, const at::Tensor& loss, double ref_loss)>;

// 10 AdamW steps of `model` run through `step`, each rank on its part (`cut`) of every batch, against
// one process on the whole batch; then the parameters whole (a pipeline stage's: its own, the stages
// of pp_group together holding every parameter once).
inline void expect_llm_steps_like_one_process(llama::Transformer model, const LlmStep& step, const LlmCut& cut,
                                              const std::string& what,
                                              const std::optional<dtrain::Group>& pp_group = std::nullopt) {
  llama::Transformer ref = llm_make_model();
  auto adamw = [](std::vector<at::Tensor> params) {
    return torch::optim::AdamW(std::move(params), torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
  };
  torch::optim::AdamW opt = adamw(model->parameters()), ref_opt = adamw(ref->parameters());
  double first_loss = 0, last_loss = 0;
  for (int64_t s = 0; s < 10; ++s) {
    auto [tokens, targets] = llm_batch(s);
    ref_opt.zero_grad();
    at::Tensor ref_loss = ref->loss(ref(tokens), targets);
    ref_loss.backward();
    const double ref_norm =
        torch::nn::utils::clip_grad_norm_(ref->parameters(), std::numeric_limits<double>::infinity());
    ref_opt.step();
    (s == 0 ? first_loss : last_loss) = ref_loss.item<double>();
    opt.zero_grad();
    auto [mine, my_targets] = cut(tokens, targets);
    step(mine, my_targets, ref_loss.item<double>(), ref_norm);
    opt.step();
  }
  EXPECT_LT(last_loss, first_loss) << "the one process's loss fell";
  auto whole = ref->named_parameters();
  auto got = dtrain::full_state_dict(*model);  // collective: the shards of every group put together
  int64_t count = static_cast<int64_t>(got.size());
  if (pp_group) count = dtrain::all_reduce_values(std::vector<int64_t>{count}, dtrain::ReduceOp::SUM, *pp_group)[0];
  ASSERT_EQ(count, static_cast<int64_t>(whole.size())) << what;
  for (const auto& [name, t] : got) {
    ASSERT_TRUE(whole.contains(name)) << what << ": " << name;
    EXPECT_LT(llm_rel_diff(t, whole[name]), 1e-10) << what << ": " << name << " after 10 AdamW steps";
  }
}

// The same with `forward` and the loss's backward as the step; `check` sees each step's loss.
inline void expect_llm_trains_like_one_process(llama::Transformer model, const LlmForward& forward, const LlmCut& cut,
                                               const std::string& what, const LlmStepCheck& check = {}) {
  int64_t s = 0;
  expect_llm_steps_like_one_process(
      model,
      [&](const at::Tensor& tokens, const at::Tensor& targets, double ref_loss, double) {
        at::Tensor loss = model->loss(forward(tokens), targets);
        loss.backward();
        if (check) check(s, loss.detach(), ref_loss);
        ++s;
      },
      cut, what);
}
