// The C++ side of test_safetensors.py: reads a .safetensors file with dtrain and writes it back.
//   safetensors_tool IN OUT    load_safetensors(IN), then save_safetensors of its tensors and
//                              metadata to OUT; a bad IN is one line on stderr and exit 1
#include <iostream>

#include "dtrain/safetensors.h"

int main(int argc, char** argv) {
  if (argc != 3) {
    std::cerr << "usage: safetensors_tool IN OUT\n";
    return 2;
  }
  try {
    const dtrain::SafetensorsFile f = dtrain::load_safetensors(argv[1]);
    dtrain::save_safetensors(f.tensors, argv[2], f.metadata);
  } catch (const std::exception& e) {
    std::cerr << "safetensors_tool: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
