// Checkpoints in one process: round trip of model/optimizer/scaler/sampler/RNG/values, the file
// header, corrupt and truncated files (with fallback to the previous one), a different model, the
// folder in the way, keep, resume_at reaching the DataLoader's copy of the sampler, the hook a
// sharded optimizer is saved through, and the write order (Note [Write order]): a restarted run's
// lower step is the latest, kept by rotation and loaded, with a warning; ascending rotation as before.
#include "dtrain/checkpoint.h"
#include "matchers.h"

#include <sys/stat.h>
#include <unistd.h>

#include <torch/torch.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "checkpoint/frame.h"
#include "dtrain/amp.h"
#include "dtrain/errors.h"
#include "dtrain/sampler.h"
#include "dtrain/sharded_optimizer.h"
#include "test_util.h"

namespace fs = std::filesystem;
using dtrain::test_util::error_of;

namespace {

struct NetImpl : torch::nn::Module {
  explicit NetImpl(int hidden = 8) {
    fc1 = register_module("fc1", torch::nn::Linear(4, hidden));
    bn = register_module("bn", torch::nn::BatchNorm1d(hidden));
    fc2 = register_module("fc2", torch::nn::Linear(hidden, 2));
  }
  at::Tensor forward(at::Tensor x) { return fc2->forward(torch::relu(bn->forward(fc1->forward(x)))); }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  torch::nn::BatchNorm1d bn{nullptr};
};
TORCH_MODULE(Net);

void train_steps(Net& net, torch::optim::Optimizer& opt, int n) {
  for (int i = 0; i < n; ++i) {
    opt.zero_grad();
    net->forward(torch::randn({8, 4})).pow(2).mean().backward();
    opt.step();
  }
}

std::string read(const std::string& p) {
  std::ifstream f(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), {});
}
void write(const std::string& p, const std::string& s) { std::ofstream(p, std::ios::binary) << s; }

std::vector<float> flat(Net& net) {
  std::vector<float> out;
  for (const auto& t : net->parameters()) {
    auto c = t.detach().contiguous();
    out.insert(out.end(), c.data_ptr<float>(), c.data_ptr<float>() + c.numel());
  }
  return out;
}

class Checkpoint : public ::testing::Test {
 protected:
  void SetUp() override {
    // A parameterized case is named "Case/0": its '/' would make a folder inside one that TearDown
    // leaves behind.
    std::string name = ::testing::UnitTest::GetInstance()->current_test_info()->name();
    std::replace(name.begin(), name.end(), '/', '_');
    dir = (fs::temp_directory_path() / ("dtrain_ckpt_" + std::to_string(::getpid()) + "_" + name)).string();
    fs::remove_all(dir);
  }
  void TearDown() override {
    ::chmod(dir.c_str(), 0755);
    fs::remove_all(dir);
  }
  std::string dir;
};

// A file's world_size sized the ranks' states before any was read: 2^40 of them for a file of a
// few hundred bytes. The states are read while there are, so the number costs nothing itself.
TEST_F(Checkpoint, AWorldSizeBeyondTheFileAllocatesNothing) {
  torch::serialize::OutputArchive a;
  a.write("version", c10::IValue(int64_t{1}));
  a.write("world_size", c10::IValue(int64_t{1} << 40));
  std::ostringstream os;
  a.save_to(os);
  fs::create_directories(dir);
  const std::string path = dir + "/hostile.ckpt";
  std::ofstream(path, std::ios::binary) << dtrain::ckpt::frame(os.str(), 1);
  dtrain::TrainingState st;
  EXPECT_THAT(error_of([&] { dtrain::load_checkpoint(path, st); }),
              HasSubstr("lacks the state of rank 0 of its world_size 1099511627776"));
}

