#include "compat/amp_compat.h"

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <torch/csrc/api/include/torch/version.h>

#include <cmath>

#include "dtrain/errors.h"

namespace dtrain::compat {

// LibTorch 2.3 added CPU kernels for the two AMP ops, and 2.4 made the per-device autocast calls
// take the device (the CPU/GPU-named ones became deprecated wrappers).
#define DTRAIN_TORCH_AT_LEAST(major, minor) \
  (TORCH_VERSION_MAJOR > (major) || (TORCH_VERSION_MAJOR == (major) && TORCH_VERSION_MINOR >= (minor)))

const bool kAutocastCpuHalf = DTRAIN_TORCH_AT_LEAST(2, 4);

AutocastState get_autocast(c10::DeviceType device) {
#if DTRAIN_TORCH_AT_LEAST(2, 4)
  return {at::autocast::is_autocast_enabled(device), at::autocast::get_autocast_dtype(device)};
#else
  if (device == c10::DeviceType::CPU) return {at::autocast::is_cpu_enabled(), at::autocast::get_autocast_cpu_dtype()};
  return {at::autocast::is_enabled(), at::autocast::get_autocast_gpu_dtype()};
#endif
}

void set_autocast(c10::DeviceType device, AutocastState state) {
#if DTRAIN_TORCH_AT_LEAST(2, 4)
  at::autocast::set_autocast_enabled(device, state.enabled);
  at::autocast::set_autocast_dtype(device, state.dtype);
#else
  if (device == c10::DeviceType::CPU) {
    at::autocast::set_cpu_enabled(state.enabled);
    at::autocast::set_autocast_cpu_dtype(state.dtype);
  } else {
    at::autocast::set_enabled(state.enabled);
    at::autocast::set_autocast_gpu_dtype(state.dtype);
  }
#endif
}

bool autocast_cache_enabled() { return at::autocast::is_autocast_cache_enabled(); }
void set_autocast_cache_enabled(bool on) { at::autocast::set_autocast_cache_enabled(on); }
void autocast_increment_nesting() { at::autocast::increment_nesting(); }
int autocast_decrement_nesting() {
  int depth = at::autocast::decrement_nesting();
  if (depth == 0) at::autocast::clear_cache();
  return depth;
}

void amp_unscale_(std::vector<at::Tensor>& grads, at::Tensor& found_inf, const at::Tensor& inv_scale) {
  if (grads.empty()) return;
  if (DTRAIN_TORCH_AT_LEAST(2, 3) || grads[0].is_cuda()) {
    at::_amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale);
    return;
  }
  at::NoGradGuard ng;
  for (auto& g : grads) {
    // isfinite is false for inf and NaN; the flag is sticky across calls, as ATen's kernel.
    if (!at::isfinite(g).all().item<bool>()) found_inf.fill_(1.0);
    g.mul_(inv_scale.to(g.scalar_type()));
  }
}

void amp_update_scale_(at::Tensor& scale, at::Tensor& growth_tracker, const at::Tensor& found_inf, double growth_factor,
                       double backoff_factor, int64_t growth_interval) {
  if (DTRAIN_TORCH_AT_LEAST(2, 3) || scale.is_cuda()) {
    at::_amp_update_scale_(scale, growth_tracker, found_inf, growth_factor, backoff_factor, growth_interval);
    return;
  }
  // ATen's kernel multiplies the float scale by the double factor in double and rounds to float once;
  // a float tensor times a double scalar would round the factor to float first (0.3 -> 0.300000012)
  // and drift by an ulp from PyTorch's trajectory.
  at::NoGradGuard ng;
  const double current = scale.item<float>();
  if (found_inf.item<float>() > 0) {
    scale.fill_(static_cast<float>(current * backoff_factor));
    growth_tracker.zero_();
    return;
  }
  const int64_t successful = growth_tracker.item<int32_t>() + 1;
  if (successful == growth_interval) {
    const float grown = static_cast<float>(current * growth_factor);
    if (std::isfinite(grown)) scale.fill_(grown);  // never grow into inf
    growth_tracker.zero_();
  } else {
    growth_tracker.fill_(successful);
  }
}

}  // namespace dtrain::compat
