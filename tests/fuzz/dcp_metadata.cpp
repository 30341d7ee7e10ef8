// Fuzz target: the reader of a distributed checkpoint's `.metadata` pickle (src/common/pickle.h,
// dcp_metadata.h), as a load reads a file written by anyone. A clean dtrain::Error is the expected
// answer to bad bytes; a crash, a leak, undefined behaviour or a hang is a finding. What decode()
// accepts, encode() writes and decode() reads back alike.
#include <cstddef>
#include <cstdint>
#include <string>

#include "checkpoint/dcp_metadata.h"
#include "common/pickle.h"
#include "dtrain/errors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string bytes(reinterpret_cast<const char*>(data), size);
  try {
    (void)dtrain::pickle::parse(bytes);
  } catch (const dtrain::Error&) {
  }
  dtrain::dcp::detail::Metadata m;
  try {
    m = dtrain::dcp::detail::decode(bytes);
  } catch (const dtrain::Error&) {
    return 0;
  }
  const auto again = dtrain::dcp::detail::decode(dtrain::dcp::detail::encode(m));
  if (again.tensors.size() != m.tensors.size() || again.items.size() != m.items.size() ||
      again.values.size() != m.values.size())
    __builtin_trap();
  return 0;
}
