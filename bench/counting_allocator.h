// Bytes held through LibTorch's CPU allocator, live and peak, for the benchmarks that measure memory.
// c10's CPU allocator keeps no statistics a program can read (ProfiledCPUMemoryReporter reports only
// to an active profiler, and its count is private, in LibTorch 1.13 and 2.x alike), so a wrapper
// installed with c10::SetCPUAllocator counts every storage's bytes as it is handed out and given back:
// what tensors hold, not RSS.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <new>

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <torch/version.h>

namespace bench {

// Each storage gets a header of kHeader bytes in front of it (what to free, and its size), so that
// a DataPtr's context is its data, as raw_allocate requires (some kernels, LayerNorm's among them,
// take raw memory from the CPU allocator and give it back through raw_deleter()).
class CountingAllocator final : public c10::Allocator {
 public:
  explicit CountingAllocator(c10::Allocator* inner) : inner_(inner) {}
#if TORCH_VERSION_MAJOR >= 2
  c10::DataPtr allocate(size_t n) override {
#else
  c10::DataPtr allocate(size_t n) const override {
#endif
    if (n == 0) return c10::DataPtr(nullptr, nullptr, &CountingAllocator::free, c10::Device(c10::DeviceType::CPU));
    c10::DataPtr inner = inner_->allocate(n + kHeader);
    auto* base = static_cast<char*>(inner.get());
    const c10::Device device = inner.device();
    const c10::DeleterFnPtr inner_free = inner.get_deleter();
    new (base) Header{this, inner.release_context(), inner_free, static_cast<int64_t>(n)};
    add(static_cast<int64_t>(n));
    void* data = base + kHeader;
    return c10::DataPtr(data, data, &CountingAllocator::free, device);
  }
  c10::DeleterFnPtr raw_deleter() const override { return &CountingAllocator::free; }
  int64_t live() const { return live_.load(); }
  int64_t peak() const { return peak_.load(); }
  void reset_peak() { peak_.store(live_.load()); }
#if TORCH_VERSION_MAJOR >= 2
  void copy_data(void* dest, const void* src, size_t count) const override { default_copy_data(dest, src, count); }
#endif

 private:
  struct Header {
    const CountingAllocator* self;
    void* inner_ctx;
    c10::DeleterFnPtr inner_free;
    int64_t bytes;
  };
  // A multiple of the default allocator's 64-byte alignment, so the data keeps it.
  static constexpr size_t kHeader = 64;
  static_assert(sizeof(Header) <= kHeader, "the header fits in front of the data");
  static void free(void* data) {
    if (data == nullptr) return;
    auto* h = reinterpret_cast<Header*>(static_cast<char*>(data) - kHeader);
    const Header copy = *h;
    copy.self->add(-copy.bytes);
    if (copy.inner_free) copy.inner_free(copy.inner_ctx);
  }
  void add(int64_t n) const {
    const int64_t now = live_.fetch_add(n) + n;
    int64_t p = peak_.load();
    while (now > p && !peak_.compare_exchange_weak(p, now)) {
    }
  }
  c10::Allocator* inner_;
  mutable std::atomic<int64_t> live_{0}, peak_{0};
};

// Wraps the default CPU allocator (once per process) and makes the wrapper LibTorch's CPU allocator:
// call it before the first tensor whose bytes should count.
inline CountingAllocator* install_counting_allocator() {
  static CountingAllocator counting(c10::GetDefaultCPUAllocator());
  c10::SetCPUAllocator(&counting, /*priority=*/100);
  return &counting;
}

}  // namespace bench
