// What a LibTorch binding does on its own side (tch-rs, TorchSharp): make tensors, run forward and
// backward with LibTorch's autograd, step an optimizer. Exposed to ddp_train.c as plain C.
#include <cstdio>
#include <exception>

#include "mlp_common.h"
#include "mlp_shim.h"

namespace {
at::Tensor& shim_tensor(dtrain_c_tensor* t) { return *reinterpret_cast<at::Tensor*>(t); }
dtrain_c_tensor* shim_handle(at::Tensor t) { return reinterpret_cast<dtrain_c_tensor*>(new at::Tensor(std::move(t))); }
std::vector<at::Tensor> shim_params(dtrain_c_tensor* const params[MLP_PARAMS]) {
  std::vector<at::Tensor> p;
  for (int i = 0; i < MLP_PARAMS; ++i) p.push_back(shim_tensor(params[i]));
  return p;
}
}  // namespace

extern "C" {

int mlp_init(uint64_t seed, dtrain_c_tensor* params[MLP_PARAMS]) {
  try {
    auto p = mlp::init_params(seed);
    for (int i = 0; i < MLP_PARAMS; ++i) params[i] = shim_handle(p[i]);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "mlp_init: %s\n", e.what());
    return -1;
  }
}

dtrain_c_tensor* mlp_loss(dtrain_c_tensor* const params[MLP_PARAMS], int step, int rank) {
  return shim_handle(mlp::loss(shim_params(params), step, rank));
}

double mlp_backward(dtrain_c_tensor* loss) {
  shim_tensor(loss).backward();
  return shim_tensor(loss).item<double>();
}

void mlp_sgd_step(dtrain_c_tensor* const params[MLP_PARAMS], double lr) { mlp::sgd_step(shim_params(params), lr); }

uint64_t mlp_hash(dtrain_c_tensor* const params[MLP_PARAMS]) { return mlp::hash(shim_params(params)); }

void mlp_free(dtrain_c_tensor* tensor) { delete reinterpret_cast<at::Tensor*>(tensor); }

}  // extern "C"
