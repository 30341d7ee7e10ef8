// Opaque gloo (see ../README.md).
#pragma once

#include <chrono>

#include "gloo/opaque.h"

namespace gloo {
class Context {
 public:
  void setTimeout(std::chrono::milliseconds timeout);  // declared for an inline caller; never defined
 private:
  char poison_[opaque::kPoisonBytes];
};
}  // namespace gloo