TEST_F(Checkpoint, RoundTripContinuesExactly) {
  torch::manual_seed(1);
  Net a;
  torch::optim::Adam opt_a(a->parameters(), torch::optim::AdamOptions(1e-2));
  dtrain::GradScaler scaler_a(dtrain::GradScalerOptions().init_scale(1024));
  scaler_a.scale(torch::ones({1}));  // the scale exists from the first scale() on, as PyTorch's
  scaler_a.update(512.0);
  ASSERT_EQ(scaler_a.get_scale(), 512.0);
  dtrain::DistributedSampler sampler_a(100, dtrain::DistributedSamplerOptions().num_replicas(2).rank(1).seed(7));
  sampler_a.set_epoch(3);
  train_steps(a, opt_a, 3);

  dtrain::TrainingState st;
  st.model = a.ptr().get();
  st.optimizer = &opt_a;
  st.scaler = &scaler_a;
  st.sampler = &sampler_a;
  st.sampler_position = 20;
  st.step = 3;
  st.epoch = 4;
  st.values = {{"loss_sum", 1.25}, {"seen", 24}};
  dtrain::CheckpointManager mgr(dir);
  const std::string path = mgr.save(st);
  EXPECT_EQ(path, dir + "/checkpoint_0000000003.pt");
  EXPECT_EQ(read(path).rfind("DTRAIN-CHECKPOINT 1 ", 0), 0u) << "header line with the format version";

  // Continue the original for 2 steps (the RNG continues from the saved state).
  train_steps(a, opt_a, 2);
  const auto expected = flat(a);

  // A fresh process's objects: other weights, other RNG position.
  torch::manual_seed(99);
  Net b;
  torch::optim::Adam opt_b(b->parameters(), torch::optim::AdamOptions(1e-2));
  dtrain::GradScaler scaler_b;
  dtrain::DistributedSampler sampler_b(100, dtrain::DistributedSamplerOptions().num_replicas(2).rank(1).seed(7));
  auto loader_copy = sampler_b;  // what make_data_loader holds
  dtrain::TrainingState back;
  back.model = b.ptr().get();
  back.optimizer = &opt_b;
  back.scaler = &scaler_b;
  back.sampler = &sampler_b;
  auto loaded = mgr.load_latest(back);
  ASSERT_TRUE(loaded);
  EXPECT_EQ(*loaded, path);
  EXPECT_EQ(back.step, 3);
  EXPECT_EQ(back.epoch, 4);
  EXPECT_EQ(back.sampler_position, 20);
  EXPECT_EQ(back.values.at("loss_sum"), 1.25);
  EXPECT_EQ(back.values.at("seen"), 24);
  EXPECT_EQ(scaler_b.get_scale(), 512.0);
  EXPECT_EQ(sampler_b.epoch(), 3);
  EXPECT_EQ(loader_copy.epoch(), 3);

  // The loader's copy resumes at position 20 of epoch 3, once.
  loader_copy.reset();
  auto batch = loader_copy.next(5);
  ASSERT_TRUE(batch);
  const auto all = sampler_b.indices();
  EXPECT_EQ(static_cast<int64_t>((*batch)[0]), all[20]);
  loader_copy.reset();
  EXPECT_EQ(static_cast<int64_t>((*loader_copy.next(5))[0]), all[0]);

  train_steps(b, opt_b, 2);  // same RNG draws and Adam state: bit-identical
  EXPECT_EQ(flat(b), expected);
}

// PyTorch's load_state_dict restores each param group's hyperparameters: a run whose schedule moved
// the lr resumes at the saved lr, whatever the optimizer was built with (LibTorch 1.13's load() alone
// kept the new optimizer's own: compat::restore_param_group_options).
TEST_F(Checkpoint, TheOptimizersHyperparametersComeBackAsSaved) {
  namespace o = torch::optim;
  const auto lr_of = [](o::Optimizer& opt) { return opt.param_groups()[0].options().get_lr(); };
  const auto round_trip = [&](const std::string& name, auto make) {
    torch::manual_seed(1);
    Net a;
    auto opt_a = make(a->parameters(), 0.5);
    train_steps(a, *opt_a, 2);
    opt_a->param_groups()[0].options().set_lr(0.0125);  // what a schedule does between steps
    dtrain::TrainingState st;
    st.model = a.ptr().get();
    st.optimizer = opt_a.get();
    dtrain::CheckpointManager mgr(dir + "/" + name);
    mgr.save(st);
    Net b;
    auto opt_b = make(b->parameters(), 0.5);
    dtrain::TrainingState back;
    back.model = b.ptr().get();
    back.optimizer = opt_b.get();
    ASSERT_TRUE(mgr.load_latest(back)) << name;
    EXPECT_EQ(lr_of(*opt_b), 0.0125) << name;
  };
  round_trip("sgd", [](auto p, double lr) { return std::make_unique<o::SGD>(p, o::SGDOptions(lr).momentum(0.9)); });
  round_trip("adam", [](auto p, double lr) { return std::make_unique<o::Adam>(p, o::AdamOptions(lr)); });
  round_trip("adamw", [](auto p, double lr) { return std::make_unique<o::AdamW>(p, o::AdamWOptions(lr)); });
  round_trip("adagrad", [](auto p, double lr) { return std::make_unique<o::Adagrad>(p, o::AdagradOptions(lr)); });
  round_trip("rmsprop", [](auto p, double lr) { return std::make_unique<o::RMSprop>(p, o::RMSpropOptions(lr)); });
}

