// The smallest outside user of an installed dtrain: init from the environment (dtrain-run, torchrun,
// mpirun, srun or RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT), all_reduce, check, print OK.
#include <cstdio>
#include <exception>

#include <ATen/ATen.h>

#include "dtrain/dtrain.h"

int main() {
  try {
    dtrain::init_process_group();
    const int n = dtrain::world_size();
    at::Tensor t = at::full({8}, dtrain::rank() + 1.0f);  // (8,)
    dtrain::all_reduce(t);
    const float expected = n * (n + 1) / 2.0f;
    if (!at::allclose(t, at::full({8}, expected))) {
      std::fprintf(stderr, "consumer: error: rank %d: all_reduce gave %f, expected %f\n", dtrain::rank(),
                   t[0].item<float>(), expected);
      return 1;
    }
    std::printf("consumer OK: rank %d of %d, sum %.0f\n", dtrain::rank(), n, expected);
    dtrain::destroy_process_group();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "consumer: error: %s\n", e.what());
    return 1;
  }
  return 0;
}
