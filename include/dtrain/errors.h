// dtrain's error type and check macros.
//
// Three levels, so a message says whose mistake it is:
//   DTRAIN_CHECK(cond, ...)   user error: one line naming the actual value and the remedy.
//   DTRAIN_ASSERT(cond, ...)  internal invariant; a failure is a dtrain bug.
//   warn_once(key, msg)       performance traps, printed once per process.
// A library never calls exit(): everything is reported by throwing dtrain::Error.
//
// Everything else dtrain tells the user goes through one channel: warnings (warn, warn_once) and
// informational lines (info: DTRAIN_DEBUG's details, a launcher note) reach stderr, or the handler
// set_message_handler installs, so a program can route them into its own log:
//   dtrain::set_message_handler([](dtrain::MessageLevel level, const std::string& text) {
//     my_log(level == dtrain::MessageLevel::kWarning ? "WARN" : "INFO", text);
//   });
#pragma once

#include <functional>
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

enum class MessageLevel { kInfo, kWarning };
// Receives every message (text without the "dtrain warning: " prefix stderr shows). Called on the
// thread that raised it, possibly on several at once; it may call into dtrain; an exception it
// throws is dropped.
using MessageHandler = std::function<void(MessageLevel level, const std::string& text)>;
// Installs `handler` for the whole process; an empty one restores stderr.
void set_message_handler(MessageHandler handler);

// "dtrain warning: <msg>" on stderr (or the handler, as kWarning).
void warn(const std::string& msg);
// The same, the first time `key` is seen in this process.
void warn_once(const std::string& key, const std::string& msg);
// <msg> as it is on stderr (or the handler, as kInfo).
void info(const std::string& msg);

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
