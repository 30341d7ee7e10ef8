// Optimizer state onto its parameters' devices (see state_device.h).
#include "optim/state_device.h"

#include <sstream>

#include <torch/serialize/output-archive.h>

#include "compat/optim_compat.h"

namespace dtrain::optim_state {

torch::serialize::InputArchive parse_on_cpu(const std::string& bytes) {
  torch::serialize::InputArchive a;
  // c10::optional is not std::optional before LibTorch 2.4.
  a.load_from(bytes.data(), bytes.size(), c10::optional<at::Device>(at::Device(at::kCPU)));
  return a;
}

void load_onto_param_devices(torch::optim::Optimizer& o, torch::serialize::InputArchive& archive) {
  o.load(archive);
  compat::restore_param_group_options(o, archive);  // the saved lr, as LibTorch 2.x's load() has it
  move_to_param_devices(o);
}

void move_to_param_devices(torch::optim::Optimizer& o) {
  for (const auto& group : o.param_groups())
    for (const at::Tensor& p : group.params()) {
      if (p.device().is_cpu()) continue;  // its state was read onto the CPU already
      auto it = o.state().find(compat::optimizer_state_key(p));
      if (it == o.state().end()) continue;
      // Through the state's own serialize(), the one interface every optimizer's state has:
      // written out, then read back with the parameter's device as the map location.
      torch::serialize::OutputArchive out;
      it->second->serialize(out);
      std::ostringstream bytes;
      out.save_to(bytes);
      const std::string s = bytes.str();
      torch::serialize::InputArchive in;
      in.load_from(s.data(), s.size(), c10::optional<at::Device>(p.device()));
      it->second->serialize(in);
    }
}

}  // namespace dtrain::optim_state
