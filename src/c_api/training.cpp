// The training loop's helpers for the C API: DistributedSampler's indices, clip_grad_norm_ and
// GradScaler, each dtrain's own over the caller's parameter tensors. GradScaler works on a
// torch::optim::Optimizer; a binding has its own optimizer, so the scaler sees the parameters through
// an optimizer of its own whose step() only records that the caller may step (the decision PyTorch's
// scaler.step(opt) makes before calling opt.step()).
#include <algorithm>
#include <cmath>
#include <memory>
#include <optional>
#include <vector>

#include <torch/optim/optimizer.h>
#include <torch/optim/sgd.h>

#include "c_api/handles.h"
#include "dtrain/amp.h"
#include "dtrain/fsdp.h"
#include "dtrain/sampler.h"

namespace dtrain::capi {
namespace {

// The caller's parameters as a torch optimizer for GradScaler: step() steps nothing.
struct CapiDecisionOptimizer : torch::optim::Optimizer {
  CapiDecisionOptimizer()
      : Optimizer({torch::optim::OptimizerParamGroup(std::vector<at::Tensor>{})},
                  std::make_unique<torch::optim::SGDOptions>(0.0)) {}
  at::Tensor step(LossClosure /*closure*/) override {
    stepped = true;
    return {};
  }
  bool stepped = false;
};

struct ScalerObject : Object {
  std::unique_ptr<GradScaler> scaler;
  CapiDecisionOptimizer optimizer;  // one object for the scaler's per-optimizer state
};

std::shared_ptr<ScalerObject> scaler_of(dtrain_c_grad_scaler* scaler) {
  return get_handle<ScalerObject>(scaler, Kind::kScaler, "scaler");
}

// The parameters a clip or a scaler reads: floating point, any with a gradient or none.
std::vector<at::Tensor> grad_params(dtrain_c_tensor* const* params, size_t n) {
  require_arg(params || n == 0, dtrain::detail::cat("params is NULL with n = ", n, ": pass the parameters"));
  std::vector<at::Tensor> out;
  for (size_t i = 0; i < n; ++i) {
    const std::string what = dtrain::detail::cat("params[", i, "]");
    at::Tensor& t = tensor_arg(params[i], what.c_str());
    require_arg(at::isFloatingType(t.scalar_type()),
                dtrain::detail::cat(what, " is ", t.scalar_type(), ": pass floating-point parameters"));
    out.push_back(t);
  }
  return out;
}

// Points the scaler's optimizer at this call's parameters (the same optimizer object, so the
// scaler's unscale_/step stages carry over between calls of one iteration).
void set_scaler_params(ScalerObject& object, std::vector<at::Tensor> params) {
  object.optimizer.param_groups().at(0).params() = std::move(params);
}

}  // namespace
}  // namespace dtrain::capi

using namespace dtrain;
using namespace dtrain::capi;

