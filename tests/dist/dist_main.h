// Shared main for multi-rank GoogleTest programs run through dtrain-run: every rank runs every test;
// init before, destroy after. A failing assertion on any rank makes that rank exit non-zero, and
// dtrain-run then stops the others and fails the ctest test with the rank's output.
#pragma once

#include <gtest/gtest.h>

#include "dtrain/process_group.h"

class DistEnvironment : public ::testing::Environment {
 public:
  void SetUp() override { dtrain::init_process_group(); }
  void TearDown() override { dtrain::destroy_process_group(); }
};

#define DTRAIN_DIST_TEST_MAIN()                                         \
  int main(int argc, char** argv) {                                     \
    ::testing::InitGoogleTest(&argc, argv);                             \
    ::testing::AddGlobalTestEnvironment(new DistEnvironment());         \
    return RUN_ALL_TESTS();                                             \
  }
