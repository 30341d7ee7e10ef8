// A parallel style as parallelize_module binds it to one layer: resolved layouts, the group, and the
// part of the sharded dimension this rank holds.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "dtrain/tensor_parallel.h"

namespace dtrain::tp {

struct Applied {
  bool colwise = true;  // else rowwise
  Layout input, output;
  Group group;
  int64_t size = 0;               // the sharded dimension's whole size
  int64_t start = 0, length = 0;  // this rank's rows or columns of it
};

// SequenceParallel on `module` (src/tp/sequence.cpp): its parameters broadcast from group rank 0,
// each with a gradient hook that sums the gradient over the group.
void apply_sequence_parallel(const std::string& name, torch::nn::Module& module, const Group& group);
// A PrepareModuleInput or PrepareModuleOutput of `module`, for prepare_input / prepare_output.
void record_prepare(const std::string& name, const std::shared_ptr<torch::nn::Module>& module,
                    const ParallelStyle& style, const Group& group);

}  // namespace dtrain::tp

namespace dtrain::detail {

// The layers' style, private to users: parallelize_module sets it, their forward reads it.
struct TensorParallelAccess {
  static std::shared_ptr<tp::Applied>& applied(ParallelLinearImpl& m) { return m.applied_; }
  static std::shared_ptr<tp::Applied>& applied(ParallelEmbeddingImpl& m) { return m.applied_; }
};

}  // namespace dtrain::detail
