// Fuzz target: the reader of flight records (src/common/flight_pickle.h) as dtrain-run reads them:
// records other nodes put into the store and folders collected elsewhere. A std::runtime_error is
// the expected answer to bad bytes; a crash, a leak, undefined behaviour, a hang or memory out of
// proportion to the input (-rss_limit_mb) is a finding. What loads() accepts is JSON that dumps()
// writes and loads() reads back alike.
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "common/flight_pickle.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string bytes(reinterpret_cast<const char*>(data), size);
  nlohmann::json value;
  try {
    value = dtrain::flight::pickle::loads(bytes);
  } catch (const std::runtime_error&) {
    return 0;
  }
  if (dtrain::flight::pickle::loads(dtrain::flight::pickle::dumps(value)) != value) __builtin_trap();
  return 0;
}
