// Shared main for multi-rank GoogleTest programs run through dtrain-run: every rank runs every test;
// init before, destroy after. A failing assertion on any rank makes that rank exit non-zero, and
// dtrain-run then stops the others and fails the ctest test with the rank's output.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <string>

#include "dtrain/process_group.h"

// ctest runs some programs twice on one host: as is, where the default group takes shared memory,
// and with DTRAIN_SHM=0 (dtrain_dist_test_gloo in CMakeLists.txt), where it must take Gloo alone, the
// path between hosts. A program checks which one it got, so that neither variant can silently test
// the other's path.
inline bool shm_disabled_by_env() {
  const char* v = std::getenv("DTRAIN_SHM");
  return v && std::string(v) == "0";
}
inline void expect_default_group_transport_from_env() {
  EXPECT_EQ(dtrain::Group().uses_shared_memory(), !shm_disabled_by_env())
      << "DTRAIN_SHM=" << (std::getenv("DTRAIN_SHM") ? std::getenv("DTRAIN_SHM") : "(unset)")
      << ", ranks of one host: the default group runs over the other transport";
}

class DistEnvironment : public ::testing::Environment {
 public:
  void SetUp() override { dtrain::init_process_group(); }
  void TearDown() override { dtrain::destroy_process_group(); }
};

#define DTRAIN_DIST_TEST_MAIN()                                 \
  int main(int argc, char** argv) {                             \
    ::testing::InitGoogleTest(&argc, argv);                     \
    ::testing::AddGlobalTestEnvironment(new DistEnvironment()); \
    return RUN_ALL_TESTS();                                     \
  }

// A program run in two phases, the second on another world size: `<program> save|load <dir> [<saved
// world>]` (its ctest tests: the save as the fixture of the loads). The arguments, after GoogleTest's.
struct PhaseArgs {
  std::string phase, dir;
  int64_t saved_world = 0;
};
inline PhaseArgs& phase_args() {
  static PhaseArgs args;
  return args;
}

#define DTRAIN_DIST_PHASE_TEST_MAIN()                              \
  int main(int argc, char** argv) {                                \
    ::testing::InitGoogleTest(&argc, argv);                        \
    if (argc >= 3) {                                               \
      phase_args().phase = argv[1];                                \
      phase_args().dir = argv[2];                                  \
    }                                                              \
    if (argc >= 4) phase_args().saved_world = std::atoll(argv[3]); \
    ::testing::AddGlobalTestEnvironment(new DistEnvironment());    \
    return RUN_ALL_TESTS();                                        \
  }
