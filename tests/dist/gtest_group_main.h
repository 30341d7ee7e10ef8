// The main of a group of multi-rank GoogleTest programs compiled as one (gtest_programs.cmake). Each
// program is a link to the group's executable by its own name, and runs the cases of its own file,
// <name>.cpp, as it did built alone: the other files' cases are filtered out (after any filter given),
// and a name that matches no file of the group fails at once. A failing case fails its rank as
// DTRAIN_DIST_TEST_MAIN's programs do (dist_main.h).
#pragma once

#include <gtest/gtest.h>

#include <cstdio>
#include <string>

#include "dist_main.h"

namespace dtrain_gtest_group {

inline bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// The cases of the other files, as GoogleTest's negative filter ("A.b:C.d"); `mine` counts the
// program's own. The groups' files name their suites apart, so that a name excluded is no case of
// the program's.
inline std::string other_files_cases(const std::string& program, int* mine) {
  const std::string own = "/" + program + ".cpp";
  std::string others;
  const auto& unit = *::testing::UnitTest::GetInstance();
  for (int i = 0; i < unit.total_test_suite_count(); ++i) {
    const auto& suite = *unit.GetTestSuite(i);
    for (int j = 0; j < suite.total_test_count(); ++j) {
      const auto& info = *suite.GetTestInfo(j);
      if (ends_with(info.file(), own)) {
        const bool disabled = std::string(info.test_suite_name()).rfind("DISABLED_", 0) == 0 ||
                              std::string(info.name()).rfind("DISABLED_", 0) == 0;
        *mine += !disabled;
      } else {
        others += (others.empty() ? "" : ":") + std::string(info.test_suite_name()) + "." + info.name();
      }
    }
  }
  return others;
}

}  // namespace dtrain_gtest_group

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  std::string program = argv[0];
  program = program.substr(program.find_last_of('/') + 1);
  int mine = 0;
  const std::string others = dtrain_gtest_group::other_files_cases(program, &mine);
  if (mine == 0) {
    std::fprintf(stderr,
                 "%s: no test of this group is in %s.cpp: run the group through one of its programs' links "
                 "(gtest_programs.cmake)\n",
                 argv[0], program.c_str());
    return 2;
  }
  const std::string given = ::testing::GTEST_FLAG(filter);
  ::testing::GTEST_FLAG(filter) =
      others.empty() ? given : given + (given.find('-') == std::string::npos ? "-" : ":") + others;
  ::testing::AddGlobalTestEnvironment(new DistEnvironment());
  const int rc = RUN_ALL_TESTS();
  // Unfiltered, a program runs exactly its file's cases: a selection that ran another file's or
  // dropped some of its own fails here rather than passing.
  const int ran = ::testing::UnitTest::GetInstance()->test_to_run_count();
  if (given == "*" && ran != mine) {
    std::fprintf(stderr, "%s: ran %d test cases, but %s.cpp has %d: the group's selection is wrong\n", argv[0], ran,
                 program.c_str(), mine);
    return 1;
  }
  return rc;
}
