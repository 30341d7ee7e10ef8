// The main of a group of GoogleTest programs compiled as one (cmake/gtest_groups.cmake), which
// defines dtrain_gtest_group::kPrograms, each program's name and files, before including this. Each
// program is a link to the group's executable by its own name, and runs the cases of its own files as
// it did built alone: the other files' cases are filtered out (after any filter given), and a name
// that is no program of the group fails at once. Define DTRAIN_GTEST_GROUP_ENVIRONMENT to a new
// ::testing::Environment to add (the multi-rank programs' DistEnvironment).
#pragma once

#include <gtest/gtest.h>

#include <cstdio>
#include <string>
#include <utility>
#include <vector>

namespace dtrain_gtest_group {

inline bool one_of(const std::vector<std::string>& files, const std::string& path) {
  const std::string base = path.substr(path.find_last_of('/') + 1);
  for (const auto& f : files)
    if (f == base) return true;
  return false;
}

inline bool disabled(const ::testing::TestInfo& info) {
  return std::string(info.test_suite_name()).rfind("DISABLED_", 0) == 0 ||
         std::string(info.name()).rfind("DISABLED_", 0) == 0;
}

// The cases of the other programs' files, as GoogleTest's negative filter ("A.b:C.d"); `mine` counts
// the program's own that run unfiltered. The group's files name their suites apart, so that a name
// excluded is no case of the program's.
inline std::string other_files_cases(const std::vector<std::string>& files, int* mine) {
  std::string others;
  const auto& unit = *::testing::UnitTest::GetInstance();
  for (int i = 0; i < unit.total_test_suite_count(); ++i) {
    const auto& suite = *unit.GetTestSuite(i);
    for (int j = 0; j < suite.total_test_count(); ++j) {
      const auto& info = *suite.GetTestInfo(j);
      if (one_of(files, info.file())) {
        *mine += !disabled(info);
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
  const std::vector<std::string>* files = nullptr;
  std::string names;
  for (const auto& [name, its_files] : dtrain_gtest_group::kPrograms) {
    if (name == program) files = &its_files;
    names += (names.empty() ? "" : ", ") + name;
  }
  if (!files) {
    std::fprintf(stderr, "%s: %s is no program of this group: run one of %s, links beside it\n", argv[0],
                 program.c_str(), names.c_str());
    return 2;
  }
  int mine = 0;
  const std::string others = dtrain_gtest_group::other_files_cases(*files, &mine);
  const std::string given = ::testing::GTEST_FLAG(filter);
  ::testing::GTEST_FLAG(filter) =
      others.empty() ? given : given + (given.find('-') == std::string::npos ? "-" : ":") + others;
#ifdef DTRAIN_GTEST_GROUP_ENVIRONMENT
  ::testing::AddGlobalTestEnvironment(DTRAIN_GTEST_GROUP_ENVIRONMENT);
#endif
  const int rc = RUN_ALL_TESTS();
  // Unfiltered, a program runs exactly its files' cases: a selection that ran another program's or
  // dropped some of its own fails here rather than passing.
  const int ran = ::testing::UnitTest::GetInstance()->test_to_run_count();
  if (given == "*" && ran != mine) {
    std::fprintf(stderr, "%s: ran %d test cases, but its files have %d: the group's selection is wrong\n", argv[0], ran,
                 mine);
    return 1;
  }
  return rc;
}
