// ZeroRedundancyOptimizer over parameters a binding owns. dtrain's ZeRO wraps a torch::optim
// optimizer made by a factory; a binding has no torch::optim object to hand over, so the C API makes
// the factory itself from a name and a plain options struct (torch.optim's SGD, Adam, AdamW, with
// PyTorch's defaults). The optimizer steps the caller's tensors themselves: ZeRO's broadcasts write
// every share into them.
#include <cmath>
#include <cstring>
#include <fstream>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>
#include <torch/serialize.h>

#include "c_api/handles.h"
#include "dtrain/zero.h"

namespace dtrain::capi {
namespace {

struct ZeroObject : Object {
  std::vector<at::Tensor> params;
  std::unique_ptr<ZeroRedundancyOptimizer> zero;
};

std::shared_ptr<ZeroObject> zero_of(dtrain_c_zero* zero) { return get_handle<ZeroObject>(zero, Kind::kZero, "zero"); }

enum class ZeroKind { kSgd, kAdam, kAdamW };

ZeroKind zero_kind(const char* optimizer) {
  require_arg(optimizer, "optimizer is NULL: pass \"sgd\", \"adam\" or \"adamw\"");
  if (std::strcmp(optimizer, "sgd") == 0) return ZeroKind::kSgd;
  if (std::strcmp(optimizer, "adam") == 0) return ZeroKind::kAdam;
  if (std::strcmp(optimizer, "adamw") == 0) return ZeroKind::kAdamW;
  throw StatusError(DTRAIN_C_INVALID_ARGUMENT,
                    dtrain::detail::cat("optimizer is '", optimizer, "': pass \"sgd\", \"adam\" or \"adamw\""));
}

// torch.optim's own checks ("Invalid learning rate: ..."), named by field, before LibTorch sees them.
void check_zero_options(ZeroKind kind, const dtrain_c_optimizer_options& o) {
  require_arg(o.struct_size >= sizeof(dtrain_c_optimizer_options),
              dtrain::detail::cat("options->struct_size is ", o.struct_size,
                                  ": fill the options with dtrain_c_optimizer_options_default first"));
  require_arg(o.lr >= 0, dtrain::detail::cat("options->lr is ", o.lr, ": pass a learning rate >= 0"));
  require_arg(o.weight_decay >= 0,
              dtrain::detail::cat("options->weight_decay is ", o.weight_decay, ": pass a weight decay >= 0"));
  if (kind == ZeroKind::kSgd) {
    require_arg(o.momentum >= 0, dtrain::detail::cat("options->momentum is ", o.momentum, ": pass >= 0"));
    require_arg(!o.nesterov || (o.momentum > 0 && o.dampening == 0),
                dtrain::detail::cat("options->nesterov is set with momentum ", o.momentum, " and dampening ",
                                    o.dampening, ": Nesterov momentum needs momentum > 0 and dampening 0"));
    return;
  }
  require_arg(o.beta1 >= 0 && o.beta1 < 1 && o.beta2 >= 0 && o.beta2 < 1,
              dtrain::detail::cat("options->beta1, beta2 are ", o.beta1, ", ", o.beta2, ": pass each in [0, 1)"));
  require_arg(o.eps >= 0, dtrain::detail::cat("options->eps is ", o.eps, ": pass eps >= 0"));
}

template <typename Opt, typename Options>
OptimizerFactory adam_like(const dtrain_c_optimizer_options& o) {
  return optimizer_factory<Opt>(Options(o.lr)
                                    .betas(std::make_tuple(o.beta1, o.beta2))
                                    .eps(o.eps)
                                    .weight_decay(o.weight_decay)
                                    .amsgrad(o.amsgrad != 0));
}

OptimizerFactory zero_factory(ZeroKind kind, const dtrain_c_optimizer_options& o) {
  switch (kind) {
    case ZeroKind::kSgd:
      return optimizer_factory<torch::optim::SGD>(torch::optim::SGDOptions(o.lr)
                                                      .momentum(o.momentum)
                                                      .dampening(o.dampening)
                                                      .weight_decay(o.weight_decay)
                                                      .nesterov(o.nesterov != 0));
    case ZeroKind::kAdam:
      return adam_like<torch::optim::Adam, torch::optim::AdamOptions>(o);
    case ZeroKind::kAdamW:
      return adam_like<torch::optim::AdamW, torch::optim::AdamWOptions>(o);
  }
  throw StatusError(DTRAIN_C_INTERNAL_ERROR, "unknown optimizer kind");
}

void fill_zero_defaults(ZeroKind kind, dtrain_c_optimizer_options& o) {
  o = dtrain_c_optimizer_options{};
  o.struct_size = sizeof(dtrain_c_optimizer_options);
  o.lr = 1e-3;
  o.beta1 = 0.9;
  o.beta2 = 0.999;
  o.eps = 1e-8;
  o.weight_decay = kind == ZeroKind::kAdamW ? 1e-2 : 0.0;
}

// ZeRO broadcasts each rank's share as one flat buffer: the parameters share one dtype.
void check_one_dtype(const std::vector<at::Tensor>& params) {
  for (size_t i = 1; i < params.size(); ++i)
    require_arg(params[i].scalar_type() == params[0].scalar_type(),
                dtrain::detail::cat("params[", i, "] is ", params[i].scalar_type(), " but params[0] is ",
                                    params[0].scalar_type(), ": give ZeRO parameters of one dtype"));
}

}  // namespace
}  // namespace dtrain::capi

