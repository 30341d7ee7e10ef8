// Which device a group's collectives run on, and choosing this thread's CUDA device. Both go through
// c10's device-guard registry rather than CUDA headers, so they compile in CPU-only builds too (where
// asking for a CUDA device fails with the reason).
#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include "dtrain/process_group.h"

namespace dtrain {

namespace {
int visible_cuda_devices() {
  return at::detail::getCUDAHooks().hasCUDA() ? at::detail::getCUDAHooks().getNumGPUs() : 0;
}
}  // namespace

void set_cuda_device(int index) {
  const int n = visible_cuda_devices();
  DTRAIN_CHECK(n > 0, "set_cuda_device(", index,
               "): no CUDA device is visible (a CPU-only LibTorch, no GPU, or "
               "CUDA_VISIBLE_DEVICES empty): run on the CPU with backend 'gloo'");
  DTRAIN_CHECK(index >= 0 && index < n, "set_cuda_device(", index, "): this process sees ", n,
               " CUDA device(s), cuda:0 to cuda:", n - 1, ": start at most ", n,
               " ranks per machine (--nproc_per_node) or check CUDA_VISIBLE_DEVICES");
  c10::impl::getDeviceGuardImpl(at::kCUDA)->setDevice(at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(index)));
}

at::Device collective_device(const Group& group) {
  if (group.backend() != "nccl") return at::Device(at::kCPU);
  return c10::impl::getDeviceGuardImpl(at::kCUDA)->getDevice();
}

}  // namespace dtrain
