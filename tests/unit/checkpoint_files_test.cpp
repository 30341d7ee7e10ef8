// Checkpoint files that cannot be planted, and restores that are all or nothing: a link planted where
// a temporary file goes is neither written through nor kept, what a killed save left is swept, a
// link of a checkpoint's name is not a checkpoint, a failed fsync of the folder is reported, and a
// checkpoint that fails half-way leaves the model and the optimizer as they were.
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <torch/torch.h>
#include <gtest/gtest.h>

#include <atomic>
#include <cerrno>
#include <filesystem>
#include <fstream>

#include "common/util.h"
#include "compat/optim_compat.h"
#include "dtrain/checkpoint.h"
#include "dtrain/sampler.h"
#include "matchers.h"
#include "test_util.h"

namespace fs = std::filesystem;
using dtrain::test_util::error_of;

// The folder fsync that write_atomic does, failed on demand: this definition takes the place of
// libc's for the whole test program (the others go straight to the system call), which in CI's
// trees is its group's executable (cmake/gtest_groups.cmake): the other programs of the group
// never set the flag, so their fsync is the system call's as before.
std::atomic<bool> g_fail_folder_fsync{false};
extern "C" int fsync(int fd) {
  struct stat sb {};
  if (g_fail_folder_fsync.load() && ::fstat(fd, &sb) == 0 && S_ISDIR(sb.st_mode)) {
    errno = EIO;
    return -1;
  }
  return static_cast<int>(::syscall(SYS_fsync, fd));
}