TEST_F(Checkpoint, EmptyFolderLoadsNothing) {
  Net net;
  dtrain::TrainingState st;
  st.model = net.ptr().get();
  EXPECT_FALSE(dtrain::CheckpointManager(dir).load_latest(st));
}

TEST_F(Checkpoint, KeepsTheNewestTwoAndNoTemporaryFiles) {
  Net net;
  dtrain::TrainingState st;
  st.model = net.ptr().get();
  dtrain::CheckpointManager mgr(dir);
  for (int s = 1; s <= 4; ++s) {
    st.step = s;
    mgr.save(st);
  }
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir)) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names, (std::vector<std::string>{"checkpoint_0000000003.pt", "checkpoint_0000000004.pt"}));
}

class Corruption : public Checkpoint, public ::testing::WithParamInterface<std::string> {};

TEST_P(Corruption, NewestBadFallsBackToThePreviousWithAWarning) {
  Net net;
  dtrain::TrainingState st;
  st.model = net.ptr().get();
  dtrain::CheckpointManager mgr(dir);
  st.step = 1;
  mgr.save(st);
  const auto good = flat(net);
  torch::NoGradGuard ng;
  for (auto& p : net->parameters()) p.add_(1.0);
  st.step = 2;
  const std::string newest = mgr.save(st);
  std::string bytes = read(newest);
  if (GetParam() == "truncated") bytes.resize(bytes.size() / 2);
  if (GetParam() == "bitflip") bytes[bytes.size() / 2] ^= 0x10;
  if (GetParam() == "garbage") bytes = "not a checkpoint at all";
  write(newest, bytes);

  Net other;
  dtrain::TrainingState back;
  back.model = other.ptr().get();
  ::testing::internal::CaptureStderr();
  auto loaded = mgr.load_latest(back);
  const std::string err = ::testing::internal::GetCapturedStderr();
  ASSERT_TRUE(loaded);
  EXPECT_EQ(*loaded, dir + "/checkpoint_0000000001.pt");
  EXPECT_THAT(err, HasSubstr("dtrain warning: checkpoint " + newest + " is unusable")) << err;
  // A file without its header line has no known write order: it is never tried, only reported.
  EXPECT_THAT(err, HasSubstr(GetParam() == "garbage" ? "; ignored" : "falling back to the previous one")) << err;
  const char* reason = GetParam() == "truncated" ? "truncated"
                       : GetParam() == "bitflip" ? "CRC-32"
                                                 : "not a dtrain checkpoint";
  EXPECT_THAT(err, HasSubstr(reason)) << err;
  EXPECT_EQ(flat(other), good);

  // The single-file loader names the file and the reason.
  const std::string msg = error_of([&] { dtrain::load_checkpoint(newest, back); });
  EXPECT_THAT(msg, HasSubstr("checkpoint " + newest + " is unusable: ")) << msg;
  EXPECT_THAT(msg, HasSubstr(reason)) << msg;
}
INSTANTIATE_TEST_SUITE_P(Kinds, Corruption, ::testing::Values("truncated", "bitflip", "garbage"));

