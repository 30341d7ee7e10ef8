// What the node rendezvous (rendezvous.cpp) and elastic membership (elastic.cpp) share about the
// store: its byte conversions, the clock their deadlines use, and key names under a prefix.
#pragma once

#include "store/store.h"

#include <chrono>
#include <cstdint>
#include <string>
#include <utility>

namespace dtrain::run {

using dtrain::store::to_bytes;
using dtrain::store::to_string;
using Clock = std::chrono::steady_clock;
using Millis = std::chrono::milliseconds;

// Keys under one prefix, numbered per node, arrival or attempt:
//   StoreKeys keys("dtrain-run/");  keys("arrivals") == "dtrain-run/arrivals",
//   keys("outcome", 2, 1) == "dtrain-run/outcome/2/1".
class StoreKeys {
 public:
  explicit StoreKeys(std::string prefix) : prefix_(std::move(prefix)) {}
  std::string operator()(const std::string& name) const { return prefix_ + name; }
  std::string operator()(const std::string& name, int64_t n) const { return prefix_ + name + "/" + std::to_string(n); }
  std::string operator()(const std::string& name, int64_t n, int64_t m) const {
    return (*this)(name, n) + "/" + std::to_string(m);
  }

 private:
  std::string prefix_;
};

}  // namespace dtrain::run
