// dtrain's CheckpointManager over named tensors for the C API. The manager saves a TrainingState,
// whose model is a torch::nn::Module: the caller's tensors are registered as the parameters of a tree
// of empty modules (a name's '.'-separated parts its path), the same tensors, so a load writes into
// them. The state is marked a model part, so every rank writes its tensors into the checkpoint's DCP
// folder as dtrain_c_dcp_save does (whole tensors once, fully_shard's shards as their chunks), the
// folder Python's torch.distributed.checkpoint reads, and the manager's main file keeps the step,
// the RNG states and the manifest it checks a load against. Rotation, the atomic write, the CRC
// checks, the fallback to an older checkpoint and the background write are the manager's own.
#include <memory>
#include <string>
#include <vector>

#include <torch/nn/module.h>

#include "c_api/handles.h"
#include "dtrain/checkpoint.h"

namespace dtrain::capi {
namespace {

struct CkptNode : torch::nn::Module {};

struct CheckpointObject : Object {
  std::unique_ptr<CheckpointManager> manager;
  int64_t interval = 1;
  bool rng = true;
  std::shared_ptr<CkptNode> last_model;  // the last save's tree, kept while a background save may read it
};

std::shared_ptr<CheckpointObject> checkpoint_of(dtrain_c_checkpoint* checkpoint) {
  return get_handle<CheckpointObject>(checkpoint, Kind::kCheckpoint, "checkpoint");
}

std::vector<std::string> ckpt_name_parts(const std::string& name) {
  std::vector<std::string> parts(1);
  for (char c : name) {
    if (c == '.')
      parts.emplace_back();
    else
      parts.back() += c;
  }
  for (const std::string& part : parts)
    require_arg(!part.empty(), dtrain::detail::cat("name '", name, "' has an empty part between its dots: ",
                                                   "name a tensor as a module's state_dict does ('fc1.weight')"));
  return parts;
}

// The module tree holding the named tensors as its parameters, under their names.
std::shared_ptr<CkptNode> ckpt_model(const std::vector<std::pair<std::string, at::Tensor>>& named) {
  auto root = std::make_shared<CkptNode>();
  for (const auto& [name, tensor] : named) {
    const std::vector<std::string> parts = ckpt_name_parts(name);
    torch::nn::Module* node = root.get();
    for (size_t k = 0; k + 1 < parts.size(); ++k) {
      require_arg(!node->named_parameters(false).contains(parts[k]),
                  dtrain::detail::cat("name '", name, "' goes inside '", parts[k],
                                      "', which another name is: a name is a tensor or a prefix of others, not both"));
      // named_children() returns its dict by value: keep it while its item is used.
      const auto children = node->named_children();
      const auto* child = children.find(parts[k]);
      node = child ? child->get() : node->register_module(parts[k], std::make_shared<CkptNode>()).get();
    }
    require_arg(!node->named_children().contains(parts.back()),
                dtrain::detail::cat("name '", name,
                                    "' is also the prefix of other names: a name is a tensor or a prefix, not both"));
    node->register_parameter(parts.back(), tensor, tensor.requires_grad());
  }
  return root;
}

std::shared_ptr<CkptNode> ckpt_model_args(const char* const* names, dtrain_c_tensor* const* tensors, size_t n) {
  require_arg(names && tensors && n > 0, dtrain::detail::cat("names or tensors is NULL, or n is ", n,
                                                             ": pass the tensors to checkpoint and their names"));
  return ckpt_model(named_args(names, tensors, n));
}

void ckpt_save(dtrain_c_checkpoint* checkpoint, int64_t step, const char* const* names, dtrain_c_tensor* const* tensors,
               size_t n, int* saved, bool background) {
  auto object = checkpoint_of(checkpoint);
  require_arg(step >= 0, dtrain::detail::cat("step is ", step, ": pass the steps done, >= 0"));
  std::shared_ptr<CkptNode> model = ckpt_model_args(names, tensors, n);
  require_init();
  if (saved) *saved = 0;
  if (step % object->interval != 0) return;
  TrainingState st;
  st.model = model.get();
  st.model_part = true;  // every rank writes its own tensors into the DCP folder
  st.step = step;
  st.rng = object->rng;
  if (background)
    object->manager->save_async(st);
  else
    object->manager->save(st);
  object->last_model = std::move(model);
  if (saved) *saved = 1;
}

}  // namespace
}  // namespace dtrain::capi

