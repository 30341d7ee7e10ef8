// The time scale of the tests' bounds on elapsed time (no dependency: the torch-free tests use it too).
#pragma once

#include <chrono>

#include "sanitizer.h"

namespace dtrain::test_util {

// A bound on elapsed time in a test is a claim about dtrain's normal build. Under a sanitizer the
// same code runs several times slower (and scripts/sanitize.sh runs two tests at once), so such
// bounds multiply by this factor there; waits for an event never need it.
#if defined(DTRAIN_TEST_SANITIZER)
inline constexpr double kTimeScale = 10;
#else
inline constexpr double kTimeScale = 1;
#endif

// `bound` times kTimeScale, as a duration any steady_clock difference compares with.
template <typename Rep, typename Period>
std::chrono::duration<double> scaled(std::chrono::duration<Rep, Period> bound) {
  return std::chrono::duration<double>(bound) * kTimeScale;
}

}  // namespace dtrain::test_util
