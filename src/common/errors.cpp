#include "dtrain/errors.h"

#include <iostream>
#include <mutex>
#include <unordered_set>

namespace dtrain {
namespace {

// One lock for the handler, the keys seen and stderr, so that messages from several threads come
// out whole. A handler runs outside it: it may itself call into dtrain (and raise messages).
std::mutex& channel_mutex() {
  static std::mutex mu;
  return mu;
}
MessageHandler& handler() {
  static MessageHandler h;
  return h;
}

// Called with the lock held; releases it before calling a handler.
void emit(std::unique_lock<std::mutex>& lock, MessageLevel level, const std::string& msg) {
  if (!handler()) {
    std::cerr << (level == MessageLevel::kWarning ? "dtrain warning: " : "") << msg << std::endl;
    return;
  }
  MessageHandler h = handler();
  lock.unlock();
  try {
    h(level, msg);
  } catch (...) {  // a handler must not throw; a message is not worth failing the caller for
  }
}

}  // namespace

void set_message_handler(MessageHandler h) {
  std::lock_guard<std::mutex> g(channel_mutex());
  handler() = std::move(h);
}

void warn(const std::string& msg) {
  std::unique_lock<std::mutex> lock(channel_mutex());
  emit(lock, MessageLevel::kWarning, msg);
}

void warn_once(const std::string& key, const std::string& msg) {
  static std::unordered_set<std::string> seen;
  std::unique_lock<std::mutex> lock(channel_mutex());
  if (seen.insert(key).second) emit(lock, MessageLevel::kWarning, msg);
}

void info(const std::string& msg) {
  std::unique_lock<std::mutex> lock(channel_mutex());
  emit(lock, MessageLevel::kInfo, msg);
}

}  // namespace dtrain