using namespace dtrain;
using namespace dtrain::capi;

extern "C" {

void dtrain_c_checkpoint_options_default(dtrain_c_checkpoint_options* options) {
  if (!options) return;
  const CheckpointOptions d;
  options->struct_size = sizeof(dtrain_c_checkpoint_options);
  options->keep = d.keep();
  options->interval = 1;
  options->rng = 1;
}

dtrain_c_status dtrain_c_checkpoint_new(const char* dir, const dtrain_c_checkpoint_options* options,
                                        dtrain_c_checkpoint** out) {
  return entry(__func__, DTRAIN_C_IO_ERROR, [&] {
    require_arg(out, "out is NULL: pass where to store the checkpoint handle");
    require_arg(dir && dir[0], "dir is NULL or empty: pass the checkpoints' folder");
    dtrain_c_checkpoint_options o;
    dtrain_c_checkpoint_options_default(&o);
    if (options) {
      require_arg(options->struct_size >= sizeof(dtrain_c_checkpoint_options),
                  dtrain::detail::cat("options->struct_size is ", options->struct_size,
                                      ": fill the options with dtrain_c_checkpoint_options_default first"));
      require_arg(options->keep >= 1,
                  dtrain::detail::cat("options->keep is ", options->keep,
                                      ": keep at least 1 checkpoint (2 keeps one to fall back to)"));
      require_arg(options->interval >= 1, dtrain::detail::cat("options->interval is ", options->interval,
                                                              ": pass 1 to save at every step given, or more"));
      o = *options;
    }
    auto object = std::make_shared<CheckpointObject>();
    object->manager = std::make_unique<CheckpointManager>(dir, CheckpointOptions().keep(o.keep));
    object->interval = o.interval;
    object->rng = o.rng != 0;
    *out = static_cast<dtrain_c_checkpoint*>(add_handle(Kind::kCheckpoint, std::move(object)));
  });
}

dtrain_c_status dtrain_c_checkpoint_save(dtrain_c_checkpoint* checkpoint, int64_t step, const char* const* names,
                                         dtrain_c_tensor* const* tensors, size_t n, int* saved) {
  return entry(__func__, DTRAIN_C_IO_ERROR, [&] { ckpt_save(checkpoint, step, names, tensors, n, saved, false); });
}

dtrain_c_status dtrain_c_checkpoint_save_async(dtrain_c_checkpoint* checkpoint, int64_t step, const char* const* names,
                                               dtrain_c_tensor* const* tensors, size_t n, int* saved) {
  return entry(__func__, DTRAIN_C_IO_ERROR, [&] { ckpt_save(checkpoint, step, names, tensors, n, saved, true); });
}

dtrain_c_status dtrain_c_checkpoint_wait(dtrain_c_checkpoint* checkpoint) {
  return entry(__func__, DTRAIN_C_IO_ERROR, [&] {
    auto object = checkpoint_of(checkpoint);
    require_init();
    object->manager->wait();
  });
}

dtrain_c_status dtrain_c_checkpoint_load_latest(dtrain_c_checkpoint* checkpoint, const char* const* names,
                                                dtrain_c_tensor* const* tensors, size_t n, int64_t* step, int* found) {
  return entry(__func__, DTRAIN_C_IO_ERROR, [&] {
    auto object = checkpoint_of(checkpoint);
    require_arg(found, "found is NULL: pass where to store whether a checkpoint was loaded");
    std::shared_ptr<CkptNode> model = ckpt_model_args(names, tensors, n);
    require_init();
    TrainingState st;
    st.model = model.get();
    st.model_part = true;
    st.rng = object->rng;
    *found = object->manager->load_latest(st) ? 1 : 0;
    if (*found && step) *step = st.step;
  });
}

dtrain_c_status dtrain_c_checkpoint_free(dtrain_c_checkpoint* checkpoint) {
  return entry(__func__, DTRAIN_C_INTERNAL_ERROR, [&] { remove_handle(checkpoint, Kind::kCheckpoint, "checkpoint"); });
}

}  // extern "C"
