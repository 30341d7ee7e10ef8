// Small helpers shared by the unit and multi-process tests.
#pragma once

#include <cstdlib>
#include <exception>
#include <functional>
#include <optional>
#include <string>

#include "dtrain/errors.h"
#include "time_scale.h"

namespace dtrain::test_util {

// The message of the E that f() throws, or `none` when it throws nothing. Another exception goes on,
// so the test fails naming it.
template <typename E = std::exception>
std::string error_of(const std::function<void()>& f, const std::string& none = "") {
  try {
    f();
  } catch (const E& e) {
    return e.what();
  }
  return none;
}

// The message of the dtrain::Error f() throws, or "(no dtrain::Error thrown)".
inline std::string dtrain_error_of(const std::function<void()>& f) {
  return error_of<dtrain::Error>(f, "(no dtrain::Error thrown)");
}

// Sets an environment variable for the scope (e.g. around new_group(), whose backend reads
// DTRAIN_SHM at construction) and restores it after.
struct EnvOverride {
  EnvOverride(const char* var, const std::string& value) : var_(var) {
    if (const char* old = std::getenv(var)) saved_ = old;
    setenv(var, value.c_str(), 1);
  }
  ~EnvOverride() {
    if (saved_)
      setenv(var_, saved_->c_str(), 1);
    else
      unsetenv(var_);
  }
  EnvOverride(const EnvOverride&) = delete;
  EnvOverride& operator=(const EnvOverride&) = delete;
  const char* var_;
  std::optional<std::string> saved_;
};

}  // namespace dtrain::test_util
