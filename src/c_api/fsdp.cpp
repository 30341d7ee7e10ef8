// fully_shard (FSDP2, ZeRO-3) over parameters a binding owns. dtrain's fully_shard shards the
// parameters of torch::nn::Modules and runs a unit through a ForwardScope, so the caller's tensors are
// registered in modules of their own: one child module per unit the caller names, the rest in the
// root module, fully_shard'ed bottom-up as FSDP2 wants. The modules hold the caller's tensors
// themselves (nothing copied), so fully_shard's set_data leaves each caller tensor holding this rank's
// shard between steps and the whole parameter while its unit runs, and the unit's hooks on their
// gradient accumulators reduce-scatter the gradients when the binding's autograd runs backward.
// A binding has no module hooks: it brackets the forward of the root and of each unit with
// dtrain_c_fsdp_forward_begin/end, which hold the unit's ForwardScope between the two calls.
#include <algorithm>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/grad_mode.h>
#include <torch/nn/module.h>

#include "c_api/handles.h"
#include "dtrain/fsdp.h"

namespace dtrain::capi {
namespace {

struct CapiFsdpModule : torch::nn::Module {};

struct FsdpObject : Object {
  std::shared_ptr<CapiFsdpModule> root;
  std::vector<std::shared_ptr<CapiFsdpModule>> units;
  std::vector<std::string> paths;  // the caller's i-th parameter in the root's named_parameters()
  // The forward scopes open now: [0] the root's, [1 + k] unit k's.
  std::vector<std::unique_ptr<dtrain::detail::fsdp::ForwardScope>> scopes;
  ~FsdpObject() override {
    for (auto it = scopes.rbegin(); it != scopes.rend(); ++it) it->reset();  // innermost first
  }
};

std::shared_ptr<FsdpObject> fsdp_of(dtrain_c_fsdp* fsdp) { return get_handle<FsdpObject>(fsdp, Kind::kFsdp, "fsdp"); }

// The module of `unit` (DTRAIN_C_FSDP_ROOT or 0 .. units - 1).
torch::nn::Module& fsdp_module(FsdpObject& object, int unit) {
  require_arg(unit >= -1 && unit < static_cast<int>(object.units.size()),
              dtrain::detail::cat("unit is ", unit, ": pass DTRAIN_C_FSDP_ROOT (-1) or a unit in [0, ",
                                  object.units.size(), ")"));
  return unit < 0 ? static_cast<torch::nn::Module&>(*object.root) : *object.units[unit];
}

// The number of units `unit_of` names: each entry -1 (the root) or 0 .. K-1, every unit used.
int fsdp_unit_count(const int* unit_of, size_t n) {
  if (!unit_of) return 0;
  int count = 0;
  for (size_t i = 0; i < n; ++i) {
    require_arg(unit_of[i] >= -1 && unit_of[i] < static_cast<int>(n),
                dtrain::detail::cat("unit_of[", i, "] is ", unit_of[i], ": pass -1 (the root) or a unit in [0, ", n,
                                    "), numbered without gaps"));
    count = std::max(count, unit_of[i] + 1);
  }
  std::vector<bool> used(count, false);
  for (size_t i = 0; i < n; ++i)
    if (unit_of[i] >= 0) used[unit_of[i]] = true;
  for (int k = 0; k < count; ++k)
    require_arg(used[k], dtrain::detail::cat("unit ", k,
                                             " has no parameter (unit_of skips it): number the units 0, 1, "
                                             "... without gaps"));
  return count;
}

FullyShardOptions fsdp_options(const dtrain_c_fsdp_options* o, const Group& group) {
  FullyShardOptions options;
  options.process_group(group);
  if (!o) return options;
  require_arg(o->struct_size >= sizeof(dtrain_c_fsdp_options),
              dtrain::detail::cat("options->struct_size is ", o->struct_size,
                                  ": fill the options with dtrain_c_fsdp_options_default first"));
  require_arg(o->reshard_after_forward >= -1,
              dtrain::detail::cat("options->reshard_after_forward is ", o->reshard_after_forward,
                                  ": pass -1 (FSDP2's default), 0 (false), 1 (true) or n > 1 (a group size)"));
  // The root keeps FSDP2's default (whole after forward: backward needs it first) unless told.
  if (o->reshard_after_forward == 0 || o->reshard_after_forward == 1)
    options.reshard_after_forward(ReshardAfterForward(o->reshard_after_forward == 1));
  else if (o->reshard_after_forward > 1)
    options.reshard_after_forward(ReshardAfterForward(static_cast<int64_t>(o->reshard_after_forward)));
  return options;
}

void build_fsdp(FsdpObject& object, const std::vector<at::Tensor>& tensors, const std::vector<std::string>& names,
                const int* unit_of, int units) {
  object.root = std::make_shared<CapiFsdpModule>();
  for (int k = 0; k < units; ++k)
    object.units.push_back(
        object.root->register_module("unit_" + std::to_string(k), std::make_shared<CapiFsdpModule>()));
  for (size_t i = 0; i < tensors.size(); ++i) {
    const int k = unit_of ? unit_of[i] : -1;
    (k < 0 ? *object.root : *object.units[k]).register_parameter(names[i], tensors[i]);
    object.paths.push_back(k < 0 ? names[i] : "unit_" + std::to_string(k) + "." + names[i]);
  }
  object.scopes.resize(1 + units);
}

}  // namespace
}  // namespace dtrain::capi

using namespace dtrain;
using namespace dtrain::capi;

