// ddp_train_ref: ddp_train.c's training in C++ with dtrain::DistributedDataParallel over a module that
// holds the same parameters: the parameters' hash it prints must equal the C program's (ctest
// example_c_ddp_train_2).
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include <torch/nn/module.h>

#include "dtrain/ddp.h"
#include "dtrain/process_group.h"
#include "mlp_common.h"

namespace {

struct RefMlp : torch::nn::Module {
  explicit RefMlp(uint64_t seed) {
    const char* names[] = {"fc1_weight", "fc1_bias", "fc2_weight", "fc2_bias"};
    auto p = mlp::init_params(seed);
    for (size_t i = 0; i < p.size(); ++i) params.push_back(register_parameter(names[i], p[i]));
  }
  at::Tensor forward(int step, int rank) { return mlp::loss(params, step, rank); }
  std::vector<at::Tensor> params;
};

}  // namespace

int main(int argc, char** argv) {
  int steps = 20;
  for (int i = 1; i + 1 < argc; ++i)
    if (std::strcmp(argv[i], "--steps") == 0) steps = std::atoi(argv[i + 1]);
  try {
    dtrain::init_process_group();
    const int rank = dtrain::rank();
    auto model = std::make_shared<RefMlp>(1000 + static_cast<uint64_t>(rank));
    dtrain::DistributedDataParallel ddp(model);
    double first_loss = 0, final_loss = 0;
    for (int step = 0; step < steps; ++step) {
      at::Tensor loss = ddp(step, rank);
      loss.backward();
      mlp::sgd_step(model->params, 0.05);
      const double value = loss.item<double>();
      if (step == 0) first_loss = value;
      final_loss = value;
    }
    dtrain::barrier();
    std::printf("RESULT steps=%d world=%d first_loss=%.6f final_loss=%.6f params_hash=%016llx\n", steps,
                dtrain::world_size(), first_loss, final_loss,
                static_cast<unsigned long long>(mlp::hash(model->params)));
    dtrain::destroy_process_group();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ddp_train_ref: error: %s\n", e.what());
    return 1;
  }
  return 0;
}