TEST_F(Checkpoint, AllBadIsAnErrorNamingTheFolder) {
  fs::create_directories(dir);
  write(dir + "/checkpoint_0000000005.pt", "junk");
  Net net;
  dtrain::TrainingState st;
  st.model = net.ptr().get();
  ::testing::internal::CaptureStderr();
  const std::string msg = error_of([&] { dtrain::CheckpointManager(dir).load_latest(st); });
  ::testing::internal::GetCapturedStderr();
  EXPECT_THAT(msg, HasSubstr("none of the 1 checkpoint(s) in " + dir + " is usable")) << msg;
}

TEST_F(Checkpoint, DifferentModelNamesTheFirstMismatchingTensor) {
  Net small(8);
  dtrain::TrainingState st;
  st.model = small.ptr().get();
  const std::string path = dtrain::CheckpointManager(dir).save(st);
  Net big(16);
  const auto before = flat(big);
  dtrain::TrainingState back;
  back.model = big.ptr().get();
  const std::string msg = error_of([&] { dtrain::CheckpointManager(dir).load_latest(back); });
  EXPECT_THAT(msg, HasSubstr("checkpoint " + path +
                             " does not match the model: tensor 'fc1.weight' is Float [8, 4] in the "
                             "checkpoint but Float [16, 4] in the model"))
      << msg;
  EXPECT_EQ(flat(big), before) << "nothing is loaded on a mismatch";

  // Another architecture: the first differing name.
  auto seq = torch::nn::Sequential(torch::nn::Linear(4, 8));
  dtrain::TrainingState s2;
  s2.model = seq.ptr().get();
  const std::string msg2 = error_of([&] { dtrain::load_checkpoint(path, s2); });
  EXPECT_THAT(msg2, HasSubstr("tensor #0 is 'fc1.weight' in the checkpoint but '0.weight' in the model")) << msg2;
}

TEST_F(Checkpoint, MissingOptimizerStateIsAnError) {
  Net net;
  dtrain::TrainingState st;
  st.model = net.ptr().get();
  const std::string path = dtrain::CheckpointManager(dir).save(st);
  torch::optim::SGD opt(net->parameters(), 0.1);
  st.optimizer = &opt;
  const std::string msg = error_of([&] { dtrain::load_checkpoint(path, st); });
  EXPECT_THAT(msg, HasSubstr("holds no optimizer state")) << msg;
}

namespace {
// Any optimizer whose state is sharded, as CheckpointManager sees it: only through the interface.
class CountingShardedSGD : public torch::optim::SGD, public dtrain::ShardedOptimizerState {
 public:
  using torch::optim::SGD::SGD;
  void prepare_for_save(int to) override { calls.push_back(to); }
  std::vector<int> calls;
};
}  // namespace

TEST_F(Checkpoint, ShardedOptimizerIsPreparedOnceBeforeEachSave) {
  Net net;
  CountingShardedSGD opt(net->parameters(), torch::optim::SGDOptions(0.1));
  dtrain::TrainingState st;
  st.model = net.ptr().get();
  st.optimizer = &opt;
  dtrain::CheckpointManager manager(dir);
  manager.save(st);
  st.step = 1;
  manager.save(st);
  EXPECT_EQ(opt.calls, (std::vector<int>{0, 0}));  // gathered on rank 0, the rank that writes
}

TEST_F(Checkpoint, AFileInPlaceOfTheFolderIsAClearError) {
  write(dir, "a file");
  Net net;
  dtrain::TrainingState st;
  st.model = net.ptr().get();
  const std::string msg = error_of([&] { dtrain::CheckpointManager(dir).save(st); });
  EXPECT_THAT(msg, HasSubstr("cannot create the checkpoint folder " + dir)) << msg;
  EXPECT_THAT(msg, HasSubstr("choose another folder")) << msg;
  fs::remove(dir);
}

TEST_F(Checkpoint, UnwritableFolderKeepsThePreviousCheckpoint) {
  if (::geteuid() == 0)
    GTEST_SKIP()
        << "root writes into read-only folders (tests/dist/test_fault_tolerance.py covers it with a read-only mount)";
  Net net;
  dtrain::TrainingState st;
  st.model = net.ptr().get();
  dtrain::CheckpointManager mgr(dir);
  st.step = 1;
  const std::string first = mgr.save(st);
  const std::string bytes = read(first);
  ::chmod(dir.c_str(), 0555);
  st.step = 2;
  const std::string msg = error_of([&] { mgr.save(st); });
  EXPECT_THAT(msg, HasSubstr("cannot create checkpoint file " + dir + "/.checkpoint_0000000002.pt.tmp.")) << msg;
  EXPECT_THAT(msg, HasSubstr("Permission denied")) << msg;
  EXPECT_THAT(msg, HasSubstr("make the folder writable")) << msg;
  EXPECT_EQ(read(first), bytes);
}

