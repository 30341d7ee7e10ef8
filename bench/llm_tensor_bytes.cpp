// Peak tensor bytes of an unchanged program: a library bench/bench_llm.py preloads (LD_PRELOAD) into
// train_llm's ranks. Loaded before the program's own code runs, it makes bench/counting_allocator.h's
// wrapper LibTorch's CPU allocator, so every storage the run allocates is counted; at exit the rank
// writes the peak of the bytes live at once to $DTRAIN_BENCH_TENSOR_BYTES.<RANK>:
//   peak_bytes=N live_bytes_at_exit=M
// RSS would not do for activation memory: a rank's resident set is mostly LibTorch's code and the
// runtime's arenas, which activation checkpointing leaves alone. Processes without $RANK (the
// launcher, which inherits LD_PRELOAD too) and without the variable count nothing.
#include <cstdio>
#include <cstdlib>
#include <string>

#include "counting_allocator.h"

namespace {

bench::CountingAllocator* g_llm_counter = nullptr;

// Built on first use: the constructor below may run before this file's own static initializers.
std::string& llm_out() {
  static std::string path;
  return path;
}

void llm_write_peak() {
  std::FILE* f = std::fopen(llm_out().c_str(), "w");
  if (f == nullptr) {
    std::fprintf(stderr, "llm_tensor_bytes: cannot write %s\n", llm_out().c_str());
    return;
  }
  std::fprintf(f, "peak_bytes=%lld live_bytes_at_exit=%lld\n", static_cast<long long>(g_llm_counter->peak()),
               static_cast<long long>(g_llm_counter->live()));
  std::fclose(f);
}

__attribute__((constructor)) void llm_install_counter() {
  const char* prefix = std::getenv("DTRAIN_BENCH_TENSOR_BYTES");
  const char* rank = std::getenv("RANK");
  if (prefix == nullptr || *prefix == '\0' || rank == nullptr) return;
  llm_out() = std::string(prefix) + "." + rank;
  g_llm_counter = bench::install_counting_allocator();  // never destroyed: storages outlive exit handlers
  std::atexit(llm_write_peak);
}

}  // namespace
