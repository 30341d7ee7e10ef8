// Optimizer archives on any device: LibTorch's Optimizer::load reads the parameter lists of its
// archive through a CPU accessor, so an archive whose tensors were saved from a GPU (and parsed
// back onto it) faults inside load. Every optimizer archive dtrain reads is therefore parsed onto
// the CPU and each parameter's state moved afterwards to that parameter's own device, as PyTorch's
// Optimizer.load_state_dict casts state to its parameter's device.
//
//   torch::serialize::InputArchive a = dtrain::optim_state::parse_on_cpu(bytes);
//   dtrain::optim_state::load_onto_param_devices(adam, a);  // exp_avg on the device of its parameter
#pragma once

#include <string>

#include <torch/optim/optimizer.h>
#include <torch/serialize/input-archive.h>

namespace dtrain::optim_state {

// `bytes` (a torch archive) parsed with every tensor on the CPU.
torch::serialize::InputArchive parse_on_cpu(const std::string& bytes);

// o.load(archive) for an archive parsed onto the CPU, then move_to_param_devices(o).
void load_onto_param_devices(torch::optim::Optimizer& o, torch::serialize::InputArchive& archive);

// Moves every tensor of each parameter's state (Adam's moments, SGD's momentum) to the device of
// that parameter; scalars such as a step count are left as they are.
void move_to_param_devices(torch::optim::Optimizer& o);

}  // namespace dtrain::optim_state
