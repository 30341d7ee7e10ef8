// Opaque gloo (see ../README.md). c10d's GlooStore derives from this and overrides these four
// virtuals; dtrain never creates one (LibTorch's constructor does, with the real gloo).
#pragma once

#include <chrono>
#include <string>
#include <vector>

#include "gloo/opaque.h"

namespace gloo::rendezvous {
class Store {
 public:
  static constexpr std::chrono::milliseconds kDefaultTimeout = std::chrono::seconds(30);
  Store();  // declared for c10d's inline GlooStore constructor; never defined
  virtual ~Store();
  virtual void set(const std::string& key, const std::vector<char>& data) = 0;
  virtual std::vector<char> get(const std::string& key) = 0;
  virtual void wait(const std::vector<std::string>& keys) = 0;
  virtual void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) = 0;

 private:
  char poison_[opaque::kPoisonBytes];
};
}  // namespace gloo::rendezvous
