// dtrain's error type and check macros.
//
// Three levels, so a message says whose mistake it is:
//   DTRAIN_CHECK(cond, ...)   user error: one line naming the actual value and the remedy.
//   DTRAIN_ASSERT(cond, ...)  internal invariant; a failure is a dtrain bug.
//   warn_once(key, msg)       performance traps, printed once per process.
// A library never calls exit(): everything is reported by throwing dtrain::Error.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace dtrain {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

namespace detail {
template <typename... Args>
std::string cat(const Args&... args) {
  std::ostringstream os;
  (void)(os << ... << args);
  return os.str();
}
}  // namespace detail

// Prints "dtrain warning: <msg>" to stderr the first time `key` is seen in this process.
void warn_once(const std::string& key, const std::string& msg);

}  // namespace dtrain

#define DTRAIN_CHECK(cond, ...)                                             \
  do {                                                                      \
    if (!(cond)) throw ::dtrain::Error(::dtrain::detail::cat(__VA_ARGS__)); \
  } while (0)

#define DTRAIN_ASSERT(cond, ...)                                                                                      \
  do {                                                                                                                \
    if (!(cond))                                                                                                      \
      throw ::dtrain::Error(::dtrain::detail::cat("internal error (a dtrain bug) at ", __FILE__, ":", __LINE__, ": ", \
                                                  #cond, " ", ##__VA_ARGS__));                                        \
  } while (0)