extern "C" {

void dtrain_c_fsdp_options_default(dtrain_c_fsdp_options* options) {
  if (!options) return;
  options->struct_size = sizeof(dtrain_c_fsdp_options);
  options->reshard_after_forward = -1;
}

dtrain_c_status dtrain_c_fsdp_new(dtrain_c_tensor* const* params, size_t n, const char* const* names,
                                  const int* unit_of, const dtrain_c_fsdp_options* options, dtrain_c_group* group,
                                  dtrain_c_fsdp** out) {
  return entry(__func__, DTRAIN_C_DIST_ERROR, [&] {
    require_arg(out, "out is NULL: pass where to store the fsdp handle");
    require_init();
    const Group g = group_arg(group);
    const std::vector<at::Tensor> tensors = param_args(params, n, g, "fully_shard shards floating-point parameters");
    const std::vector<std::string> named = param_names(names, n);
    const int units = fsdp_unit_count(unit_of, n);
    auto object = std::make_shared<FsdpObject>();
    build_fsdp(*object, tensors, named, unit_of, units);
    for (auto& unit : object->units) fully_shard(unit, fsdp_options(options, g));  // bottom-up
    fully_shard(object->root, fsdp_options(options, g));
    *out = static_cast<dtrain_c_fsdp*>(add_handle(Kind::kFsdp, std::move(object)));
  });
}

dtrain_c_status dtrain_c_fsdp_forward_begin(dtrain_c_fsdp* fsdp, int unit) {
  return entry(__func__, DTRAIN_C_DIST_ERROR, [&] {
    auto object = fsdp_of(fsdp);
    torch::nn::Module& module = fsdp_module(*object, unit);
    auto& scope = object->scopes[unit + 1];
    require_arg(!scope, dtrain::detail::cat("unit ", unit, "'s forward has begun already: end it first"));
    require_arg(unit < 0 || object->scopes[0],
                dtrain::detail::cat("unit ", unit,
                                    "'s forward begins outside the root's: begin DTRAIN_C_FSDP_ROOT "
                                    "first, end it after the units"));
    scope = std::make_unique<dtrain::detail::fsdp::ForwardScope>(dtrain::detail::fsdp::find_unit(&module));
  });
}

dtrain_c_status dtrain_c_fsdp_forward_end(dtrain_c_fsdp* fsdp, int unit, dtrain_c_tensor* const* outputs, size_t n) {
  return entry(__func__, DTRAIN_C_DIST_ERROR, [&] {
    auto object = fsdp_of(fsdp);
    fsdp_module(*object, unit);
    auto& scope = object->scopes[unit + 1];
    require_arg(scope != nullptr,
                dtrain::detail::cat("unit ", unit, "'s forward has not begun: call dtrain_c_fsdp_forward_begin"));
    require_arg(unit >= 0 || std::all_of(object->scopes.begin() + 1, object->scopes.end(), [](auto& s) { return !s; }),
                "the root's forward ends while a unit's is open: end every unit first");
    const std::vector<at::Tensor> tensors = output_args(outputs, n);
    auto open = std::move(scope);  // closed (its depth given back) however finish ends
    open->finish(tensors);
  });
}

dtrain_c_status dtrain_c_fsdp_unshard(dtrain_c_fsdp* fsdp, int unit) {
  return entry(__func__, DTRAIN_C_DIST_ERROR, [&] {
    auto object = fsdp_of(fsdp);
    fsdp::unshard(fsdp_module(*object, unit));
  });
}

dtrain_c_status dtrain_c_fsdp_reshard(dtrain_c_fsdp* fsdp, int unit) {
  return entry(__func__, DTRAIN_C_DIST_ERROR, [&] {
    auto object = fsdp_of(fsdp);
    fsdp::reshard(fsdp_module(*object, unit));
  });
}

dtrain_c_status dtrain_c_fsdp_set_requires_gradient_sync(dtrain_c_fsdp* fsdp, int requires_sync) {
  return entry(__func__, DTRAIN_C_DIST_ERROR, [&] {
    auto object = fsdp_of(fsdp);
    fsdp::set_requires_gradient_sync(*object->root, requires_sync != 0, true);
  });
}

dtrain_c_status dtrain_c_fsdp_full_parameter(dtrain_c_fsdp* fsdp, size_t index, dtrain_c_tensor* out) {
  return entry(__func__, DTRAIN_C_DIST_ERROR, [&] {
    auto object = fsdp_of(fsdp);
    at::Tensor& dst = tensor_arg(out, "out");
    require_arg(index < object->paths.size(),
                dtrain::detail::cat("index is ", index, ": the fsdp holds ", object->paths.size(), " parameters"));
    at::Tensor src;
    for (auto& [name, t] : dtrain::full_state_dict(*object->root))
      if (name == object->paths[index]) src = t;
    require_arg(
        dst.sizes() == src.sizes() && dst.scalar_type() == src.scalar_type(),
        dtrain::detail::cat("out is ", dst.scalar_type(), " ", dst.sizes(), " but parameter ", index, " is ",
                            src.scalar_type(), " ", src.sizes(), ": pass a tensor of its whole shape and dtype"));
    at::NoGradGuard no_grad;
    dst.copy_(src);
  });
}

dtrain_c_status dtrain_c_fsdp_free(dtrain_c_fsdp* fsdp) {
  return entry(__func__, DTRAIN_C_DIST_ERROR, [&] { remove_handle(fsdp, Kind::kFsdp, "fsdp"); });
}

}  // extern "C"
