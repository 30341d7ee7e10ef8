// Fuzz target: the header of a safetensors file (src/checkpoint/safetensors_header.h), as
// load_safetensors reads a file written by anyone. A clean dtrain::Error of one bounded line is the
// expected answer to bad bytes; a crash, a leak, undefined behaviour, a hang or a line of the file's
// unbounded text is a finding. What it accepts, load_safetensors copies as it is: every entry's
// range inside the data, as long as its shape and dtype say, the ranges tiling the data.
#include <cstddef>
#include <cstdint>
#include <string>

#include "checkpoint/safetensors_header.h"
#include "dtrain/errors.h"

namespace {

// safetensors' codes and their element sizes (LibTorch's table is dtypes.cpp's).
size_t element_size(const std::string& code) {
  if (code == "BOOL" || code == "U8" || code == "I8" || code == "F8_E4M3" || code == "F8_E5M2") return 1;
  if (code == "I16" || code == "U16" || code == "F16" || code == "BF16") return 2;
  if (code == "I32" || code == "U32" || code == "F32") return 4;
  if (code == "I64" || code == "U64" || code == "F64" || code == "C64") return 8;
  return 0;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string bytes(reinterpret_cast<const char*>(data), size);
  dtrain::ckpt::SafetensorsHeader h;
  try {
    h = dtrain::ckpt::parse_safetensors_header("in.safetensors", bytes, element_size);
  } catch (const dtrain::Error& e) {
    const std::string what = e.what();
    if (what.find('\n') != std::string::npos || what.size() > 1000) __builtin_trap();
    return 0;
  }
  uint64_t end = 0;
  for (const auto& e : h.entries) {
    uint64_t numel = 1;
    for (int64_t d : e.shape) numel *= static_cast<uint64_t>(d);  // fits: it was checked against the data
    if (e.begin != end || e.end - e.begin != numel * element_size(e.dtype)) __builtin_trap();
    end = e.end;
  }
  if (h.data_start > size || end != size - h.data_start) __builtin_trap();
  return 0;
}
