// Fuzz target: the reader of a distributed checkpoint's `.metadata` pickle (src/common/pickle.h,
// dcp_metadata.h), as a load reads a file written by anyone. A clean dtrain::Error is the expected
// answer to bad bytes; a crash, a leak, undefined behaviour or a hang is a finding. What decode()
// accepts, encode() writes and decode() reads back alike, and the planner's arithmetic on it (each
// chunk's overlap with the whole tensor and with its first half, as dcp::load's plan_copies takes
// it) stays inside both boxes without overflowing.
#include <algorithm>
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
  for (const auto& [key, t] : m.tensors) {
    const dtrain::dcp::detail::Shape zeros(t.size.size(), 0);
    dtrain::dcp::detail::Shape half = t.size;
    if (!half.empty()) half[0] /= 2;
    const dtrain::dcp::detail::Shape* boxes[] = {&t.size, &half};
    for (const auto& c : t.chunks) {
      for (const auto* box : boxes) {
        const auto part = dtrain::dcp::detail::overlap(c, zeros, *box);
        if (!part) continue;
        for (size_t d = 0; d < box->size(); ++d)
          if (part->first[d] < std::max<int64_t>(c.offsets[d], 0) ||
              part->second[d] > std::min(c.offsets[d] + c.sizes[d], (*box)[d]))
            __builtin_trap();
      }
    }
  }
  const auto again = dtrain::dcp::detail::decode(dtrain::dcp::detail::encode(m));
  if (again.tensors.size() != m.tensors.size() || again.items.size() != m.items.size() ||
      again.values.size() != m.values.size())
    __builtin_trap();
  return 0;
}
