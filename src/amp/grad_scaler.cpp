// GradScaler with torch.cuda.amp.GradScaler's semantics (torch/cuda/amp/grad_scaler.py, 1.13):
//
//   scale(loss)      loss * S; S and the growth tracker are created lazily on the loss's device.
//   unscale_(opt)    grads *= 1/S, found_inf = any inf/NaN; stage READY -> UNSCALED (twice: error).
//   step(opt)        unscale_ if still READY; opt.step() unless found_inf; stage -> STEPPED.
//   update()         S *= backoff on any found_inf, S *= growth after growth_interval clean
//                    steps; every optimizer's stage back to READY.
//
// Note [Overflow across shards]: under fully_shard or tensor parallelism a rank unscales only its own
// part of a sharded gradient, so an inf in rank 0's rows would make rank 0 skip and back off while
// rank 1 steps; from then on the ranks scale their losses differently and every reduction averages
// gradients of different scales. PyTorch reduces found_inf with MAX over the mesh of a DTensor
// gradient (DTensor's handler of _amp_foreach_non_finite_check_and_unscale_); here fully_shard and
// parallelize_module record each parameter's groups (comm/shard_groups.h) and unscale_ reduces over
// them by default, with nothing for the user to pass.
#include <algorithm>

#include <ATen/ATen.h>
#include <torch/optim/optimizer.h>
#include <torch/serialize/archive.h>

#include "compat/amp_compat.h"
#include "comm/shard_groups.h"
#include "dtrain/amp.h"
#include "dtrain/errors.h"
#include "dtrain/join.h"

