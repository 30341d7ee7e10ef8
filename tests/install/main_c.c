/* The smallest C user of an installed libdtrain_c: a C compiler, dtrain_c.h and dtrain::dtrain_c only
 * (no LibTorch header). Init from the launcher's environment, a barrier, print OK. */
#include <stdio.h>

#include "dtrain_c.h"

static int check(dtrain_c_status status, const char* what) {
  if (status != DTRAIN_C_OK) fprintf(stderr, "consumer_c: error: %s: %s\n", what, dtrain_c_last_error());
  return status == DTRAIN_C_OK;
}

int main(void) {
  int rank = -1, world = -1;
  if (dtrain_c_abi_version() != DTRAIN_C_ABI_VERSION) {
    fprintf(stderr, "consumer_c: error: the library's ABI is %d, this program's %d\n", dtrain_c_abi_version(),
            DTRAIN_C_ABI_VERSION);
    return 1;
  }
  if (!check(dtrain_c_init_process_group(NULL, NULL, -1, -1, 0), "init") || !check(dtrain_c_rank(&rank), "rank") ||
      !check(dtrain_c_world_size(&world), "world_size") || !check(dtrain_c_barrier(NULL, NULL), "barrier") ||
      !check(dtrain_c_destroy_process_group(), "destroy"))
    return 1;
  printf("consumer_c OK: rank %d of %d\n", rank, world);
  return 0;
}