namespace {

struct SmallNetImpl : torch::nn::Module {
  SmallNetImpl() { fc = register_module("fc", torch::nn::Linear(4, 3)); }
  at::Tensor forward(at::Tensor x) { return fc->forward(x); }
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(SmallNet);

// `steps` Adam steps on random batches.
void take_steps(SmallNet& net, torch::optim::Optimizer& opt, int steps) {
  for (int i = 0; i < steps; ++i) {
    opt.zero_grad();
    torch::mse_loss(net->forward(torch::randn({8, 4})), torch::zeros({8, 3})).backward();
    opt.step();
  }
}

void put(const std::string& path, const std::string& bytes) { std::ofstream(path, std::ios::binary) << bytes; }

std::vector<std::string> names_in(const std::string& dir) {
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir)) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

class CheckpointFiles : public ::testing::Test {
 protected:
  void SetUp() override {
    root = (fs::temp_directory_path() / ("dtrain_ckfiles_" + std::to_string(::getpid()) + "_" +
                                         ::testing::UnitTest::GetInstance()->current_test_info()->name()))
               .string();
    fs::remove_all(root);
    dir = root + "/ckpt";
    fs::create_directories(dir);
    st.model = net.ptr().get();
  }
  void TearDown() override {
    g_fail_folder_fsync = false;
    fs::remove_all(root);
  }
  std::string root, dir;
  SmallNet net;
  dtrain::TrainingState st;
};

// The temporary file's name was predictable (".<name>.tmp.<pid>") and opened through a link with
// O_TRUNC: a link planted there had the save overwrite whatever it pointed at.
TEST_F(CheckpointFiles, APlantedTemporaryLinkIsNeitherFollowedNorKept) {
  const std::string victim = root + "/victim";
  put(victim, "precious");
  const std::vector<std::string> planted = {".checkpoint_0000000001.pt.tmp." + std::to_string(::getpid()),
                                            ".checkpoint_0000000001.pt.tmp.0123456789abcdef"};
  for (const std::string& name : planted) fs::create_symlink(victim, dir + "/" + name);
  st.step = 1;
  const std::string path = dtrain::CheckpointManager(dir).save(st);
  EXPECT_EQ(dtrain::util::read_file(victim), "precious");
  EXPECT_EQ(names_in(dir), std::vector<std::string>{"checkpoint_0000000001.pt"}) << "the planted links stay";
  EXPECT_TRUE(fs::is_regular_file(fs::symlink_status(path)));
}

// A save killed mid-write leaves its temporary files (its own and the shards'); the next save sweeps
// them, and only them.
TEST_F(CheckpointFiles, TemporaryFilesOfAKilledSaveAreSweptByTheNextSave) {
  const std::vector<std::string> left = {".checkpoint_0000000005.pt.tmp.12ab",
                                         ".checkpoint_0000000005.shard1-of-2.pt.tmp.34cd"};
  const std::vector<std::string> others = {".other_0000000005.pt.tmp.56ef", "notes.txt"};
  for (const std::string& name : left) put(dir + "/" + name, "half a checkpoint");
  for (const std::string& name : others) put(dir + "/" + name, "not ours");
  st.step = 6;
  dtrain::CheckpointManager(dir).save(st);
  EXPECT_EQ(names_in(dir),
            (std::vector<std::string>{".other_0000000005.pt.tmp.56ef", "checkpoint_0000000006.pt", "notes.txt"}));
}

// A link with a checkpoint's name (here to a real checkpoint, written later than the folder's own)
// is not one of the folder's checkpoints: list() leaves it out, load_latest does not read it, and
// rotation does not count it.
TEST_F(CheckpointFiles, OnlyRegularFilesAreCheckpoints) {
  st.step = 1;
  const std::string own = dtrain::CheckpointManager(dir).save(st);
  fs::create_directories(root + "/elsewhere");
  st.step = 9;
  const std::string foreign = dtrain::CheckpointManager(root + "/elsewhere").save(st);
  fs::create_symlink(foreign, dir + "/checkpoint_0000000009.pt");
  const dtrain::CheckpointManager mgr(dir);
  EXPECT_EQ(mgr.list(), std::vector<std::string>{own});
  SmallNet back;
  dtrain::TrainingState loaded;
  loaded.model = back.ptr().get();
  EXPECT_EQ(dtrain::CheckpointManager(dir).load_latest(loaded), own);
  EXPECT_EQ(loaded.step, 1);
}

// The folder's fsync makes the renamed file's name durable: its failure is one warning, and the
// checkpoint, which is in place, still loads.
TEST_F(CheckpointFiles, AFailedFolderSyncIsReported) {
  g_fail_folder_fsync = true;
  ::testing::internal::CaptureStderr();
  st.step = 3;
  const std::string path = dtrain::CheckpointManager(dir).save(st);
  const std::string err = ::testing::internal::GetCapturedStderr();
  g_fail_folder_fsync = false;
  EXPECT_THAT(err, HasSubstr("dtrain warning: checkpoint folder " + dir + ": fsync failed (Input/output error)"))
      << err;
  SmallNet back;
  dtrain::TrainingState loaded;
  loaded.model = back.ptr().get();
  EXPECT_EQ(dtrain::CheckpointManager(dir).load_latest(loaded), path);
}

// The checkpoint holds a model and an optimizer but no sampler, which the caller asked for: the load
// fails after the model and the optimizer were read, and must put both back.
TEST_F(CheckpointFiles, ARestoreThatFailsHalfWayChangesNothing) {
  torch::optim::Adam opt(net->parameters(), 0.01);
  st.optimizer = &opt;
  take_steps(net, opt, 3);
  st.step = 3;
  const std::string path = dtrain::CheckpointManager(dir).save(st);
  take_steps(net, opt, 2);  // the state now differs from the file's
  st.step = 5;
  std::vector<at::Tensor> params, moments;
  for (const at::Tensor& p : net->parameters()) {
    params.push_back(p.detach().clone());
    const auto& s = static_cast<torch::optim::AdamParamState&>(*opt.state().at(dtrain::compat::optimizer_state_key(p)));
    moments.push_back(s.exp_avg().clone());
  }
  dtrain::DistributedSampler sampler(100, dtrain::DistributedSamplerOptions().num_replicas(1).rank(0));
  st.sampler = &sampler;
  const std::string msg = error_of([&] { dtrain::load_checkpoint(path, st); });
  EXPECT_THAT(msg, HasSubstr("holds no sampler state")) << msg;
  EXPECT_EQ(st.step, 5);
  const auto now = net->parameters();
  for (size_t i = 0; i < now.size(); ++i) {
    EXPECT_TRUE(at::equal(now[i], params[i])) << "parameter " << i << " was left as the checkpoint has it";
    const auto& s =
        static_cast<torch::optim::AdamParamState&>(*opt.state().at(dtrain::compat::optimizer_state_key(now[i])));
    EXPECT_TRUE(at::equal(s.exp_avg(), moments[i])) << "Adam's exp_avg " << i << " was left as the checkpoint has it";
  }
}

}  // namespace
