// Small helpers shared by the unit and multi-process tests.
#pragma once

#include <exception>
#include <functional>
#include <string>

namespace dtrain::test_util {

// The message of the exception f() throws, or "" when it throws none.
inline std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

}  // namespace dtrain::test_util
