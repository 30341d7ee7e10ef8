// Autocast scope: torch.autocast's __enter__/__exit__ over at::autocast (via compat/amp_compat).
#include "dtrain/amp.h"

#include "compat/amp_compat.h"
#include "dtrain/errors.h"

namespace dtrain {

Autocast::Autocast(c10::DeviceType device, std::optional<c10::ScalarType> dtype, bool enabled, bool cache_enabled)
    : device_(device) {
  DTRAIN_CHECK(device == c10::DeviceType::CPU || device == c10::DeviceType::CUDA, "Autocast: device type ", device,
               " is not supported: use at::kCPU or at::kCUDA");
  const c10::ScalarType fast = dtype.value_or(device == c10::DeviceType::CPU ? at::kBFloat16 : at::kHalf);
  if (device == c10::DeviceType::CPU && compat::kAutocastCpuHalf)
    DTRAIN_CHECK(fast == at::kBFloat16 || fast == at::kHalf, "Autocast on CPU supports bfloat16 or float16, got ", fast,
                 ": use at::kBFloat16");
  else if (device == c10::DeviceType::CPU)
    DTRAIN_CHECK(fast == at::kBFloat16, "Autocast on CPU supports only bfloat16 in this LibTorch, got ", fast,
                 ": use at::kBFloat16");
  else
    DTRAIN_CHECK(fast == at::kHalf || fast == at::kBFloat16, "Autocast on CUDA supports float16 or bfloat16, got ",
                 fast);
  auto prev = compat::get_autocast(device);
  prev_enabled_ = prev.enabled;
  prev_dtype_ = prev.dtype;
  prev_cache_enabled_ = compat::autocast_cache_enabled();
  compat::set_autocast(device, {enabled, fast});
  compat::autocast_increment_nesting();
  compat::set_autocast_cache_enabled(cache_enabled);
}

Autocast::~Autocast() {
  compat::autocast_decrement_nesting();
  compat::set_autocast(device_, {prev_enabled_, prev_dtype_});
  compat::set_autocast_cache_enabled(prev_cache_enabled_);
}

}  // namespace dtrain
