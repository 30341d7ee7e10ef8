// gMock matchers for the tests' checks of messages, in place of find(...) != npos:
//   EXPECT_THAT(err, HasSubstr("rank 1"));                 // prints the whole text when it fails
//   EXPECT_THAT(log, Not(HasSubstr("\n")));
//   EXPECT_THAT([&] { pg.all_reduce(t); }, ThrowsDtrainError(HasSubstr("all_reduce")));
#pragma once

#include <gmock/gmock.h>

#include "dtrain/errors.h"

using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::Not;

// Matches a callable that throws dtrain::Error whose what() matches `m`.
template <typename Matcher>
auto ThrowsDtrainError(Matcher m) {
  return ::testing::ThrowsMessage<dtrain::Error>(std::move(m));
}
