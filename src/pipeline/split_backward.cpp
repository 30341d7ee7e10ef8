// Zero-bubble backward: the input gradient now, the weight gradients later (steps in split_backward.h).
#include "pipeline/split_backward.h"

#include <unordered_map>

#include <torch/csrc/autograd/autograd.h>

#include "dtrain/errors.h"

namespace dtrain::pipeline {

namespace {

std::vector<at::Tensor> trainable(const torch::nn::AnyModule& layer) {
  std::vector<at::Tensor> out;
  for (const auto& p : layer.ptr()->parameters())
    if (p.requires_grad()) out.push_back(p);
  return out;
}

}  // namespace

at::Tensor forward_recording(torch::nn::Sequential stage, const at::Tensor& x, std::vector<WeightPart>& parts) {
  at::Tensor h = x;
  for (auto& layer : *stage) {
    h = layer.forward(h);
    if (!h.requires_grad() || h.grad_fn() == nullptr) continue;
    auto params = trainable(layer);
    if (!params.empty()) parts.push_back({h, std::move(params), at::Tensor()});
  }
  return h;
}

at::Tensor backward_input(const at::Tensor& root, const at::Tensor& root_grad, const at::Tensor& input,
                          std::vector<WeightPart>& parts) {
  if (!root.requires_grad()) {
    parts.clear();  // nothing in this stage is differentiable for this micro-batch
    return {};
  }
  const bool want_input = input.defined() && input.requires_grad();
  std::vector<at::Tensor> inputs;
  if (want_input) inputs.push_back(input);
  std::vector<WeightPart*> asked;
  for (auto& part : parts) {
    if (part.output.is_same(root)) {
      part.grad = root_grad.defined() ? root_grad : at::ones_like(root);
    } else {
      inputs.push_back(part.output);
      asked.push_back(&part);
    }
  }
  if (inputs.empty()) return {};
  std::vector<at::Tensor> grad_outputs;
  if (root_grad.defined()) grad_outputs.push_back(root_grad);
  auto grads = torch::autograd::grad({root}, inputs, grad_outputs, /*retain_graph=*/true, /*create_graph=*/false,
                                     /*allow_unused=*/true);
  const size_t first = want_input ? 1 : 0;
  for (size_t k = 0; k < asked.size(); ++k) asked[k]->grad = grads[first + k];
  return want_input ? grads[0] : at::Tensor();
}

void backward_weight(std::vector<WeightPart>& parts) {
  for (auto& part : parts) {
    if (!part.grad.defined()) continue;  // the loss did not depend on this layer's output
    torch::autograd::backward({part.output}, {part.grad}, /*retain_graph=*/false, /*create_graph=*/false, part.params);
  }
  parts.clear();
}

void check_split_backward(const torch::nn::Sequential& stage, int global_stage) {
  std::unordered_map<const void*, size_t> owner;
  size_t index = 0;
  for (const auto& layer : *stage) {
    for (const auto& p : layer.ptr()->parameters()) {
      auto [it, fresh] = owner.emplace(p.unsafeGetTensorImpl(), index);
      DTRAIN_CHECK(fresh || it->second == index, "Pipeline: ZeroBubbleH1 splits each layer's weight gradient from ",
                   "its input gradient, but stage ", global_stage, " uses one parameter in its layers ", it->second,
                   " and ", index, ": put them in one layer (a nested Sequential) or use Schedule::k1F1B");
    }
    ++index;
  }
}

}  // namespace dtrain::pipeline
