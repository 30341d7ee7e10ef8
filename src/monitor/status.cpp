// The tutorial's monitor_training(): who am I, on what, with how much memory.
#include <sstream>

#include <ATen/Parallel.h>
#ifdef DTRAIN_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#endif

#include "dtrain/monitor.h"
#include "dtrain/system.h"

namespace dtrain {

MemoryInfo memory_info() {
  MemoryInfo m;
  m.rss_bytes = rss_bytes();
  m.peak_rss_bytes = peak_rss_bytes();
#ifdef DTRAIN_WITH_CUDA
  // CUDA builds only: the caching allocator's aggregate counters. StatType::AGGREGATE is index 0 in
  // every LibTorch, but the enum moved namespaces in 2.x, so the index is spelled out.
  namespace alloc = c10::cuda::CUDACachingAllocator;
  constexpr size_t kAll = 0;
  for (int d = 0; d < static_cast<int>(c10::cuda::device_count()); ++d) {
    const auto stats = alloc::getDeviceStats(d);
    m.devices.push_back(DeviceMemory{"cuda:" + std::to_string(d), stats.allocated_bytes[kAll].current,
                                     stats.reserved_bytes[kAll].current});
  }
#endif
  return m;
}

std::string training_status() {
  std::ostringstream os;
  const MemoryInfo mem = memory_info();
  if (is_initialized())
    os << "Rank: " << rank() << ", World Size: " << world_size() << ", Local Rank: " << local_rank() << "/"
       << local_world_size() << "\nBackend: " << backend() << "\n";
  else
    os << "Rank: 0, World Size: 1 (no process group)\nBackend: none\n";
  os << "Device: cpu (" << at::get_num_threads() << " threads)";
  for (const auto& d : mem.devices) os << ", " << d.device;
  char buf[160];
  std::snprintf(buf, sizeof buf, "\nMemory: RSS %.1f MiB, peak %.1f MiB", mem.rss_bytes / 1048576.0,
                mem.peak_rss_bytes / 1048576.0);
  os << buf;
  for (const auto& d : mem.devices) {
    std::snprintf(buf, sizeof buf, "; %s allocated %.1f MiB, reserved %.1f MiB", d.device.c_str(),
                  d.allocated / 1048576.0, d.reserved / 1048576.0);
    os << buf;
  }
  os << "\n";
  return os.str();
}

void monitor_training(std::FILE* out) {
  const std::string s = training_status();
  std::fputs(s.c_str(), out);
  std::fflush(out);
}

}  // namespace dtrain
