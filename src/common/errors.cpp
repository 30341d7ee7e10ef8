#include "dtrain/errors.h"

#include <iostream>
#include <mutex>
#include <unordered_set>

namespace dtrain {

void warn_once(const std::string& key, const std::string& msg) {
  static std::mutex mu;
  static std::unordered_set<std::string> seen;
  std::lock_guard<std::mutex> g(mu);
  if (seen.insert(key).second) std::cerr << "dtrain warning: " << msg << std::endl;
}

}  // namespace dtrain
