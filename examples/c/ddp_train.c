/* ddp_train.c: data-parallel training driven through dtrain's C API alone, as a binding in another
 * language would: the model's tensors come from the binding's side (mlp_shim.h, LibTorch underneath),
 * and everything distributed is a dtrain_c_* call. Its C++ twin, ddp_train_ref.cpp, trains the same
 * model with dtrain::DistributedDataParallel; both print the parameters' hash (RESULT line, every
 * rank), which must be the same bits (ctest example_c_ddp_train_2).
 *
 *   dtrain-run --standalone --nproc_per_node 2 ./build/bin/c_ddp_train --steps 20 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dtrain_c.h"
#include "mlp_shim.h"

#define CHECK(call)                                                       \
  do {                                                                    \
    if ((call) != DTRAIN_C_OK) {                                          \
      fprintf(stderr, "c_ddp_train: error: %s\n", dtrain_c_last_error()); \
      return 1;                                                           \
    }                                                                     \
  } while (0)

static int parse_steps(int argc, char** argv) {
  int steps = 20;
  for (int i = 1; i + 1 < argc; ++i)
    if (strcmp(argv[i], "--steps") == 0) steps = atoi(argv[i + 1]);
  return steps;
}

int main(int argc, char** argv) {
  const int steps = parse_steps(argc, argv);
  if (steps < 1) {
    fprintf(stderr, "c_ddp_train: error: --steps must be >= 1\n");
    return 2;
  }
  if (dtrain_c_abi_version() != DTRAIN_C_ABI_VERSION) {
    fprintf(stderr, "c_ddp_train: error: libdtrain_c implements ABI %d, this program was built for %d\n",
            dtrain_c_abi_version(), DTRAIN_C_ABI_VERSION);
    return 1;
  }
  // doc:begin c-api
  CHECK(dtrain_c_init_process_group(NULL, NULL, -1, -1, 0));
  int rank = 0, world = 0;
  CHECK(dtrain_c_rank(&rank));
  CHECK(dtrain_c_world_size(&world));

  dtrain_c_tensor* params[MLP_PARAMS];
  if (mlp_init(1000 + (uint64_t)rank, params) != 0) return 1;
  const char* names[MLP_PARAMS] = {"fc1_weight", "fc1_bias", "fc2_weight", "fc2_bias"};
  dtrain_c_ddp_options options;
  dtrain_c_ddp_options_default(&options);
  dtrain_c_ddp* ddp = NULL;
  CHECK(dtrain_c_ddp_new(params, MLP_PARAMS, names, &options, NULL, &ddp));

  double first_loss = 0, final_loss = 0;
  for (int step = 0; step < steps; ++step) {
    CHECK(dtrain_c_ddp_forward_begin(ddp));
    dtrain_c_tensor* loss = mlp_loss(params, step, rank);
    CHECK(dtrain_c_ddp_forward_end(ddp, &loss, 1));
    const double value = mlp_backward(loss); /* the binding's autograd; DDP averages the gradients */
    mlp_free(loss);
    mlp_sgd_step(params, 0.05);
    if (step == 0) first_loss = value;
    final_loss = value;
  }
  // doc:end c-api
  /* Every rank has finished its steps before any prints (an asynchronous barrier and its handle). */
  dtrain_c_work* work = NULL;
  CHECK(dtrain_c_barrier(NULL, &work));
  CHECK(dtrain_c_work_wait(work));
  int done = 0;
  CHECK(dtrain_c_work_is_completed(work, &done));
  CHECK(dtrain_c_work_free(work));
  if (!done) {
    fprintf(stderr, "c_ddp_train: error: the barrier's work is not completed after wait\n");
    return 1;
  }
  printf("RESULT steps=%d world=%d first_loss=%.6f final_loss=%.6f params_hash=%016llx\n", steps, world, first_loss,
         final_loss, (unsigned long long)mlp_hash(params));
  CHECK(dtrain_c_ddp_free(ddp));
  for (int i = 0; i < MLP_PARAMS; ++i) mlp_free(params[i]);
  CHECK(dtrain_c_destroy_process_group());
  return 0;
}
