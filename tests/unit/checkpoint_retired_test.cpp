// Checkpoints written by the dtrain of 2026-12-05 (commit 7f92b70, the same formats as 4edecd7), in
// tests/data/retired_sharded/: a fully_shard'ed model's (format version 1 with a shard file per
// rank, 2 ranks), a tensor-parallel model's (version 3) and a whole model's (version 1). The sharded
// ones are refused in one line naming the version and the way to convert them, also by load_latest,
// which must not fall back past them to an older checkpoint; the whole one still loads.
#include <gtest/gtest.h>
#include <torch/optim/adam.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "dtrain/checkpoint.h"
#include "common/util.h"
#include "dtrain/errors.h"
#include "fsdp_models.h"
#include "matchers.h"

namespace fs = std::filesystem;
using namespace dtrain;

namespace {

// A copy of one fixture folder (a load must not depend on the source tree being writable).
std::string copy_of(const std::string& name) {
  const fs::path from = fs::path(DTRAIN_RETIRED_DIR) / name;
  const fs::path to = fs::temp_directory_path() / ("dtrain_retired_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(to);
  fs::copy(from, to, fs::copy_options::recursive);
  return to.string();
}

const auto kRefusal = [](const std::string& version) {
  return ::testing::AllOf(::testing::HasSubstr("format version " + version),
                          ::testing::HasSubstr("which this dtrain no longer reads"),
                          ::testing::HasSubstr("save_checkpoint"));
};

}  // namespace

TEST(RetiredCheckpoint, ShardedFilesAreRefusedInOneLine) {
  for (const auto& [name, version] : {std::pair<std::string, std::string>{"fsdp", "1"}, {"tp", "3"}}) {
    const std::string dir = copy_of(name);
    fsdp_models::Net net = fsdp_models::make_net();
    TrainingState st;
    st.model = net.ptr().get();
    CheckpointManager ckpt(dir);
    ASSERT_EQ(ckpt.list().size(), 1u) << name;
    EXPECT_THAT([&] { ckpt.load_latest(st); }, ThrowsDtrainError(kRefusal(version))) << name;
    EXPECT_THAT([&] { load_checkpoint(ckpt.list()[0], st); }, ThrowsDtrainError(kRefusal(version))) << name;
    fs::remove_all(dir);
  }
}

TEST(RetiredCheckpoint, LoadLatestDoesNotFallBackPastOne) {
  // An older whole checkpoint in the same folder must not be resumed silently instead: the whole
  // fixture, its header's write stamp (outside the CRC) set to 1, the oldest possible write.
  const std::string dir = copy_of("fsdp");
  std::string bytes = util::read_file(std::string(DTRAIN_RETIRED_DIR) + "/whole/checkpoint_0000000005.pt", "fixture");
  const size_t nl = bytes.find('\n'), stamp = bytes.rfind(' ', nl);
  bytes = bytes.substr(0, stamp) + " 1" + bytes.substr(nl);
  std::ofstream(dir + "/checkpoint_0000000001.pt", std::ios::binary) << bytes;
  fsdp_models::Net net = fsdp_models::make_net();
  TrainingState st;
  st.model = net.ptr().get();
  CheckpointManager ckpt(dir);
  EXPECT_THAT([&] { ckpt.load_latest(st); }, ThrowsDtrainError(kRefusal("1")));
  EXPECT_EQ(st.step, 0) << "an older checkpoint was resumed";
  fs::remove_all(dir);
}

TEST(RetiredCheckpoint, AWholeModelsFileStillLoads) {
  const std::string dir = copy_of("whole");
  fsdp_models::Net saved = fsdp_models::make_net();  // what the fixture holds: make_net()'s weights
  torch::manual_seed(77);
  fsdp_models::Net net;
  net->to(at::kDouble);
  torch::optim::Adam opt(net->parameters(), torch::optim::AdamOptions(1e-2));
  TrainingState st;
  st.model = net.ptr().get();
  st.optimizer = &opt;
  ASSERT_EQ(CheckpointManager(dir).load_latest(st), dir + "/checkpoint_0000000005.pt");
  EXPECT_EQ(st.step, 5);
  auto a = saved->named_parameters(), b = net->named_parameters();
  for (const auto& kv : a) EXPECT_TRUE(at::equal(kv.value(), b[kv.key()])) << kv.key();
  fs::remove_all(dir);
}
