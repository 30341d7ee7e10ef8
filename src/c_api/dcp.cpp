// Distributed checkpoints (torch.distributed.checkpoint's folder format) of named tensors for the C
// API: each name is one flat key of the state dict, as Python's dcp.save({"name": tensor}) writes it.
// A tensor that fully_shard (dtrain_c_fsdp_new) sharded is this rank's chunk of the whole, at the
// offsets its ShardSpec says (a DTensor's Shard(0)); any other tensor is whole on every rank and
// written once.
#include <map>
#include <string>
#include <vector>

#include <ATen/core/grad_mode.h>

#include "c_api/handles.h"
#include "dtrain/dcp.h"
#include "dtrain/shard_spec.h"

namespace dtrain::capi {
namespace {

dcp::StateDict capi_dcp_entries(const char* dir, const char* const* names, dtrain_c_tensor* const* tensors, size_t n) {
  require_arg(dir && dir[0], "dir is NULL or empty: pass the checkpoint folder's path");
  require_arg(names && tensors && n > 0, dtrain::detail::cat("names or tensors is NULL, or n is ", n,
                                                             ": pass the tensors to checkpoint and their names"));
  dcp::StateDict out;
  for (const auto& [name, given] : named_args(names, tensors, n)) {
    const at::Tensor t = given.detach();  // the same storage: a load writes into the caller's tensor
    // As dcp::get_state_dict places a model's parameters: a 0-dim tensor stays whole (DCP has no
    // chunk of one), and a rank whose part is empty (the last ranks of a short one) writes none.
    const std::optional<ShardSpec> spec = shard_spec_of(given);  // the parameter's own, not a detached one
    if (!spec || !spec->is_sharded() || spec->full_shape().empty())
      out.push_back(dcp::Entry::whole({name}, t));
    else if (!spec->holds_nothing() && t.numel() > 0)
      out.push_back(dcp::Entry::chunk({name}, t, spec->full_shape(), spec->offsets()));
  }
  return out;
}

// Saves or loads, as one collective over the group, the named tensors.
void capi_dcp_run(const char* dir, const char* const* names, dtrain_c_tensor* const* tensors, size_t n,
                  dtrain_c_group* group, bool save) {
  require_init();
  const Group g = group_arg(group);
  dcp::StateDict state = capi_dcp_entries(dir, names, tensors, n);
  at::NoGradGuard no_grad;
  if (save)
    dcp::save(state, dir, g);
  else
    dcp::load(state, dir, g);
}

}  // namespace
}  // namespace dtrain::capi

using namespace dtrain;
using namespace dtrain::capi;

extern "C" {

dtrain_c_status dtrain_c_dcp_save(const char* dir, const char* const* names, dtrain_c_tensor* const* tensors, size_t n,
                                  dtrain_c_group* group) {
  return entry(__func__, DTRAIN_C_IO_ERROR, [&] { capi_dcp_run(dir, names, tensors, n, group, true); });
}

dtrain_c_status dtrain_c_dcp_load(const char* dir, const char* const* names, dtrain_c_tensor* const* tensors, size_t n,
                                  dtrain_c_group* group) {
  return entry(__func__, DTRAIN_C_IO_ERROR, [&] { capi_dcp_run(dir, names, tensors, n, group, false); });
}

}  // extern "C"
