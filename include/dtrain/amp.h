// Mixed precision: the Autocast scope and GradScaler (torch.autocast / torch.cuda.amp.GradScaler in C++).
//
//   dtrain::GradScaler scaler;                               // init_scale 65536, growth every 2000 steps
//   for (...) {
//     opt.zero_grad();
//     at::Tensor loss;
//     {
//       dtrain::Autocast ac(at::kCPU);                       // bfloat16 on CPU, float16 on CUDA
//       loss = criterion(ddp(x), y);
//     }
//     scaler.scale(loss).backward();
//     scaler.unscale_(opt);                                  // optional: before clipping
//     torch::nn::utils::clip_grad_norm_(ddp.parameters(), 1.0);
//     scaler.step(opt);                                      // skipped when a gradient is inf/NaN
//     scaler.update();
//   }
//
// Autocast drives LibTorch's own autocast dispatch (at::autocast), so which ops run in low precision
// and which stay in float32 is exactly PyTorch's list for this LibTorch version.
//
// With DistributedDataParallel every rank holds the same averaged gradients, so an overflow on any
// rank is an overflow on all and every rank makes the same skip decision. Gradients sharded by
// fully_shard or parallelize_module (or both, on a mesh) need nothing either: unscale_ MAX-reduces
// the overflow flag over every group the optimizer's parameters are sharded over (fully_shard over a
// 2-D mesh: the shard group, then the replicate group), so an inf in one rank's rows makes every
// rank skip and back off, as PyTorch's GradScaler does on DTensor gradients.
// For gradients that differ per rank in other ways (e.g. model parallel by hand),
// GradScalerOptions().process_group(group) MAX-reduces the overflow flag over that group too.
#pragma once

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/DeviceType.h>
#include <c10/core/ScalarType.h>

#include "dtrain/detail/arg.h"
#include "dtrain/process_group.h"

namespace torch::optim {
class Optimizer;
}
namespace torch::serialize {
class OutputArchive;
class InputArchive;
}  // namespace torch::serialize

namespace dtrain {

// RAII autocast scope, nestable; restores the previous state and, when the outermost scope closes,
// clears the autocast weight cache — as `with torch.autocast(device_type, dtype, enabled):`.
// dtype defaults: bfloat16 on CPU (the only CPU autocast type in LibTorch 1.13), float16 on CUDA.
class Autocast {
 public:
  explicit Autocast(c10::DeviceType device, std::optional<c10::ScalarType> dtype = std::nullopt, bool enabled = true,
                    bool cache_enabled = true);
  ~Autocast();
  Autocast(const Autocast&) = delete;
  Autocast& operator=(const Autocast&) = delete;

 private:
  c10::DeviceType device_;
  bool prev_enabled_;
  c10::ScalarType prev_dtype_;
  bool prev_cache_enabled_;
};

struct GradScalerOptions {
  DTRAIN_ARG(double, init_scale, 65536.0)
  DTRAIN_ARG(double, growth_factor, 2.0)
  DTRAIN_ARG(double, backoff_factor, 0.5)
  DTRAIN_ARG(int64_t, growth_interval, 2000)
  DTRAIN_ARG(bool, enabled, true)
  // When set, the overflow flag is MAX-reduced over this group so every member skips together.
  // Refused inside a dtrain::Join sharing ranks with it: a rank that has joined cannot take part.
  DTRAIN_ARG(std::optional<Group>, process_group, std::nullopt)
  // The old name of process_group, kept for one release.
  [[deprecated("GradScalerOptions::sync_group is process_group now")]] GradScalerOptions& sync_group(Group g) {
    return process_group(std::move(g));
  }
  [[deprecated("GradScalerOptions::sync_group is process_group now")]] const std::optional<Group>& sync_group() const {
    return process_group();
  }
};

class GradScaler {
 public:
  explicit GradScaler(GradScalerOptions options = GradScalerOptions());
  ~GradScaler();

  // loss * scale (unchanged when disabled).
  at::Tensor scale(const at::Tensor& outputs);
  // Divides the optimizer's gradients by the scale in place and records whether any is inf/NaN.
  // Once per optimizer between update()s; a second call is an error, as in PyTorch.
  void unscale_(torch::optim::Optimizer& optimizer);
  // Unscales if not done yet, then steps unless a gradient was inf/NaN. Returns whether it stepped.
  bool step(torch::optim::Optimizer& optimizer);
  // Backs the scale off after an overflow, grows it after growth_interval clean steps
  // (or sets it to new_scale).
  void update(std::optional<double> new_scale = std::nullopt);

  double get_scale() const;  // 1.0 when disabled
  bool is_enabled() const { return options_.enabled(); }
  int64_t growth_tracker() const;
  const GradScalerOptions& options() const { return options_; }

  // {"scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"}, as PyTorch.
  std::map<std::string, double> state_dict() const;
  void load_state_dict(const std::map<std::string, double>& state);
  void save(torch::serialize::OutputArchive& archive) const;
  void load(torch::serialize::InputArchive& archive);

 private:
  enum class Stage { kReady, kUnscaled, kStepped };
  struct PerOptimizer {
    Stage stage = Stage::kReady;
    at::Tensor found_inf;  // (1,) float, 1 when a gradient was inf/NaN
  };
  void lazy_init(const at::Tensor& like);
  std::vector<Group> overflow_groups(const std::vector<at::Tensor>& params) const;

  GradScalerOptions options_;
  at::Tensor scale_;           // (1,) float32 on the loss's device, created by the first scale()
  at::Tensor growth_tracker_;  // (1,) int32
  std::unordered_map<const torch::optim::Optimizer*, PerOptimizer> per_optimizer_;
};

}  // namespace dtrain