namespace dtrain {

GradScaler::GradScaler(GradScalerOptions options) : options_(std::move(options)) {
  DTRAIN_CHECK(options_.init_scale() > 0, "GradScaler: init_scale must be > 0, got ", options_.init_scale());
  DTRAIN_CHECK(options_.growth_factor() > 1.0, "GradScaler: growth_factor must be > 1, got ", options_.growth_factor());
  DTRAIN_CHECK(options_.backoff_factor() > 0 && options_.backoff_factor() < 1.0,
               "GradScaler: backoff_factor must be in (0, 1), got ", options_.backoff_factor());
  DTRAIN_CHECK(options_.growth_interval() > 0, "GradScaler: growth_interval must be > 0, got ",
               options_.growth_interval());
}

GradScaler::~GradScaler() = default;

void GradScaler::lazy_init(const at::Tensor& like) {
  if (scale_.defined()) return;
  auto opts = at::TensorOptions().device(like.device());
  scale_ = at::full({1}, options_.init_scale(), opts.dtype(at::kFloat));
  growth_tracker_ = at::zeros({1}, opts.dtype(at::kInt));
}

// The groups the overflow flag is MAX-reduced over, so that every rank makes the same skip decision
// (Note [Overflow across shards]): each group a parameter's gradient is sharded over, then
// process_group when set. The same list on every rank that holds the optimizer's parameters in the
// same order; empty for whole gradients (DistributedDataParallel averages them: every rank sees the
// same inf).
std::vector<Group> GradScaler::overflow_groups(const std::vector<at::Tensor>& params) const {
  // No joinable announces these all-reduces, so a rank that has joined would never post them.
  DTRAIN_CHECK(!options_.process_group() || !Join::could_strand(*options_.process_group()),
               "GradScaler: process_group on rank ", rank(),
               " inside a dtrain::Join: a rank that has joined cannot take part in the overflow flag's all-reduce, so "
               "the others would wait for it: leave process_group unset (under DDP every rank holds the same averaged "
               "gradients and skips alike)");
  std::vector<Group> groups = comm::shard_groups(params);
  for (const Group& g : groups)
    DTRAIN_CHECK(!Join::could_strand(g), "GradScaler: sharded gradients on rank ", rank(),
                 " inside a dtrain::Join: the overflow flag is all-reduced over their group '", g.name(),
                 "', where a rank that has joined cannot take part, so the others would wait for it: train "
                 "fully_shard'ed or tensor-parallel models without a Join");
  const auto same = [&](const Group& g) { return g.name() == options_.process_group()->name(); };
  if (options_.process_group() && std::none_of(groups.begin(), groups.end(), same))
    groups.push_back(*options_.process_group());
  return groups;
}

at::Tensor GradScaler::scale(const at::Tensor& outputs) {
  if (!options_.enabled()) return outputs;
  lazy_init(outputs);
  return outputs * scale_.to(outputs.device());
}

void GradScaler::unscale_(torch::optim::Optimizer& optimizer) {
  if (!options_.enabled()) return;
  DTRAIN_CHECK(scale_.defined(),
               "GradScaler: unscale_() before any scale(): call scaler.scale(loss).backward() first in the iteration");
  PerOptimizer& state = per_optimizer_[&optimizer];
  DTRAIN_CHECK(state.stage != Stage::kUnscaled,
               "GradScaler: unscale_() has already been called on this optimizer since the last update()");
  DTRAIN_CHECK(state.stage != Stage::kStepped, "GradScaler: unscale_() is being called after step()");
  // Computed in double, then stored as float, as PyTorch.
  at::Tensor inv_scale = at::reciprocal(scale_.to(at::kDouble)).to(at::kFloat);
  state.found_inf = at::zeros({1}, scale_.options());
  std::vector<at::Tensor> grads, params;
  for (auto& group : optimizer.param_groups())
    for (auto& p : group.params()) {
      params.push_back(p);
      if (!p.grad().defined()) continue;
      DTRAIN_CHECK(p.grad().scalar_type() != at::kHalf,
                   "GradScaler: attempting to unscale float16 gradients: keep the parameters in float32 "
                   "and let Autocast cast the computation");
      grads.push_back(p.mutable_grad());
    }
  compat::amp_unscale_(grads, state.found_inf, inv_scale);
  for (const Group& g : overflow_groups(params)) all_reduce(state.found_inf, ReduceOp::MAX, g);
  state.stage = Stage::kUnscaled;
}

bool GradScaler::step(torch::optim::Optimizer& optimizer) {
  if (!options_.enabled()) {
    optimizer.step();
    return true;
  }
  PerOptimizer& state = per_optimizer_[&optimizer];
  DTRAIN_CHECK(state.stage != Stage::kStepped, "GradScaler: step() has already been called since the last update()");
  if (state.stage == Stage::kReady) unscale_(optimizer);
  PerOptimizer& after = per_optimizer_[&optimizer];
  const bool overflow = after.found_inf.defined() && after.found_inf.item<float>() > 0;
  if (!overflow) optimizer.step();
  after.stage = Stage::kStepped;
  return !overflow;
}

void GradScaler::update(std::optional<double> new_scale) {
  if (!options_.enabled()) return;
  if (!scale_.defined()) return;  // nothing was scaled in this iteration
  if (new_scale) {
    DTRAIN_CHECK(*new_scale > 0, "GradScaler: new_scale must be > 0, got ", *new_scale);
    scale_.fill_(*new_scale);
  } else {
    at::Tensor found = at::zeros({1}, scale_.options());
    bool recorded = false;
    for (auto& kv : per_optimizer_)
      if (kv.second.found_inf.defined()) {
        found.add_(kv.second.found_inf);
        recorded = true;
      }
    DTRAIN_CHECK(recorded,
                 "GradScaler: update() with no inf checks recorded: call step(optimizer) "
                 "(or unscale_) before update()");
    compat::amp_update_scale_(scale_, growth_tracker_, found, options_.growth_factor(), options_.backoff_factor(),
                              options_.growth_interval());
  }
  per_optimizer_.clear();
}

double GradScaler::get_scale() const {
  if (!options_.enabled()) return 1.0;
  return scale_.defined() ? scale_.item<float>() : options_.init_scale();
}

int64_t GradScaler::growth_tracker() const { return growth_tracker_.defined() ? growth_tracker_.item<int32_t>() : 0; }

std::map<std::string, double> GradScaler::state_dict() const {
  if (!options_.enabled()) return {};
  return {{"scale", get_scale()},
          {"growth_factor", options_.growth_factor()},
          {"backoff_factor", options_.backoff_factor()},
          {"growth_interval", static_cast<double>(options_.growth_interval())},
          {"_growth_tracker", static_cast<double>(growth_tracker())}};
}

void GradScaler::load_state_dict(const std::map<std::string, double>& state) {
  DTRAIN_CHECK(options_.enabled(), "GradScaler: load_state_dict on a disabled scaler");
  DTRAIN_CHECK(!state.empty(), "GradScaler: the state dict is empty: it came from a disabled scaler");
  for (const char* key : {"scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"})
    DTRAIN_CHECK(state.count(key), "GradScaler: the state dict has no '", key, "'");
  options_.init_scale(state.at("scale"));
  options_.growth_factor(state.at("growth_factor"));
  options_.backoff_factor(state.at("backoff_factor"));
  options_.growth_interval(static_cast<int64_t>(state.at("growth_interval")));
  const auto device = scale_.defined() ? scale_.device() : at::Device(at::kCPU);
  scale_ = at::full({1}, state.at("scale"), at::TensorOptions().device(device).dtype(at::kFloat));
  growth_tracker_ = at::full({1}, static_cast<int32_t>(state.at("_growth_tracker")),
                             at::TensorOptions().device(device).dtype(at::kInt));
}

void GradScaler::save(torch::serialize::OutputArchive& archive) const {
  for (const auto& kv : state_dict()) archive.write("grad_scaler." + kv.first, c10::IValue(kv.second));
}

void GradScaler::load(torch::serialize::InputArchive& archive) {
  std::map<std::string, double> state;
  for (const char* key : {"scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"}) {
    c10::IValue v;
    DTRAIN_CHECK(archive.try_read(std::string("grad_scaler.") + key, v), "GradScaler: the archive has no grad_scaler.",
                 key, ": it was not saved with GradScaler::save");
    state[key] = v.toDouble();
  }
  load_state_dict(state);
}

}  // namespace dtrain
