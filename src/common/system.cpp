#include "dtrain/system.h"

#include <dlfcn.h>
#include <malloc.h>
#include <limits.h>
#include <stdlib.h>

#include <atomic>
#include <fstream>
#include <mutex>
#include <string>

#include "common/env.h"
#include "common/malloc_threshold.h"
#include "dtrain/errors.h"

namespace dtrain {
namespace {

// Whether reduce_allocator_churn() tuned malloc: fully_shard then leaves its choice alone.
std::atomic<bool> malloc_tuned_by_program{false};
// What the first fully_shard pinned (Note [Sharding and glibc's mmap threshold]).
std::atomic<size_t> pinned_for_sharding{0};

}  // namespace

std::string blas_library() {
  void* sym = dlsym(RTLD_DEFAULT, "sgemm_");
  Dl_info info{};
  if (!sym || !dladdr(sym, &info) || !info.dli_fname) return "";
  char resolved[PATH_MAX];
  return realpath(info.dli_fname, resolved) ? std::string(resolved) : std::string(info.dli_fname);
}

bool blas_is_reference() {
  // Debian installs the reference BLAS as <libdir>/blas/libblas.so.3; OpenBLAS variants live in
  // <libdir>/openblas-*/ or provide libopenblas.so.
  const std::string lib = blas_library();
  return lib.find("/blas/libblas.so") != std::string::npos;
}

void warn_if_slow_blas() {
  if (blas_is_reference())
    warn_once("blas", "LibTorch uses the reference BLAS (" + blas_library() +
                          "), ~14x slower than OpenBLAS: apt-get install libopenblas0-openmp");
}

void reduce_allocator_churn() {
  // Called first thing in a training program, usually outside any try: a bad value warns instead.
  bool on = true;
  try {
    on = env::flag("DTRAIN_MALLOC_TUNING");
  } catch (const Error& e) {
    warn_once("malloc-tuning", std::string(e.what()) + " (the tuning stays on)");
  }
  if (!on) return;
  malloc_tuned_by_program = true;
  mallopt(M_MMAP_THRESHOLD, 32 << 20);   // glibc's maximum on 64-bit; also freezes the dynamic threshold
  mallopt(M_TRIM_THRESHOLD, 512 << 20);  // keep freed memory for the next step
}

// Note [Sharding and glibc's mmap threshold]
// glibc serves a block of its mmap threshold and more (128 KiB at first) with a mapping of its own,
// returned to the kernel at free, and a smaller one from a heap, whose freed space stays resident
// until it lies at the heap's top. The threshold moves: freeing a mapped block raises it to that
// block's size (up to 32 MiB), so that a program allocating such blocks over and over keeps them on
// the heap instead of faulting fresh pages in every time. fully_shard frees the whole model's
// parameters as it shards them: the largest block any unit has (16 MiB for a Linear(2048, 2048)),
// and from then on the units' whole parameters and gradients, the optimizer's temporaries and the
// collectives' staging (in the transport threads' arenas) come from heaps, where the holes they
// leave between blocks that live on (Adam's moments, made in the first step) stay resident. That
// cost 65-100 MiB of peak RSS per rank over shared memory and 110-200 over Gloo (bench_fsdp --parts
// rss, 21 M parameters on 2 ranks): the peak was 0.72 and 0.91 of DDP's, whose blocks live as long as
// it does. So the first fully_shard of CPU parameters pins the threshold at 1 MiB before it frees
// them (mallopt also stops glibc moving it): a block of 1 MiB and more is mapped and given back at
// free, and peak RSS per rank is what tensors hold at the peak plus the runtime: 407 MiB over shared
// memory and 420 over Gloo, 0.57-0.66 of DDP's (whose own peak moves by 100 MiB from run to run).
// Process-wide, because the blocks in question are LibTorch's (autograd's gradients, Adam's
// temporaries), not fully_shard's to allocate otherwise; mapping fully_shard's own buffers alone
// changed nothing measurable while the threshold stood at 16 MiB. The cost: those blocks are
// page-faulted in every step (fully_shard's own are not: Note [Buffer pool] keeps them), 19 k more
// faults per step on bench_fsdp's step model (8 x Linear(1024, 1024)), about 25 ms more CPU time
// per step there (62-66 -> 85-93 ms, DDP's 91-97). DTRAIN_FSDP_MMAP_THRESHOLD
// sets another threshold, or 0 to leave glibc's as it is (speed before memory); a program that tuned
// malloc itself (reduce_allocator_churn(), MALLOC_MMAP_THRESHOLD_, GLIBC_TUNABLES) keeps its choice.
size_t detail::sharding_mmap_threshold(const env::Lookup& from, bool program_tuned) {
  const size_t bytes = static_cast<size_t>(*env::integer("DTRAIN_FSDP_MMAP_THRESHOLD", from));
  if (bytes == 0 || program_tuned || from("MALLOC_MMAP_THRESHOLD_")) return 0;
  const std::optional<std::string> tunables = from("GLIBC_TUNABLES");
  if (tunables && tunables->find("glibc.malloc.mmap_threshold") != std::string::npos) return 0;
  return bytes;
}

bool detail::pin_mmap_threshold(size_t bytes) { return mallopt(M_MMAP_THRESHOLD, static_cast<int>(bytes)) == 1; }

size_t detail::settle_malloc_for_sharding() {
  static std::once_flag once;
  std::call_once(once, [] {
    const size_t bytes = sharding_mmap_threshold(env::process(), malloc_tuned_by_program);
    if (bytes > 0 && pin_mmap_threshold(bytes)) pinned_for_sharding = bytes;
  });
  return pinned_for_sharding;
}

size_t detail::pinned_mmap_threshold() { return pinned_for_sharding; }

static int64_t status_kb(const char* field) {
  std::ifstream f("/proc/self/status");
  std::string line;
  const std::string prefix = std::string(field) + ":";
  while (std::getline(f, line))
    if (line.rfind(prefix, 0) == 0) return std::stoll(line.substr(prefix.size()));
  return -1;
}

int64_t rss_bytes() { return status_kb("VmRSS") * 1024; }
int64_t peak_rss_bytes() { return status_kb("VmHWM") * 1024; }

}  // namespace dtrain
