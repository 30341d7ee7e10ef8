// Zero-bubble backward (ZB-H1): B, the gradient of a stage's input (what the previous stage waits
// for), now; W, the gradients of the stage's weights, later, in the pipeline's bubble.
//
// How, for one micro-batch of one stage:
//   1. Forward runs the stage's layers one by one and records the output of every layer that has
//      trainable parameters (it stays inside the micro-batch's autograd graph).
//   2. B is one autograd::grad call from the stage's output (or the loss) to the stage's input and to
//      the recorded layer outputs, keeping the graph. Autograd runs only what these need, so a Linear
//      computes its input's gradient and not its weight's; the layer outputs' gradients are kept.
//   3. W runs, for each recorded layer, backward from its output with the gradient B found there,
//      restricted to that layer's parameters (autograd's `inputs`). That touches only the layer's own
//      nodes (autograd prunes the rest), accumulates into the parameters' .grad, and frees the nodes.
// B + W equal the full backward: the chain rule evaluated in two parts. A layer that is itself a chain
// (a nested Sequential) recomputes its inner input gradients in W: split such blocks into separate
// layers of the pipeline's Sequential to keep W cheap. A parameter used by two layers of one stage would
// make W walk from the later layer into the earlier one and count that path twice, so the pipeline
// refuses it at construction (check_split_backward).
#pragma once

#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/nn/modules/container/sequential.h>

namespace dtrain::pipeline {

// A layer's output waiting for its W: the parameters to differentiate and the gradient B found.
struct WeightPart {
  at::Tensor output;
  std::vector<at::Tensor> params;
  at::Tensor grad;
};

// Step 1: the stage's forward, appending to `parts` every layer whose output depends on a trainable
// parameter of that layer.
at::Tensor forward_recording(torch::nn::Sequential stage, const at::Tensor& x, std::vector<WeightPart>& parts);

// Step 2: the gradient of `input` (undefined when it requires none) for root's gradient `root_grad`
// (undefined: root is a scalar loss); each part keeps its output's gradient for W.
at::Tensor backward_input(const at::Tensor& root, const at::Tensor& root_grad, const at::Tensor& input,
                          std::vector<WeightPart>& parts);

// Step 3: accumulates the weight gradients of every part into .grad, then clears `parts`.
void backward_weight(std::vector<WeightPart>& parts);

// Throws a user error naming the layers when a parameter appears in two layers of `stage`.
void check_split_backward(const torch::nn::Sequential& stage, int global_stage);

}  // namespace dtrain::pipeline