extern "C" {

dtrain_c_status dtrain_c_sampler_indices(size_t dataset_size, int num_replicas, int replica_rank, int shuffle,
                                         int64_t seed, int drop_last, int64_t epoch, int64_t* out, size_t capacity,
                                         size_t* count) {
  return entry(__func__, DTRAIN_C_INVALID_ARGUMENT, [&] {
    require_arg(count, "count is NULL: pass where to store the number of indices");
    DistributedSamplerOptions options;
    if (num_replicas >= 0) options.num_replicas(num_replicas);
    if (replica_rank >= 0) options.rank(replica_rank);
    options.shuffle(shuffle != 0).seed(seed).drop_last(drop_last != 0);
    DistributedSampler sampler(dataset_size, options);
    sampler.set_epoch(epoch);
    const std::vector<int64_t> indices = sampler.indices();
    *count = indices.size();
    if (!out) return;  // asked for the count alone
    require_arg(capacity >= indices.size(),
                dtrain::detail::cat("capacity is ", capacity, " but this rank has ", indices.size(),
                                    " indices: pass a larger buffer (or "
                                    "out NULL to get the count first)"));
    std::copy(indices.begin(), indices.end(), out);
  });
}

dtrain_c_status dtrain_c_clip_grad_norm_(dtrain_c_tensor* const* params, size_t n, double max_norm, double norm_type,
                                         double* total_norm) {
  return entry(__func__, DTRAIN_C_DIST_ERROR, [&] {
    require_arg(max_norm > 0 || std::isinf(max_norm),
                dtrain::detail::cat("max_norm is ", max_norm, ": pass > 0 (infinity to measure the norm alone)"));
    require_arg(norm_type > 0 || std::isinf(norm_type),
                dtrain::detail::cat("norm_type is ", norm_type, ": pass p > 0, or infinity"));
    std::vector<at::Tensor> tensors = grad_params(params, n);
    const double total = clip_grad_norm_(tensors, max_norm, norm_type);
    if (total_norm) *total_norm = total;
  });
}

void dtrain_c_grad_scaler_options_default(dtrain_c_grad_scaler_options* options) {
  if (!options) return;
  const GradScalerOptions d;
  options->struct_size = sizeof(dtrain_c_grad_scaler_options);
  options->init_scale = d.init_scale();
  options->growth_factor = d.growth_factor();
  options->backoff_factor = d.backoff_factor();
  options->growth_interval = d.growth_interval();
  options->enabled = d.enabled() ? 1 : 0;
}

dtrain_c_status dtrain_c_grad_scaler_new(const dtrain_c_grad_scaler_options* options, dtrain_c_group* group,
                                         dtrain_c_grad_scaler** out) {
  return entry(__func__, DTRAIN_C_DIST_ERROR, [&] {
    require_arg(out, "out is NULL: pass where to store the grad scaler handle");
    require_init();
    GradScalerOptions o;
    if (options) {
      require_arg(options->struct_size >= sizeof(dtrain_c_grad_scaler_options),
                  dtrain::detail::cat("options->struct_size is ", options->struct_size,
                                      ": fill the options with dtrain_c_grad_scaler_options_default first"));
      require_arg(options->init_scale > 0 && options->growth_factor > 1 && options->backoff_factor > 0 &&
                      options->backoff_factor < 1 && options->growth_interval > 0,
                  dtrain::detail::cat("options are init_scale ", options->init_scale, ", growth_factor ",
                                      options->growth_factor, ", backoff_factor ", options->backoff_factor,
                                      ", growth_interval ", options->growth_interval,
                                      ": pass init_scale > 0, growth_factor > 1, 0 < backoff_factor < 1, "
                                      "growth_interval > 0"));
      o.init_scale(options->init_scale)
          .growth_factor(options->growth_factor)
          .backoff_factor(options->backoff_factor)
          .growth_interval(options->growth_interval)
          .enabled(options->enabled != 0);
    }
    // Every rank's gradients may differ (a binding's own model parallelism, or a plain per-rank
    // model): the overflow flag is agreed over the group so every rank skips together.
    o.process_group(group_arg(group));
    auto object = std::make_shared<ScalerObject>();
    object->scaler = std::make_unique<GradScaler>(o);
    *out = static_cast<dtrain_c_grad_scaler*>(add_handle(Kind::kScaler, std::move(object)));
  });
}

dtrain_c_status dtrain_c_grad_scaler_scale(dtrain_c_grad_scaler* scaler, dtrain_c_tensor* loss,
                                           dtrain_c_tensor** scaled) {
  return entry(__func__, DTRAIN_C_INTERNAL_ERROR, [&] {
    auto object = scaler_of(scaler);
    require_arg(scaled, "scaled is NULL: pass where to store the scaled loss");
    at::Tensor& t = tensor_arg(loss, "loss");
    require_arg(at::isFloatingType(t.scalar_type()),
                dtrain::detail::cat("loss is ", t.scalar_type(), ": pass the floating-point loss"));
    *scaled = new_tensor(object->scaler->scale(t));
  });
}

dtrain_c_status dtrain_c_grad_scaler_unscale_(dtrain_c_grad_scaler* scaler, dtrain_c_tensor* const* params, size_t n) {
  return entry(__func__, DTRAIN_C_DIST_ERROR, [&] {
    auto object = scaler_of(scaler);
    set_scaler_params(*object, grad_params(params, n));
    object->scaler->unscale_(object->optimizer);
  });
}

dtrain_c_status dtrain_c_grad_scaler_step(dtrain_c_grad_scaler* scaler, dtrain_c_tensor* const* params, size_t n,
                                          int* should_step) {
  return entry(__func__, DTRAIN_C_DIST_ERROR, [&] {
    auto object = scaler_of(scaler);
    require_arg(should_step, "should_step is NULL: pass where to store whether to run the optimizer");
    set_scaler_params(*object, grad_params(params, n));
    object->optimizer.stepped = false;
    const bool stepped = object->scaler->step(object->optimizer);
    *should_step = stepped && object->optimizer.stepped ? 1 : 0;
  });
}

dtrain_c_status dtrain_c_grad_scaler_update(dtrain_c_grad_scaler* scaler, double new_scale) {
  return entry(__func__, DTRAIN_C_DIST_ERROR, [&] {
    auto object = scaler_of(scaler);
    require_arg(new_scale >= 0,
                dtrain::detail::cat("new_scale is ", new_scale, ": pass 0 (the scaler decides) or > 0"));
    object->scaler->update(new_scale > 0 ? std::optional<double>(new_scale) : std::nullopt);
  });
}

dtrain_c_status dtrain_c_grad_scaler_get_scale(dtrain_c_grad_scaler* scaler, double* out) {
  return entry(__func__, DTRAIN_C_INTERNAL_ERROR, [&] {
    auto object = scaler_of(scaler);
    require_arg(out, "out is NULL");
    *out = object->scaler->get_scale();
  });
}

dtrain_c_status dtrain_c_grad_scaler_free(dtrain_c_grad_scaler* scaler) {
  return entry(__func__, DTRAIN_C_INTERNAL_ERROR, [&] { remove_handle(scaler, Kind::kScaler, "scaler"); });
}

}  // extern "C"
