// Autocast state and the AMP kernels, per LibTorch version.
// LibTorch 1.13 has the autocast dispatch for CPU (bfloat16) and CUDA, but its
// _amp_foreach_non_finite_check_and_unscale_ / _amp_update_scale_ kernels exist for CUDA only;
// on CPU tensors they are composed from ATen ops with the same semantics.
#pragma once

#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/DeviceType.h>

namespace dtrain::compat {

// CPU autocast to float16 exists from LibTorch 2.4 on (1.13: bfloat16 only).
extern const bool kAutocastCpuHalf;

struct AutocastState {
  bool enabled;
  c10::ScalarType dtype;
};
AutocastState get_autocast(c10::DeviceType device);
void set_autocast(c10::DeviceType device, AutocastState state);
bool autocast_cache_enabled();
void set_autocast_cache_enabled(bool on);
void autocast_increment_nesting();
// Returns the nesting depth after decrementing; clears the cast cache at 0.
int autocast_decrement_nesting();

// grads *= inv_scale in place; found_inf = 1 if any element of any grad is inf or NaN.
void amp_unscale_(std::vector<at::Tensor>& grads, at::Tensor& found_inf, const at::Tensor& inv_scale);
// PyTorch's scale update: back off on overflow, grow after growth_interval clean steps.
void amp_update_scale_(at::Tensor& scale, at::Tensor& growth_tracker, const at::Tensor& found_inf, double growth_factor,
                       double backoff_factor, int64_t growth_interval);

}  // namespace dtrain::compat
