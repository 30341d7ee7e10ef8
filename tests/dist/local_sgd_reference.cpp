// The C++ side of test_local_sgd_pytorch.py: dtrain::LocalSGD and dtrain::DiLoCo on a small float64
// MLP, each replica (rank) on its own deterministic batches, exactly as local_sgd_reference.py runs
// torchft's algorithms on torch.distributed; writes every parameter after 200 steps of
//   localsgd:   SGD (lr 0.05, momentum 0.9), LocalSGD sync_every 5;
//   diloco:     inner AdamW (lr 1e-2), outer SGD (lr 0.7, momentum 0.9, Nesterov), sync_every 5;
//   diloco_sgd: the same with inner SGD (lr 0.05, momentum 0.9);
//   streaming:  DiLoCo with 2 fragments (one per Linear), an outer SGD each, sync_every 4;
//   streaming_delay: the same with sync_every 8 and fragment_sync_delay 3 (the all-reduce in flight
//               over 3 inner steps);
//   diloco_delay_alpha: inner SGD, sync_every 5, fragment_sync_delay 2, fragment_update_alpha 0.25;
//   diloco_bf16: diloco with the pseudo-gradient summed in bfloat16 (reduce_dtype).
//   local_sgd_reference OUT.json   (run on every rank, env:// from the launcher)
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include <iomanip>
#include <limits>
#include <memory>
#include <sstream>

#include "dtrain/local_sgd.h"
#include "dtrain/process_group.h"
#include "reference_program.h"

namespace {

constexpr int kSteps = 200, kBatch = 8;

torch::nn::Sequential make_model() {
  torch::nn::Sequential m(torch::nn::Linear(6, 10), torch::nn::Tanh(), torch::nn::Linear(10, 4));
  m->to(at::kDouble);
  fill_with_waves(*m);
  return m;
}

void inner_step(torch::nn::Sequential& model, torch::optim::Optimizer& opt, int s) {
  const int r = dtrain::rank();
  at::Tensor x = wave(kBatch * 6, 1.0, 0.1, 0.97 * s + 2.1 * r).view({kBatch, 6});
  at::Tensor y = wave(kBatch * 4, 1.0, 0.05, 0.31 * s + 1.5 + 0.7 * r).view({kBatch, 4});
  opt.zero_grad();
  (model->forward(x) - y).pow(2).mean().backward();
  opt.step();
}

std::string dump(const torch::nn::Sequential& model) {
  std::ostringstream s;
  s << std::setprecision(std::numeric_limits<double>::max_digits10) << "{\"params\": {";
  bool first = true;
  for (const auto& kv : model->named_parameters()) {
    at::Tensor flat = kv.value().detach().reshape({-1}).contiguous();
    s << (first ? "" : ", ") << "\"" << kv.key() << "\": [";
    for (int64_t i = 0; i < flat.numel(); ++i) s << (i ? ", " : "") << flat[i].item<double>();
    s << "]";
    first = false;
  }
  return s.str() + "}}";
}

std::string local_sgd() {
  auto model = make_model();
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  dtrain::LocalSGD local(model->parameters(), /*sync_every=*/5);
  for (int s = 0; s < kSteps; ++s) {
    inner_step(model, opt, s);
    local.step();
  }
  return dump(model);
}

torch::optim::SGDOptions outer_options() { return torch::optim::SGDOptions(0.7).momentum(0.9).nesterov(true); }

std::string diloco(bool adamw, dtrain::DiLoCoOptions options = {}) {
  auto model = make_model();
  std::unique_ptr<torch::optim::Optimizer> inner;
  if (adamw)
    inner = std::make_unique<torch::optim::AdamW>(model->parameters(), torch::optim::AdamWOptions(1e-2));
  else
    inner = std::make_unique<torch::optim::SGD>(model->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  torch::optim::SGD outer(model->parameters(), outer_options());
  dtrain::DiLoCo diloco(model->parameters(), *inner, outer, /*sync_every=*/5, dtrain::Group(), options);
  for (int s = 0; s < kSteps; ++s) {
    inner_step(model, *inner, s);
    diloco.step();
  }
  return dump(model);
}

std::string streaming(int64_t sync_every, dtrain::DiLoCoOptions options) {
  auto model = make_model();
  torch::optim::AdamW inner(model->parameters(), torch::optim::AdamWOptions(1e-2));
  std::vector<std::vector<at::Tensor>> fragments = {model[0]->parameters(), model[2]->parameters()};
  torch::optim::SGD outer0(fragments[0], outer_options()), outer1(fragments[1], outer_options());
  dtrain::DiLoCo diloco(fragments, inner, {&outer0, &outer1}, sync_every, dtrain::Group(), options);
  for (int s = 0; s < kSteps; ++s) {
    inner_step(model, inner, s);
    diloco.step();
  }
  return dump(model);
}

// Inner SGD, the sync started 2 steps before its point, a quarter of the replica's own kept.
std::string diloco_delay_alpha() {
  auto model = make_model();
  torch::optim::SGD inner(model->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  torch::optim::SGD outer(model->parameters(), outer_options());
  dtrain::DiLoCo diloco(model->parameters(), inner, outer, /*sync_every=*/5, dtrain::Group(),
                        dtrain::DiLoCoOptions().fragment_sync_delay(2).fragment_update_alpha(0.25));
  for (int s = 0; s < kSteps; ++s) {
    inner_step(model, inner, s);
    diloco.step();
  }
  return dump(model);
}

}  // namespace

int main(int argc, char** argv) {
  return reference_main(argc, argv, "local_sgd_reference", [] {
    const std::string a = local_sgd(), b = diloco(true), c = diloco(false), d = streaming(4, {}),
                      e = streaming(8, dtrain::DiLoCoOptions().fragment_sync_delay(3)), f = diloco_delay_alpha(),
                      g = diloco(true, dtrain::DiLoCoOptions().reduce_dtype(at::kBFloat16));
    return "{\"localsgd\": " + a + ", \"diloco\": " + b + ", \"diloco_sgd\": " + c + ", \"streaming\": " + d +
           ", \"streaming_delay\": " + e + ", \"diloco_delay_alpha\": " + f + ", \"diloco_bf16\": " + g + "}";
  });
}