// The files in the folder, sorted by name.
std::vector<std::string> names_in(const std::string& dir) {
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir)) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

std::string ckpt_name(int step) {
  char name[32];
  std::snprintf(name, sizeof name, "checkpoint_%010d.pt", step);
  return name;
}

// A run restarted from an older checkpoint (or with its step counter reset) saves a lower step than
// a file of the abandoned run: the new save is the latest (Note [Write order]), so rotation with
// keep=1 must keep it, and say once what it did.
TEST_F(Checkpoint, RotationNeverDeletesTheNewSaveWhenALaterStepIsPresent) {
  Net net;
  dtrain::TrainingState st;
  st.model = net.ptr().get();
  dtrain::CheckpointManager mgr(dir, dtrain::CheckpointOptions().keep(1));
  st.step = 300;
  mgr.save(st);
  st.step = 150;
  ::testing::internal::CaptureStderr();
  const std::string path = mgr.save(st);
  const std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(names_in(dir), std::vector<std::string>{ckpt_name(150)}) << "the new save must survive its rotation";
  EXPECT_EQ(mgr.list(), std::vector<std::string>{path});
  EXPECT_THAT(err, HasSubstr("dtrain warning: checkpoint folder " + dir + " holds " + dir + "/" + ckpt_name(300) +
                             " from the later step 300, written before this save of step 150"))
      << err;
  EXPECT_THAT(err, HasSubstr("rotation (keep=1) removes the oldest writes first")) << err;
  Net back;
  dtrain::TrainingState loaded;
  loaded.model = back.ptr().get();
  ASSERT_EQ(mgr.load_latest(loaded), path);
  EXPECT_EQ(loaded.step, 150);
}

// load_latest resumes from the newest write, not the highest step, and not by mtime: the stale file
// is made to look newer on disk.
TEST_F(Checkpoint, LoadLatestReturnsTheNewestWriteNotTheHighestStep) {
  Net net;
  dtrain::TrainingState st;
  st.model = net.ptr().get();
  dtrain::CheckpointManager mgr(dir);  // keep=2: the stale file stays for now
  st.step = 300;
  const std::string stale = mgr.save(st);
  st.step = 150;
  ::testing::internal::CaptureStderr();  // the save's warning (its own test checks it)
  const std::string fresh = mgr.save(st);
  ::testing::internal::GetCapturedStderr();
  const auto future = fs::last_write_time(fresh) + std::chrono::hours(1);
  fs::last_write_time(stale, future);
  EXPECT_EQ(mgr.list(), (std::vector<std::string>{stale, fresh})) << "oldest write first";

  Net back;
  dtrain::TrainingState loaded;
  loaded.model = back.ptr().get();
  ::testing::internal::CaptureStderr();
  const auto got = mgr.load_latest(loaded);
  const std::string err = ::testing::internal::GetCapturedStderr();
  ASSERT_TRUE(got);
  EXPECT_EQ(*got, fresh);
  EXPECT_EQ(loaded.step, 150);
  EXPECT_THAT(err, HasSubstr("dtrain warning: load_latest: resuming from " + fresh + ", the most recent write in " +
                             dir + ", although " + stale + " has the later step 300: it was written before"))
      << err;
  // The restarted run goes on: its next save rotates the stale file out (the oldest write).
  st.step = 160;
  const std::string next = mgr.save(st);
  EXPECT_EQ(names_in(dir), (std::vector<std::string>{ckpt_name(150), ckpt_name(160)}));
  ASSERT_EQ(mgr.load_latest(loaded), next);
  EXPECT_EQ(loaded.step, 160);
}

