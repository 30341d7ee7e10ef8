// dtrain's one message channel (dtrain/errors.h): warnings and informational lines reach stderr, or
// the handler a program installs.
#include <gtest/gtest.h>

#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "dtrain/errors.h"

namespace {

using Seen = std::vector<std::pair<dtrain::MessageLevel, std::string>>;

// Installs a handler that records into `seen` for the scope, stderr again after.
struct Recording {
  explicit Recording(Seen& seen) {
    dtrain::set_message_handler([&seen](dtrain::MessageLevel l, const std::string& t) { seen.emplace_back(l, t); });
  }
  ~Recording() { dtrain::set_message_handler(nullptr); }
};

TEST(Messages, StderrByDefault) {
  testing::internal::CaptureStderr();
  dtrain::warn("disk almost full");
  dtrain::info("[dtrain DDP] 3 parameters");
  EXPECT_EQ(testing::internal::GetCapturedStderr(), "dtrain warning: disk almost full\n[dtrain DDP] 3 parameters\n");
}

TEST(Messages, AHandlerGetsEveryMessageAndStderrNone) {
  Seen seen;
  testing::internal::CaptureStderr();
  {
    Recording r(seen);
    dtrain::warn("a");
    dtrain::warn_once("messages-test-key", "b");
    dtrain::warn_once("messages-test-key", "b again");  // the key was seen: nothing
    dtrain::info("c");
  }
  EXPECT_EQ(testing::internal::GetCapturedStderr(), "");
  const Seen want{
      {dtrain::MessageLevel::kWarning, "a"}, {dtrain::MessageLevel::kWarning, "b"}, {dtrain::MessageLevel::kInfo, "c"}};
  EXPECT_EQ(seen, want);
}

TEST(Messages, AHandlerMayCallDtrainAndItsExceptionsAreDropped) {
  Seen seen;
  dtrain::set_message_handler([&seen](dtrain::MessageLevel l, const std::string& t) {
    seen.emplace_back(l, t);
    if (t == "outer") dtrain::info("inner");  // the channel's lock is not held here: no deadlock
    if (t == "throw") throw std::runtime_error("handler failed");
  });
  dtrain::warn("outer");
  EXPECT_NO_THROW(dtrain::warn("throw"));
  dtrain::set_message_handler(nullptr);
  ASSERT_EQ(seen.size(), 3u);
  EXPECT_EQ(seen[1].second, "inner");
  EXPECT_EQ(seen[2].second, "throw");
}

}  // namespace
