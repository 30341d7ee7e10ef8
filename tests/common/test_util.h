// Small helpers shared by the unit and multi-process tests.
#pragma once

#include <cstdlib>
#include <exception>
#include <functional>
#include <optional>
#include <string>

#include "dtrain/errors.h"

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

// The message of the dtrain::Error f() throws, or "(no dtrain::Error thrown)". Any other exception
// goes on, so the test fails naming it.
inline std::string dtrain_error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const dtrain::Error& e) {
    return e.what();
  }
  return "(no dtrain::Error thrown)";
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
