// Failure injection for the pipeline tests: layers that throw in a chosen stage's forward, backward or
// weight gradient, on a chosen micro-batch call, inside otherwise unchanged stages.
#pragma once

#include <stdexcept>
#include <string>
#include <vector>

#include <torch/autograd.h>
#include <torch/nn/modules/container/functional.h>

#include "dtrain/data_parallel.h"  // balance_by_size
#include "pipeline_models.h"

namespace dtrain::test_pipeline {

// The (global) stage that throws, where, and on which call.
struct Injection {
  int stage = -1;
  enum Where { kForward, kBackward, kLoss, kWeight } where = kForward;
  int on_call = 0;  // throw on this micro-batch call of the step (0-based)
  int calls = 0;
};
inline Injection g_inject;

// Identity in forward; throws in backward when armed (a failure inside autograd).
struct ThrowInBackward : torch::autograd::Function<ThrowInBackward> {
  static at::Tensor forward(torch::autograd::AutogradContext*, const at::Tensor& x) { return x.clone(); }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext*, torch::autograd::variable_list g) {
    throw std::runtime_error("injected backward failure");
    return g;
  }
};

// A layer that is the identity unless the injection targets its stage.
inline torch::nn::Functional injector(int stage) {
  return torch::nn::Functional([stage](at::Tensor x) {
    if (g_inject.stage != stage || g_inject.where == Injection::kWeight) return x;
    const int call = g_inject.calls++;
    if (call != g_inject.on_call) return x;
    if (g_inject.where == Injection::kForward)
      throw std::runtime_error("injected forward failure in stage " + std::to_string(stage));
    if (g_inject.where == Injection::kBackward) return ThrowInBackward::apply(x);
    return x;
  });
}

// The model of make_model(linears) as p * v stage modules (split as balance_by_size does), with an
// injector after the first layer of every stage and a hook on the stage's first parameter that throws
// for kWeight.
inline std::vector<torch::nn::Sequential> injectable_stages(int stages, int linears = 3) {
  torch::nn::Sequential whole = make_model(linears);
  std::vector<int64_t> sizes;
  for (const auto& layer : *whole) {
    int64_t n = 0;
    for (const auto& p : layer.ptr()->parameters()) n += p.numel();
    sizes.push_back(n);
  }
  const std::vector<int64_t> bal = balance_by_size(sizes, stages);
  std::vector<torch::nn::Sequential> out;
  int64_t k = 0;
  for (int s = 0; s < stages; ++s) {
    torch::nn::Sequential st;
    bool hooked = false;
    for (int64_t j = 0; j < bal[s]; ++j, ++k) {
      const auto& layer = *(whole->begin() + k);
      st->push_back(layer);
      if (j == 0) st->push_back(injector(s));
      for (auto& p : layer.ptr()->parameters()) {
        if (hooked) break;
        hooked = true;  // one hook per stage, on its first parameter
        p.register_hook([s](const at::Tensor& g) {
          if (g_inject.stage == s && g_inject.where == Injection::kWeight && g_inject.calls++ == g_inject.on_call)
            throw std::runtime_error("injected weight gradient failure");
          return g;
        });
      }
    }
    out.push_back(st);
  }
  return out;
}

}  // namespace dtrain::test_pipeline
