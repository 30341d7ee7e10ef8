// What the C++ programs of the tests against a Python reference share (harness.py's
// run_against_python): the values both languages compute alike, and the main that writes, on every
// rank, the JSON the test compares: `NAME OUT.json`, env:// from the launcher.
#pragma once

#include <exception>
#include <fstream>
#include <functional>
#include <iostream>
#include <string>

#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/types.h>

#include "dtrain/process_group.h"

// Values both languages compute alike (no random generator is shared between them); reference_util.py
// has the same.
inline at::Tensor wave(int64_t n, double scale, double freq, double phase) {
  return at::arange(n, at::kDouble).mul(freq).add(phase).sin().mul(scale);
}

// The k-th parameter of `m` (k = 0, 1, ...) becomes wave(numel, 0.3, 0.7, 1.3 k): the Python
// references' make_model().
inline void fill_with_waves(torch::nn::Module& m) {
  torch::NoGradGuard no_grad;
  int k = 0;
  for (auto& p : m.parameters()) {
    p.copy_(wave(p.numel(), 0.3, 0.7, 1.3 * k).view(p.sizes()));
    ++k;
  }
}

// Runs `run` (which returns this rank's JSON) inside the default process group and writes its JSON
// to argv[1]; a failure is one line on stderr and exit status 1.
inline int reference_main(int argc, char** argv, const std::string& name, const std::function<std::string()>& run) {
  if (argc != 2) {
    std::cerr << "usage: " << name << " OUT.json\n";
    return 2;
  }
  try {
    dtrain::init_process_group();
    const std::string json = run();
    std::ofstream(argv[1]) << json << "\n";
    dtrain::destroy_process_group();
  } catch (const std::exception& e) {
    std::cerr << name << ": error: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
