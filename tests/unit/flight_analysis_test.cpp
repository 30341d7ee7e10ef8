// The flight records' pickle subset and the analysis that names the culprit (common/flight_analysis.h),
// on dumps made by hand: each case is the record a kind of hang or mismatch leaves.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <string>

#include "common/flight_analysis.h"
#include "common/flight_pickle.h"
#include "common/util.h"

namespace {

using json = nlohmann::json;
using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

TEST(Pickle, RoundTripKeepsEveryType) {
  json v = {{"version", "2.10"},
            {"n", nullptr},
            {"t", true},
            {"f", false},
            {"small", -5},
            {"big", int64_t{1} << 40},
            {"neg", -(int64_t{1} << 40)},
            {"x", 1.25},
            {"list", json::array({json::array({4, 2}), json::array()})},
            {"dict", json::object()}};
  EXPECT_EQ(dtrain::flight::pickle::loads(dtrain::flight::pickle::dumps(v)), v);
}

TEST(Pickle, ReadsWhatPythonWrites) {
  // pickle.dumps({'v':'2.10','e':[{'a':(1,2),'b':-5,'c':1.5,'d':None,'t':True,'f':2**40,'g':-2**40}],
  //               'p':{'0':{'r':'[0, 1]'}},'k':200,'m':70000}, protocol=5)
  const std::string b(
      "\x80\x05\x95\x87\x00\x00\x00\x00\x00\x00\x00\x7d\x94\x28\x8c\x01\x76\x94\x8c\x04\x32\x2e\x31\x30\x94\x8c\x01"
      "\x65\x94\x5d\x94\x7d\x94\x28\x8c\x01\x61\x94\x4b\x01\x4b\x02\x86\x94\x8c\x01\x62\x94\x4a\xfb\xff\xff\xff\x8c"
      "\x01\x63\x94\x47\x3f\xf8\x00\x00\x00\x00\x00\x00\x8c\x01\x64\x94\x4e\x8c\x01\x74\x94\x88\x8c\x01\x66\x94\x8a"
      "\x06\x00\x00\x00\x00\x00\x01\x8c\x01\x67\x94\x8a\x06\x00\x00\x00\x00\x00\xff\x75\x61\x8c\x01\x70\x94\x7d\x94"
      "\x8c\x01\x30\x94\x7d\x94\x8c\x01\x72\x94\x8c\x06\x5b\x30\x2c\x20\x31\x5d\x94\x73\x73\x8c\x01\x6b\x94\x4b\xc8"
      "\x8c\x01\x6d\x94\x4a\x70\x11\x01\x00\x75\x2e",
      146);
  json expected = {{"v", "2.10"},
                   {"e", json::array({{{"a", {1, 2}},
                                       {"b", -5},
                                       {"c", 1.5},
                                       {"d", nullptr},
                                       {"t", true},
                                       {"f", int64_t{1} << 40},
                                       {"g", -(int64_t{1} << 40)}}})},
                   {"p", {{"0", {{"r", "[0, 1]"}}}}},
                   {"k", 200},
                   {"m", 70000}};
  EXPECT_EQ(dtrain::flight::pickle::loads(b), expected);
}

TEST(Pickle, RejectsWhatItCannotRead) {
  EXPECT_THROW(dtrain::flight::pickle::loads(std::string("\x80\x02]", 3)), std::runtime_error);  // cut short
  try {
    dtrain::flight::pickle::loads(std::string("\x80\x02\x63os\nsystem\n.", 14));  // GLOBAL: a class
    FAIL() << "no exception";
  } catch (const std::runtime_error& e) {
    EXPECT_THAT(e.what(), HasSubstr("pickle: the global os.system is not plain data"));
  }  // l = []; l.append(l); pickle.dumps(l, 2): a cycle stops at a depth limit, not in the stack.
  try {
    dtrain::flight::pickle::loads(
        std::string("\x80\x02]q\x00h\x00"
                    "a.",
                    9));
    FAIL() << "no exception";
  } catch (const std::runtime_error& e) {
    EXPECT_THAT(e.what(), HasSubstr("nested deeper than 100"));
  }
}

// Each level a pair of the level below and a reference to it (memo): 206 bytes that, turned into
// JSON, would be 2^40 values; the reader refuses them by its budget before anything is copied.
TEST(Pickle, RefusesSharedValuesPastItsBudget) {
  std::string p("\x80\x02]q\x00", 5);
  for (int k = 1; k <= 40; ++k)
    p += std::string{'h', static_cast<char>(k - 1), static_cast<char>(0x86), 'q', static_cast<char>(k)};
  try {
    dtrain::flight::pickle::loads(p + ".");
    FAIL() << "no exception";
  } catch (const std::runtime_error& e) {
    EXPECT_THAT(e.what(), HasSubstr("pickle of 206 bytes shares values past its budget")) << e.what();
  }
}

// The flight recorder's default folder is a fixed name in /tmp (util::make_own_folder): one that
// another user could have made first, or planted a link at, is refused, naming what is wrong.
TEST(FlightFolder, AFixedNameIsUsedOnlyAsThisUsersOwnFolder) {
  char base[] = "/tmp/dtrain-own-folder-test-XXXXXX";
  ASSERT_NE(mkdtemp(base), nullptr);
  const std::string root = base, dir = root + "/flight";
  const auto refusal = [&](const std::string& path) -> std::string {
    try {
      dtrain::util::make_own_folder(path, "the flight-record folder", "set DTRAIN_FLIGHT_DIR");
    } catch (const std::exception& e) {
      return e.what();
    }
    return "";
  };
  EXPECT_EQ(refusal(dir), "");  // made
  struct stat sb {};
  ASSERT_EQ(stat(dir.c_str(), &sb), 0);
  EXPECT_TRUE(S_ISDIR(sb.st_mode));
  EXPECT_EQ(refusal(dir), "");  // there already, this user's
  ASSERT_EQ(chmod(dir.c_str(), 0777), 0);
  EXPECT_THAT(refusal(dir), HasSubstr("the flight-record folder " + dir +
                                      " is not this user's own folder (mode 0777: others may write in it): remove "
                                      "it, or set DTRAIN_FLIGHT_DIR"));
  const std::string link = root + "/link";
  ASSERT_EQ(symlink(dir.c_str(), link.c_str()), 0);
  EXPECT_THAT(refusal(link), HasSubstr("(a symbolic link)"));
  const std::string file = root + "/file";
  ASSERT_EQ(close(creat(file.c_str(), 0644)), 0);
  EXPECT_THAT(refusal(file), HasSubstr("(not a folder)"));
  if (geteuid() == 0) {  // another owner: root can make one
    ASSERT_EQ(chmod(dir.c_str(), 0755), 0);
    ASSERT_EQ(chown(dir.c_str(), 12345, 12345), 0);
    EXPECT_THAT(refusal(dir), HasSubstr("(owner uid 12345, not 0)"));
  }
  unlink(file.c_str());
  unlink(link.c_str());
  rmdir(dir.c_str());
  rmdir(root.c_str());
}

// A rank's dump in the shape src/comm/flight_recorder.cpp writes (times in seconds for brevity).
struct Dump {
  Dump(int r, int w) : rank(r), world(w) {}
  int rank;
  int world;
  double dump_s = 100;
  std::vector<json> entries;