using namespace dtrain;
using namespace dtrain::capi;

extern "C" {

dtrain_c_status dtrain_c_optimizer_options_default(const char* optimizer, dtrain_c_optimizer_options* options) {
  return entry(__func__, DTRAIN_C_INTERNAL_ERROR, [&] {
    const ZeroKind kind = zero_kind(optimizer);
    require_arg(options, "options is NULL: pass the struct to fill");
    fill_zero_defaults(kind, *options);
  });
}

dtrain_c_status dtrain_c_zero_new(dtrain_c_tensor* const* params, size_t n, const char* optimizer,
                                  const dtrain_c_optimizer_options* options, dtrain_c_group* group,
                                  dtrain_c_zero** out) {
  return entry(__func__, DTRAIN_C_DIST_ERROR, [&] {
    require_arg(out, "out is NULL: pass where to store the zero handle");
    const ZeroKind kind = zero_kind(optimizer);
    dtrain_c_optimizer_options o;
    fill_zero_defaults(kind, o);
    if (options) {
      check_zero_options(kind, *options);
      o = *options;
    }
    require_init();
    const Group g = group_arg(group);
    auto object = std::make_shared<ZeroObject>();
    object->params = param_args(params, n, g, "ZeRO's optimizers step floating-point parameters");
    check_one_dtype(object->params);
    object->zero = std::make_unique<ZeroRedundancyOptimizer>(object->params, zero_factory(kind, o),
                                                             ZeroOptions().process_group(g));
    *out = static_cast<dtrain_c_zero*>(add_handle(Kind::kZero, std::move(object)));
  });
}

dtrain_c_status dtrain_c_zero_step(dtrain_c_zero* zero) {
  return entry(__func__, DTRAIN_C_DIST_ERROR, [&] { zero_of(zero)->zero->step(); });
}

dtrain_c_status dtrain_c_zero_zero_grad(dtrain_c_zero* zero, int set_to_none) {
  return entry(__func__, DTRAIN_C_INTERNAL_ERROR, [&] {
    for (at::Tensor& p : zero_of(zero)->params) {
      if (!p.grad().defined()) continue;
      if (set_to_none) {
        p.mutable_grad() = at::Tensor();
        continue;
      }
      // As torch.optim's zero_grad: a gradient with history (or a view) leaves its graph first.
      if (p.grad().grad_fn())
        p.mutable_grad().detach_();
      else
        p.mutable_grad().requires_grad_(false);
      p.mutable_grad().zero_();
    }
  });
}

dtrain_c_status dtrain_c_zero_get_lr(dtrain_c_zero* zero, double* out) {
  return entry(__func__, DTRAIN_C_INTERNAL_ERROR, [&] {
    auto object = zero_of(zero);
    require_arg(out, "out is NULL");
    *out = object->zero->param_groups().at(0).options().get_lr();
  });
}

dtrain_c_status dtrain_c_zero_set_lr(dtrain_c_zero* zero, double lr) {
  return entry(__func__, DTRAIN_C_INTERNAL_ERROR, [&] {
    auto object = zero_of(zero);
    require_arg(lr >= 0, dtrain::detail::cat("lr is ", lr, ": pass a learning rate >= 0"));
    // step() hands param_groups()[0]'s options to the wrapped optimizer.
    object->zero->param_groups().at(0).options().set_lr(lr);
  });
}

dtrain_c_status dtrain_c_zero_consolidate_state_dict(dtrain_c_zero* zero, int to) {
  return entry(__func__, DTRAIN_C_DIST_ERROR, [&] { zero_of(zero)->zero->consolidate_state_dict(to); });
}

dtrain_c_status dtrain_c_zero_save(dtrain_c_zero* zero, const char* path) {
  return entry(__func__, DTRAIN_C_IO_ERROR, [&] {
    auto object = zero_of(zero);
    require_arg(path && path[0], "path is NULL or empty: pass the file's path");
    torch::serialize::OutputArchive archive;
    object->zero->save(archive);
    archive.save_to(path);
  });
}

dtrain_c_status dtrain_c_zero_load(dtrain_c_zero* zero, const char* path) {
  return entry(__func__, DTRAIN_C_IO_ERROR, [&] {
    auto object = zero_of(zero);
    require_arg(path && path[0], "path is NULL or empty: pass the file's path");
    require_arg(std::ifstream(path).good(),
                dtrain::detail::cat(path, " cannot be read: pass a file dtrain_c_zero_save wrote"));
    torch::serialize::InputArchive archive;
    archive.load_from(path);
    object->zero->load(archive);
  });
}

dtrain_c_status dtrain_c_zero_free(dtrain_c_zero* zero) {
  return entry(__func__, DTRAIN_C_INTERNAL_ERROR, [&] { remove_handle(zero, Kind::kZero, "zero"); });
}

}  // extern "C"
