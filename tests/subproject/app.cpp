// Only configured by the subproject check, never built: a program linking dtrain::dtrain.
#include "dtrain/dtrain.h"

int main() {
  dtrain::init_process_group();
  dtrain::destroy_process_group();
  return 0;
}
