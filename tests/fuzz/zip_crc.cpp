// Fuzz target: the CRC-32 check of a zip archive (src/checkpoint/zip_crc.h), as dcp::load runs it on
// every stored item before LibTorch reads it. A clean dtrain::Error is the expected answer to a bad
// archive; a crash, a leak, undefined behaviour or a read outside the buffer is a finding.
#include <cstddef>
#include <cstdint>

#include "checkpoint/zip_crc.h"
#include "dtrain/errors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    dtrain::ckpt::check_zip_crcs(reinterpret_cast<const char*>(data), size);
  } catch (const dtrain::Error&) {
  }
  return 0;
}
