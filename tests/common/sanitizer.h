// Which sanitizer a test file is compiled under, asked the same way of both compilers: GCC defines
// __SANITIZE_ADDRESS__ and __SANITIZE_THREAD__, clang (14 at least) defines neither and answers
// __has_feature instead. Tests that skip or scale a bound under a sanitizer ask these
// (DTRAIN_TEST_SANITIZER: either of the two).
#pragma once

#if defined(__SANITIZE_ADDRESS__)
#define DTRAIN_TEST_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define DTRAIN_TEST_ASAN 1
#endif
#endif

#if defined(__SANITIZE_THREAD__)
#define DTRAIN_TEST_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define DTRAIN_TEST_TSAN 1
#endif
#endif

#if defined(DTRAIN_TEST_ASAN) || defined(DTRAIN_TEST_TSAN)
#define DTRAIN_TEST_SANITIZER 1
#endif