  // A collective: op, sizes of its one input, state, created (s).
  Dump& coll(int64_t seq, const std::string& op, std::vector<int64_t> sizes, const std::string& state,
             double created = 50, const std::string& dtype = "Float", const std::string& group = "default") {
    json e = base(op, state, created, group);
    e["collective_seq_id"] = seq;
    e["input_sizes"] = json::array({sizes});
    e["input_dtypes"] = json::array({dtype});
    entries.push_back(e);
    return *this;
  }
  Dump& p2p(const std::string& op, int peer, int64_t peer_seq, const std::string& state, double created = 50) {
    json e = base(op, state, created, "default");
    e["is_p2p"] = true;
    e["dtrain_peer"] = peer;
    e["dtrain_peer_seq"] = peer_seq;
    e["input_sizes"] = json::array({json::array({4})});
    e["input_dtypes"] = json::array({"Float"});
    entries.push_back(e);
    return *this;
  }
  json base(const std::string& op, const std::string& state, double created, const std::string& group) const {
    const auto ns = [](double s) { return static_cast<int64_t>(s * 1e9); };
    return {{"process_group", {group, group}},
            {"profiling_name", "gloo:" + op},
            {"dtrain_op", op},
            {"is_p2p", false},
            {"collective_seq_id", 0},
            {"p2p_seq_id", 0},
            {"state", state},
            {"time_created_ns", ns(created)},
            {"time_discovered_completed_ns", state == "completed" ? json(ns(created + 0.01)) : json(nullptr)}};
  }
  json done() const {
    std::string ranks = "[";
    for (int i = 0; i < world; ++i) ranks += std::to_string(i) + (i + 1 < world ? ", " : "]");
    return {{"version", "2.10"},
            {"rank", rank},
            {"dtrain", {{"dump_time_ns", static_cast<int64_t>(dump_s * 1e9)}, {"world_size", world}}},
            {"pg_config", {{"default", {{"name", "default"}, {"desc", "default_pg"}, {"ranks", ranks}}}}},
            {"entries", entries}};
  }
};

TEST(FlightAnalysis, NamesTheRankThatDidNotEnterTheHungCollective) {
  std::vector<json> dumps;
  for (int r : {0, 1, 3})
    dumps.push_back(
        Dump{r, 4}.coll(57, "all_reduce", {4}, "completed", 60).coll(58, "all_reduce", {4}, "started", 69.8).done());
  dumps.push_back(Dump{2, 4}.coll(57, "all_reduce", {4}, "completed", 60).done());
  auto lines = dtrain::flight::analyze(dumps, 4);
  ASSERT_EQ(lines.size(), 2u);
  EXPECT_EQ(lines[0],
            "hang in group 'default' at all_reduce #58: ranks 0, 1, 3 entered it 30.2 s ago; rank 2 completed #57 and "
            "has not entered #58");
  EXPECT_EQ(lines[1],
            "rank 2 has made no call for 40.0 s while the others wait: it is computing or stuck outside dtrain");
}

TEST(FlightAnalysis, NamesARankThatLeftNoDump) {
  std::vector<json> dumps;
  for (int r : {0, 1}) dumps.push_back(Dump{r, 3}.coll(9, "broadcast", {4}, "failed", 95).done());
  auto lines = dtrain::flight::analyze(dumps, 3);
  ASSERT_EQ(lines.size(), 1u);
  EXPECT_THAT(lines[0], AllOf(HasSubstr("hang in group 'default' at broadcast #9: ranks 0, 1 entered it 5.0 s ago"),
                              HasSubstr("rank 2 left no record")));
}

TEST(FlightAnalysis, NamesTheRankThatCallsAnotherOperation) {
  std::vector<json> dumps;
  for (int r : {0, 2}) dumps.push_back(Dump{r, 3}.coll(58, "all_reduce", {4}, "started").done());
  dumps.push_back(Dump{1, 3}.coll(58, "broadcast", {4}, "started").done());
  EXPECT_THAT(dtrain::flight::analyze(dumps, 3),
              ElementsAre("ranks disagree at #58 of group 'default': rank 1 calls broadcast, the others all_reduce"));
}

TEST(FlightAnalysis, NamesTheRankThatPassesOtherSizesOrDtypes) {
  std::vector<json> dumps;
  for (int r : {0, 1, 2}) dumps.push_back(Dump{r, 4}.coll(58, "all_reduce", {4}, "started").done());
  dumps.push_back(Dump{3, 4}.coll(58, "all_reduce", {5}, "started").done());
  EXPECT_THAT(dtrain::flight::analyze(dumps, 4),
              ElementsAre("sizes differ at #58 of group 'default' (all_reduce): rank 3 passes [5], the others [4]"));
  dumps[3] = Dump{3, 4}.coll(58, "all_reduce", {4}, "started", 50, "Double").done();
  EXPECT_THAT(
      dtrain::flight::analyze(dumps, 4),
      ElementsAre("dtypes differ at #58 of group 'default' (all_reduce): rank 3 passes Double, the others Float"));
}

// An all-to-all's ranks send and receive different amounts by design: only its dtype must agree.
TEST(FlightAnalysis, AllToAllRanksMayPassDifferentSizes) {
  std::vector<json> dumps;
  for (int r : {0, 1, 2}) dumps.push_back(Dump{r, 3}.coll(7, "all_to_all_single", {r + 1, 2}, "completed").done());
  const auto lines = dtrain::flight::analyze(dumps, 3);
  ASSERT_EQ(lines.size(), 1u);
  EXPECT_THAT(lines[0], HasSubstr("no hang or mismatch in the records of 3 ranks"));
  dumps[2] = Dump{2, 3}.coll(7, "all_to_all_single", {3, 2}, "completed", 50, "Double").done();
  EXPECT_THAT(dtrain::flight::analyze(dumps, 3),
              ElementsAre("dtypes differ at #7 of group 'default' (all_to_all_single): rank 2 passes Double, the "
                          "others Float"));
}

TEST(FlightAnalysis, RecognisesASkippedCallInARepeatingStep) {
  // Each step: the gradients' all_reduce [10], then the loss's [1]. Rank 1 skips the loss's at #5.
  std::vector<json> dumps;
  for (int r : {0, 2}) {
    Dump d{r, 3};
    for (int s = 0; s < 5; ++s) d.coll(s, "all_reduce", {s % 2 ? 1 : 10}, "completed");
    dumps.push_back(d.coll(5, "all_reduce", {1}, "failed").done());
  }
  Dump skipper{1, 3};
  for (int s = 0; s < 5; ++s) skipper.coll(s, "all_reduce", {s % 2 ? 1 : 10}, "completed");
  dumps.push_back(skipper.coll(5, "all_reduce", {10}, "failed").done());
  EXPECT_THAT(dtrain::flight::analyze(dumps, 3),
              ElementsAre(AllOf(HasSubstr("rank 1 skipped all_reduce #5 of group 'default' ([1] Float)"),
                                HasSubstr("rank 1 calls all_reduce [10], the call that comes after it"))));
}

TEST(FlightAnalysis, NamesARecvWhoseSendNeverCame) {
  std::vector<json> dumps;
  dumps.push_back(Dump{0, 2}.p2p("send", 1, 1, "completed", 40).done());
  dumps.push_back(Dump{1, 2}.p2p("recv", 0, 1, "completed", 40).p2p("recv", 0, 2, "started", 90).done());
  auto lines = dtrain::flight::analyze(dumps, 2);
  ASSERT_EQ(lines.size(), 1u);
  EXPECT_THAT(lines[0], AllOf(HasSubstr("recv with no matching send in group 'default': rank 1 waits in recv #2 from "
                                        "rank 0 (tag 0) for 10.0 s"),
                              HasSubstr("rank 0 made 1 matching send to it and has made no call for 60.0 s")));
}

TEST(FlightAnalysis, SaysSoWhenEverythingCompleted) {
  std::vector<json> dumps;
  for (int r : {0, 1}) dumps.push_back(Dump{r, 2}.coll(3, "barrier", {}, "completed").done());
  EXPECT_THAT(dtrain::flight::analyze(dumps, 2), ElementsAre(HasSubstr("no hang or mismatch")));
}

}  // namespace
