// DistributedDataParallel over parameters a binding owns. dtrain's DDP wraps a torch::nn::Module, so
// the caller's tensors are registered as the parameters of a module of their own: the module holds
// the same tensors (storage and autograd state shared, nothing copied), so DDP's hooks on their
// gradient accumulators fire when the binding's autograd runs backward, and the broadcast of rank 0's
// values at construction writes into the caller's tensors.
#include <string>
#include <vector>

#include <torch/nn/module.h>

#include "c_api/handles.h"
#include "dtrain/ddp.h"

namespace dtrain::capi {
namespace {

struct CapiParamModule : torch::nn::Module {
  CapiParamModule(const std::vector<at::Tensor>& params, const std::vector<std::string>& names) {
    for (size_t i = 0; i < params.size(); ++i) register_parameter(names[i], params[i]);
  }
};

struct DdpObject : Object {
  std::shared_ptr<CapiParamModule> module;
  std::unique_ptr<dtrain::detail::DDPCore> core;
  bool in_no_sync = false;
  bool sync_before = true;
};

std::shared_ptr<DdpObject> ddp_of(dtrain_c_ddp* ddp) { return get_handle<DdpObject>(ddp, Kind::kDdp, "ddp"); }

DDPOptions ddp_options(const dtrain_c_ddp_options* o, const Group& group) {
  DDPOptions options;
  options.process_group(group);
  if (!o) return options;
  require_arg(o->struct_size >= sizeof(dtrain_c_ddp_options),
              dtrain::detail::cat("options->struct_size is ", o->struct_size,
                                  ": fill the options with dtrain_c_ddp_options_default first"));
  return options.bucket_cap_mb(o->bucket_cap_mb)
      .first_bucket_cap_mb(o->first_bucket_cap_mb)
      .broadcast_buffers(o->broadcast_buffers != 0)
      .find_unused_parameters(o->find_unused_parameters != 0)
      .gradient_as_bucket_view(o->gradient_as_bucket_view != 0)
      .static_graph(o->static_graph != 0);
}

}  // namespace
}  // namespace dtrain::capi

using namespace dtrain;
using namespace dtrain::capi;

extern "C" {

void dtrain_c_ddp_options_default(dtrain_c_ddp_options* options) {
  if (!options) return;
  options->struct_size = sizeof(dtrain_c_ddp_options);
  options->bucket_cap_mb = kDefaultBucketCapMB;
  options->first_bucket_cap_mb = kDefaultFirstBucketCapMB;
  options->broadcast_buffers = 1;
  options->find_unused_parameters = 0;
  options->gradient_as_bucket_view = 0;
  options->static_graph = 0;
}

dtrain_c_status dtrain_c_ddp_new(dtrain_c_tensor* const* params, size_t n, const char* const* names,
                                 const dtrain_c_ddp_options* options, dtrain_c_group* group, dtrain_c_ddp** out) {
  return entry(__func__, DTRAIN_C_DIST_ERROR, [&] {
    require_arg(out, "out is NULL: pass where to store the ddp handle");
    require_init();
    const Group g = group_arg(group);
    std::vector<at::Tensor> tensors = param_args(params, n, g, "DDP averages gradients of floating-point parameters");
    auto object = std::make_shared<DdpObject>();
    object->module = std::make_shared<CapiParamModule>(tensors, param_names(names, n));
    object->core = std::make_unique<dtrain::detail::DDPCore>(object->module, ddp_options(options, g));
    *out = static_cast<dtrain_c_ddp*>(add_handle(Kind::kDdp, std::move(object)));
  });
}

dtrain_c_status dtrain_c_ddp_forward_begin(dtrain_c_ddp* ddp) {
  return entry(__func__, DTRAIN_C_DIST_ERROR, [&] { ddp_of(ddp)->core->pre_forward(); });
}

dtrain_c_status dtrain_c_ddp_forward_end(dtrain_c_ddp* ddp, dtrain_c_tensor* const* outputs, size_t n) {
  return entry(__func__, DTRAIN_C_DIST_ERROR, [&] {
    auto object = ddp_of(ddp);
    object->core->post_forward(output_args(outputs, n));
  });
}

dtrain_c_status dtrain_c_ddp_no_sync_begin(dtrain_c_ddp* ddp) {
  return entry(__func__, DTRAIN_C_DIST_ERROR, [&] {
    auto object = ddp_of(ddp);
    require_arg(!object->in_no_sync, "already inside no_sync: call dtrain_c_ddp_no_sync_end first");
    object->sync_before = object->core->sync();
    object->core->set_sync(false);
    object->in_no_sync = true;
  });
}

dtrain_c_status dtrain_c_ddp_no_sync_end(dtrain_c_ddp* ddp) {
  return entry(__func__, DTRAIN_C_DIST_ERROR, [&] {
    auto object = ddp_of(ddp);
    require_arg(object->in_no_sync, "not inside no_sync: call dtrain_c_ddp_no_sync_begin first");
    object->core->set_sync(object->sync_before);
    object->in_no_sync = false;
  });
}

dtrain_c_status dtrain_c_ddp_free(dtrain_c_ddp* ddp) {
  return entry(__func__, DTRAIN_C_DIST_ERROR, [&] { remove_handle(ddp, Kind::kDdp, "ddp"); });
}

}  // extern "C"