TEST_F(Checkpoint, AscendingRotationKeepsTheHighestStepsWithoutAWarning) {
  Net net;
  dtrain::TrainingState st;
  st.model = net.ptr().get();
  for (const int keep : {1, 3}) {
    fs::remove_all(dir);
    dtrain::CheckpointManager mgr(dir, dtrain::CheckpointOptions().keep(keep));
    ::testing::internal::CaptureStderr();
    for (int s = 1; s <= 5; ++s) {
      st.step = s;
      mgr.save(st);
    }
    Net back;
    dtrain::TrainingState loaded;
    loaded.model = back.ptr().get();
    const auto got = mgr.load_latest(loaded);
    const std::string err = ::testing::internal::GetCapturedStderr();
    std::vector<std::string> want;
    for (int s = 6 - keep; s <= 5; ++s) want.push_back(ckpt_name(s));
    EXPECT_EQ(names_in(dir), want) << "keep=" << keep;
    ASSERT_TRUE(got);
    EXPECT_EQ(*got, dir + "/" + ckpt_name(5));
    EXPECT_EQ(loaded.step, 5);
    EXPECT_THAT(err, Not(HasSubstr("later step"))) << err;
  }
}

// Files of an older dtrain (four header fields, no write stamp) are older than any stamped write,
// and ordered by step among themselves.
TEST_F(Checkpoint, FilesWithoutAWriteStampAreOlderThanAnyStampedWrite) {
  Net net;
  dtrain::TrainingState st;
  st.model = net.ptr().get();
  dtrain::CheckpointManager mgr(dir, dtrain::CheckpointOptions().keep(3));
  for (const int s : {300, 200}) {
    st.step = s;
    const std::string path = mgr.save(st);
    std::string bytes = read(path);
    const size_t eol = bytes.find('\n');
    const size_t last_space = bytes.rfind(' ', eol);
    ASSERT_EQ(std::count(bytes.begin(), bytes.begin() + static_cast<long>(eol), ' '), 4) << bytes.substr(0, eol);
    write(path, bytes.erase(last_space, eol - last_space));  // the header line of an older dtrain
  }
  Net back;
  dtrain::TrainingState loaded;
  loaded.model = back.ptr().get();
  ::testing::internal::CaptureStderr();
  EXPECT_EQ(mgr.load_latest(loaded), dir + "/" + ckpt_name(300));
  st.step = 100;
  const std::string fresh = mgr.save(st);
  EXPECT_EQ(mgr.load_latest(loaded), fresh);
  ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(loaded.step, 100);
}

// A file whose header claims a write stamp no writer could have made (INT64_MAX, or a month ahead
// of this host's clock) is unusable: `stamp + 1` overflowed, the planted file stayed the newest write,
// rotation deleted the real checkpoints around it, and load_latest resumed from it.
TEST_F(Checkpoint, AStampFromTheFarFutureIsIgnoredNotTheLatest) {
  Net net;
  dtrain::TrainingState st;
  st.model = net.ptr().get();
  dtrain::CheckpointManager mgr(dir, dtrain::CheckpointOptions().keep(2));
  st.step = 1;
  mgr.save(st);
  st.step = 2;
  const std::string good = mgr.save(st);
  // A copy of a real checkpoint (its CRC-32 still right) with another stamp in its header line.
  const std::string original = read(good);
  const auto plant = [&](int64_t step, const std::string& stamp) {
    std::string bytes = original;
    const size_t eol = bytes.find('\n');
    const size_t last_space = bytes.rfind(' ', eol);
    bytes.replace(last_space + 1, eol - last_space - 1, stamp);
    const std::string path = dir + "/" + ckpt_name(step);
    write(path, bytes);
    return path;
  };
  const auto now_ns =
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::system_clock::now().time_since_epoch()).count();
  for (const std::string& stamp :
       {std::to_string(INT64_MAX), std::to_string(now_ns + int64_t{30} * 24 * 3600 * 1000000000)}) {
    SCOPED_TRACE(stamp);
    const std::string planted = plant(50, stamp);
    st.step = 3;
    ::testing::internal::CaptureStderr();
    const std::string fresh = mgr.save(st);
    ::testing::internal::GetCapturedStderr();
    // The two newest real writes stay; the planted file is the oldest (unusable), and goes.
    EXPECT_EQ(names_in(dir), (std::vector<std::string>{ckpt_name(2), ckpt_name(3)}));
    // Planted again beside them: load_latest resumes from the newest real write, and says why not it.
    plant(50, stamp);
    Net back;
    dtrain::TrainingState loaded;
    loaded.model = back.ptr().get();
    ::testing::internal::CaptureStderr();
    EXPECT_EQ(mgr.load_latest(loaded), fresh);
    const std::string err = ::testing::internal::GetCapturedStderr();
    EXPECT_EQ(loaded.step, 3);
    EXPECT_THAT(err, HasSubstr("checkpoint " + planted + " is unusable (its write stamp " + stamp)) << err;
    EXPECT_THAT(err, HasSubstr("ahead of this host's clock")) << err;
    fs::remove(planted);
    fs::remove(fresh);
  }
}

