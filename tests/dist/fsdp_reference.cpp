// The C++ side of test_fsdp_pytorch.py: trains a Sequential of three Linears under fully_shard on
// this rank's part of deterministic batches (float64, SGD with momentum, then Adam), exactly as
// fsdp_reference.py does with PyTorch's own fully_shard, and writes what the test compares:
// each parameter's local shard shape right after sharding and every whole parameter after 20 steps.
// With FSDP_REFERENCE_HSDP=1 (4 ranks), HSDP: every unit on a {replicate 2, shard 2} mesh.
//   fsdp_reference OUT.json   (run on every rank, env:// from the launcher)
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adam.h>
#include <torch/optim/sgd.h>

#include <cstdlib>
#include <iomanip>
#include <limits>
#include <sstream>

#include "dtrain/device_mesh.h"
#include "dtrain/fsdp.h"
#include "dtrain/process_group.h"
#include "reference_program.h"

namespace {

constexpr int kSteps = 20, kBatch = 12;

torch::nn::Sequential make_model() {
  torch::nn::Sequential m(torch::nn::Linear(8, 13), torch::nn::Tanh(), torch::nn::Linear(13, 5), torch::nn::Tanh(),
                          torch::nn::Linear(5, 3));
  m->to(at::kDouble);
  fill_with_waves(*m);
  return m;
}

std::string json_list(const at::Tensor& t) {
  std::ostringstream s;
  s << std::setprecision(std::numeric_limits<double>::max_digits10) << "[";
  at::Tensor flat = t.reshape({-1}).contiguous();
  for (int64_t i = 0; i < flat.numel(); ++i) s << (i ? ", " : "") << flat[i].item<double>();
  return s.str() + "]";
}

std::string train(const std::string& kind, const dtrain::FullyShardOptions& options) {
  auto model = make_model();
  // doc:begin fully_shard
  for (auto& layer : *model)  // each Linear of the Sequential becomes a unit
    if (!layer.ptr()->parameters().empty()) dtrain::fully_shard(layer, options);
  auto fsdp = dtrain::fully_shard(model.ptr(), options);  // the root, last
  // doc:end fully_shard
  std::ostringstream shapes;
  bool first = true;
  for (const auto& kv : model->named_parameters()) {
    shapes << (first ? "" : ", ") << "\"" << kv.key() << "\": " << kv.value().sizes();
    first = false;
  }
  std::unique_ptr<torch::optim::Optimizer> opt;
  if (kind == "sgd")
    opt = std::make_unique<torch::optim::SGD>(model->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  else
    opt = std::make_unique<torch::optim::Adam>(model->parameters(), torch::optim::AdamOptions(1e-2));
  const int n = dtrain::world_size(), r = dtrain::rank();
  for (int s = 0; s < kSteps; ++s) {
    at::Tensor x = wave(kBatch * 8, 1.0, 0.1, 0.97 * s).view({kBatch, 8}).chunk(n)[r];
    at::Tensor y = wave(kBatch * 3, 1.0, 0.05, 0.31 * s + 1.5).view({kBatch, 3}).chunk(n)[r];
    opt->zero_grad();
    (fsdp(x) - y).pow(2).mean().backward();
    opt->step();
  }
  std::ostringstream params;
  first = true;
  for (const auto& [name, t] : fsdp.full_state_dict()) {
    params << (first ? "" : ", ") << "\"" << name << "\": " << json_list(t);
    first = false;
  }
  return "{\"shapes\": {" + shapes.str() + "}, \"params\": {" + params.str() + "}}";
}

}  // namespace

int main(int argc, char** argv) {
  return reference_main(argc, argv, "fsdp_reference", [] {
    dtrain::FullyShardOptions options;
    const char* hsdp = std::getenv("FSDP_REFERENCE_HSDP");
    if (hsdp && std::string(hsdp) == "1") options.mesh(dtrain::init_device_mesh({2, 2}, {"replicate", "shard"}));
    const std::string sgd = train("sgd", options), adam = train("adam", options);
    return "{\"sgd\": " + sgd + ", \"adam\": " + adam + "}";
  });
}
