// The sequence-parallel block of the tests (tensor_parallel_test.cpp, tp_reference.cpp and its
// PyTorch twin tp_reference.py): norm1 (torch::nn::LayerNorm) -> w1 (column-parallel) -> relu -> w2
// (row-parallel, reduce-scattered on the sequence) -> norm2 (the Llama recipe's RMSNorm), the norms
// sequence-parallel. Its forward calls prepare_input and prepare_output, so a plan may also give
// the block whole inputs and outputs (Replicate() around it). Unparallelized, it is the
// one-process reference.
#pragma once

#include <torch/nn/functional/activation.h>
#include <torch/nn/modules/normalization.h>

#include "dtrain/tensor_parallel.h"
#include "llm/llama.h"

namespace sp_models {

constexpr int64_t kDim = 8, kHidden = 16;

struct SPBlockImpl : torch::nn::Module {
  SPBlockImpl()
      : norm1(register_module("norm1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kDim})))),
        w1(register_module("w1", dtrain::ParallelLinear(kDim, kHidden))),
        w2(register_module("w2", dtrain::ParallelLinear(kHidden, kDim))),
        norm2(register_module("norm2", llama::RMSNorm(kDim, 1e-5))) {}
  // doc:begin sp_forward
  at::Tensor forward(const at::Tensor& input) {
    at::Tensor x = dtrain::prepare_input(*this, input);  // the identity unless a plan prepares it
    at::Tensor y = norm2(w2(torch::relu(w1(norm1(x)))));
    return dtrain::prepare_output(*this, y);
  }
  // doc:end sp_forward
  torch::nn::LayerNorm norm1;
  dtrain::ParallelLinear w1, w2;
  llama::RMSNorm norm2;
};
TORCH_MODULE(SPBlock);

struct SPNetImpl : torch::nn::Module {
  SPNetImpl() : block(register_module("block", SPBlock())) {}
  at::Tensor forward(const at::Tensor& x) { return block(x); }
  SPBlock block;
};
TORCH_MODULE(SPNet);

// Inputs and outputs are each rank's positions (dim 1); `whole`: whole on every rank around the
// block, cut and gathered by PrepareModuleInput and PrepareModuleOutput.
inline dtrain::ParallelizePlan sp_plan(bool whole) {
  using namespace dtrain;
  // doc:begin sp_plan
  ParallelizePlan plan = {{"block.norm1", SequenceParallel()},
                          {"block.w1", ColwiseParallel().input_layouts(Shard(1))},
                          {"block.w2", RowwiseParallel().output_layouts(Shard(1))},
                          {"block.norm2", SequenceParallel()}};
  if (whole) {
    plan.push_back({"block", PrepareModuleInput().input_layouts({Replicate()}).desired_input_layouts({Shard(1)})});
    plan.push_back({"block", PrepareModuleOutput().output_layouts({Shard(1)}).desired_output_layouts({Replicate()})});
  }
  // doc:end sp_plan
  return plan;
}

}  // namespace sp_models