TEST_F(Checkpoint, BadOptionsAreClearErrors) {
  EXPECT_THAT(error_of([] { dtrain::CheckpointManager("/tmp/x", dtrain::CheckpointOptions().keep(0)); }),
              HasSubstr("keep must be >= 1, got 0"));
  EXPECT_THAT(error_of([] { dtrain::CheckpointManager(""); }), HasSubstr("the checkpoint folder is empty"));
  dtrain::DistributedSampler s(10, dtrain::DistributedSamplerOptions().num_replicas(2).rank(0));
  EXPECT_THAT(error_of([&] { s.resume_at(6); }), HasSubstr("resume_at(6) is past the 5 indices"));
}

}  // namespace

// Note [Resharded epoch] through a checkpoint: saved by a 1-rank sampler 6 indices into the epoch,
// loaded into rank 1 of 2, the sampler continues with the other 14 of the 1-rank order, dealt out.
TEST_F(Checkpoint, AnotherWorldSizeReshardsTheSampler) {
  const auto sampler_opts = [](int64_t replicas, int64_t rank) {
    return dtrain::DistributedSamplerOptions().num_replicas(replicas).rank(rank).seed(4);
  };
  dtrain::DistributedSampler one(20, sampler_opts(1, 0));
  one.set_epoch(2);
  dtrain::TrainingState st;
  st.sampler = &one;
  st.sampler_position = 6;
  st.values = {{"loss_sum", 1.5}};
  const std::string path = (fs::path(dir) / "one.pt").string();
  fs::create_directories(dir);
  dtrain::save_checkpoint(path, st);

  dtrain::DistributedSampler two(20, sampler_opts(2, 1));
  dtrain::TrainingState loaded;
  loaded.sampler = &two;
  dtrain::load_checkpoint(path, loaded);
  EXPECT_EQ(loaded.saved_world_size, 1);
  ASSERT_EQ(loaded.saved_values.size(), 1u);
  EXPECT_EQ(loaded.saved_values[0].at("loss_sum"), 1.5);
  EXPECT_EQ(loaded.sampler_position, 0);  // the start of the rest
  EXPECT_EQ(two.epoch(), 2);
  const auto order = one.indices();  // the whole 1-rank order
  std::vector<int64_t> expected;
  for (size_t k = 6 + 1; k < order.size(); k += 2) expected.push_back(order[k]);
  EXPECT_EQ(two.indices(), expected);

  // Saved by rank 0 of a 2-rank sampler alone (one process): rank 1's position is unknown, so it
  // loads on 2 ranks only.
  dtrain::DistributedSampler half(20, sampler_opts(2, 0));
  st.sampler = &half;
  st.sampler_position = 3;
  const std::string path2 = (fs::path(dir) / "half.pt").string();
  dtrain::save_checkpoint(path2, st);
  dtrain::DistributedSampler same(20, sampler_opts(2, 0)), other(20, sampler_opts(3, 0));
  loaded.sampler = &same;
  dtrain::load_checkpoint(path2, loaded);
  EXPECT_EQ(loaded.sampler_position, 3);
  loaded.sampler = &other;
  const std::string msg = error_of([&] { dtrain::load_checkpoint(path2, loaded); });
  EXPECT_THAT(msg, HasSubstr("lacks the sampler position of rank 1 of 2: load it on 2 ranks")) << msg;
}
