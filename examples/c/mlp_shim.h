/* The binding's side of examples/c/ddp_train.c: what a language binding of LibTorch already has
 * (tensors, autograd, an optimizer), reduced to a 2-layer MLP. Its tensors are at::Tensor*, the
 * handles dtrain_c.h takes. */
#ifndef MLP_SHIM_H
#define MLP_SHIM_H

#include <stddef.h>
#include <stdint.h>

#include "dtrain_c.h"

#ifdef __cplusplus
extern "C" {
#endif

#define MLP_PARAMS 4 /* fc1.weight, fc1.bias, fc2.weight, fc2.bias */

/* New parameters drawn from seed (requires_grad). Returns 0, or -1 with a message on stderr. */
int mlp_init(uint64_t seed, dtrain_c_tensor* params[MLP_PARAMS]);
/* The loss of the step's batch for this rank (a new tensor; free it with mlp_free). */
dtrain_c_tensor* mlp_loss(dtrain_c_tensor* const params[MLP_PARAMS], int step, int rank);
/* loss.backward(); returns the loss's value. */
double mlp_backward(dtrain_c_tensor* loss);
/* Plain SGD: p -= lr * p.grad, then the gradients are set to none (zero_grad). */
void mlp_sgd_step(dtrain_c_tensor* const params[MLP_PARAMS], double lr);
/* FNV-1a over the parameters' bytes. */
uint64_t mlp_hash(dtrain_c_tensor* const params[MLP_PARAMS]);
void mlp_free(dtrain_c_tensor* tensor);

#ifdef __cplusplus
}
#endif

#endif /* MLP_SHIM_H */
