#include "dtrain/system.h"

#include <dlfcn.h>
#include <malloc.h>
#include <limits.h>
#include <stdlib.h>

#include <fstream>
#include <string>

#include "common/env.h"
#include "dtrain/errors.h"

namespace dtrain {

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
  mallopt(M_MMAP_THRESHOLD, 32 << 20);   // glibc's maximum on 64-bit; also freezes the dynamic threshold
  mallopt(M_TRIM_THRESHOLD, 512 << 20);  // keep freed memory for the next step
}

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
