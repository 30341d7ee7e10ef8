// Fuzz target: the checkpoint file's header line and framing (src/checkpoint/frame.h), as a load reads
// a file from disk. A clean dtrain::Error is the expected answer to a bad file; a crash, a leak or
// undefined behaviour is a finding. Also checks that every payload survives frame() then unframe().
#include <cstddef>
#include <cstdint>
#include <string>

#include "checkpoint/frame.h"
#include "dtrain/errors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string bytes(reinterpret_cast<const char*>(data), size);
  try {
    (void)dtrain::ckpt::unframe(bytes);
  } catch (const dtrain::Error&) {
  }
  try {
    (void)dtrain::ckpt::header_write_stamp(bytes.substr(0, dtrain::ckpt::kMaxHeaderBytes));
  } catch (const dtrain::Error&) {
  }
  // What frame() writes, unframe() reads back whole, at every version and any stamp.
  const int64_t stamp = size > 0 ? data[0] : 0;
  for (int version = 1; version <= dtrain::ckpt::kNewestFrameVersion; ++version)
    if (dtrain::ckpt::unframe(dtrain::ckpt::frame(bytes, stamp, version)) != bytes) __builtin_trap();
  return 0;
}
