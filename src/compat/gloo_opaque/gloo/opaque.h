// See ../README.md: gloo's types as LibTorch's ProcessGroupGloo.hpp names them, with no layout and no
// code. kPoisonBytes makes a by-value use visible as an absurd size (gloo_backend.cpp asserts on it).
#pragma once

#include <cstddef>

namespace gloo::opaque {
constexpr std::size_t kPoisonBytes = std::size_t{1} << 20;
}
