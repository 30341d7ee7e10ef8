// CheckpointManager::save_async (Note [Asynchronous saves]): the file holds the state as it was when
// save_async returned, not as training changed it while the thread wrote; a write that fails is
// reported by the next call, naming the file; and optimizers whose state cannot be staged still save.
// Every optimizer whose state is staged (SGD with momentum, AdamW, Adagrad, RMSprop as well as Adam)
// saves the state of the call; load_latest() right after save_async() resumes from the save in
// flight, or throws its failure; the destructor with a failed save outstanding warns and returns.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include <torch/torch.h>

#include "compat/optim_compat.h"
#include "dtrain/checkpoint.h"
#include "dtrain/errors.h"
#include "matchers.h"
#include "test_util.h"

namespace fs = std::filesystem;
using dtrain::test_util::error_of;

namespace {

// About 4 MiB of parameters and twice that of Adam's state: the thread serializes for milliseconds.
torch::nn::Sequential make_net() {
  return torch::nn::Sequential(torch::nn::Linear(16, 1024), torch::nn::ReLU(), torch::nn::Linear(1024, 1024),
                               torch::nn::ReLU(), torch::nn::Linear(1024, 4));
}

void train_steps(torch::nn::Sequential& net, torch::optim::Optimizer& opt, int n) {
  for (int i = 0; i < n; ++i) {
    opt.zero_grad();
    net->forward(torch::randn({8, 16})).pow(2).mean().backward();
    opt.step();
  }
}

std::vector<at::Tensor> snapshot(torch::nn::Sequential& net, torch::optim::Adam& opt) {
  std::vector<at::Tensor> out;
  for (const auto& p : net->parameters()) {
    out.push_back(p.detach().clone());
    auto& s = static_cast<torch::optim::AdamParamState&>(*opt.state().at(dtrain::compat::optimizer_state_key(p)));
    out.push_back(s.exp_avg().clone());
    out.push_back(s.exp_avg_sq().clone());
  }
  return out;
}

// The live tensors themselves: the parameters and Adam's moments.
std::vector<at::Tensor> snapshot_refs(torch::nn::Sequential& net, torch::optim::Adam& opt) {
  std::vector<at::Tensor> out;
  for (const auto& p : net->parameters()) {
    out.push_back(p);
    auto& s = static_cast<torch::optim::AdamParamState&>(*opt.state().at(dtrain::compat::optimizer_state_key(p)));
    out.push_back(s.exp_avg());
    out.push_back(s.exp_avg_sq());
  }
  return out;
}

class AsyncCheckpoint : public ::testing::Test {
 protected:
  void SetUp() override {
    dir = (fs::temp_directory_path() / ("dtrain_async_" + std::to_string(::getpid()) + "_" +
                                        ::testing::UnitTest::GetInstance()->current_test_info()->name()))
              .string();
    fs::remove_all(dir);
  }
  void TearDown() override { fs::remove_all(dir); }
  std::string dir;
};

TEST_F(AsyncCheckpoint, TheFileHoldsTheStateOfTheCallNotOfLaterSteps) {
  torch::manual_seed(3);
  auto net = make_net();
  torch::optim::Adam opt(net->parameters(), torch::optim::AdamOptions(1e-2));
  train_steps(net, opt, 3);
  dtrain::TrainingState st;
  st.model = net.ptr().get();
  st.optimizer = &opt;
  dtrain::CheckpointManager mgr(dir);
  // Twice: the second save stages into the copies of the first (the staging pool).
  for (int64_t step : {3, 6}) {
    st.step = step;
    const auto at_save = snapshot(net, opt);
    const std::string path = mgr.save_async(st);
    {  // At once, while the thread starts to serialize: every tensor it would read, changed in place.
      torch::NoGradGuard no_grad;
      for (auto& t : snapshot_refs(net, opt)) t.fill_(7.0 + step);
    }
    train_steps(net, opt, 2);
    const auto live = snapshot(net, opt);
    mgr.wait();
    ASSERT_TRUE(fs::exists(path));

    torch::manual_seed(99);
    auto back = make_net();
    torch::optim::Adam opt_back(back->parameters(), torch::optim::AdamOptions(1e-2));
    dtrain::TrainingState in;
    in.model = back.ptr().get();
    in.optimizer = &opt_back;
    ASSERT_EQ(mgr.load_latest(in), path);
    const auto loaded = snapshot(back, opt_back);
    ASSERT_EQ(loaded.size(), at_save.size());
    for (size_t i = 0; i < loaded.size(); ++i)
      EXPECT_TRUE(loaded[i].equal(at_save[i])) << "step " << step << " tensor " << i;
    EXPECT_EQ(in.step, step);
    // The live optimizer kept its own state through the save (a staged copy never became live).
    const auto after = snapshot(net, opt);
    for (size_t i = 0; i < after.size(); ++i) EXPECT_TRUE(after[i].equal(live[i])) << "step " << step << " live " << i;
    train_steps(net, opt, 1);
  }
}

TEST_F(AsyncCheckpoint, AFailedWriteIsReportedByTheNextCallNamingTheFile) {
  auto net = make_net();
  torch::optim::Adam opt(net->parameters());
  train_steps(net, opt, 1);
  dtrain::TrainingState st;
  st.model = net.ptr().get();
  st.optimizer = &opt;
  st.step = 7;
  dtrain::CheckpointManager mgr(dir);
  // A folder where the file goes: the rename at the end of the write fails.
  fs::create_directories(dir + "/checkpoint_0000000007.pt/in_the_way");
  EXPECT_NO_THROW(mgr.save_async(st));
  const std::string msg = error_of([&] { mgr.wait(); });
  EXPECT_THAT(msg, HasSubstr("the asynchronous save of " + dir + "/checkpoint_0000000007.pt failed"));
  EXPECT_NO_THROW(mgr.wait());  // told once
  st.step = 8;
  EXPECT_NO_THROW(mgr.save_async(st));
  EXPECT_NO_THROW(mgr.wait());
  EXPECT_EQ(mgr.list().back(), dir + "/checkpoint_0000000008.pt");
}

TEST_F(AsyncCheckpoint, AnOptimizerThatCannotBeStagedIsSerializedBeforeReturning) {
  auto net = make_net();
  torch::optim::LBFGS opt(net->parameters(), torch::optim::LBFGSOptions(0.1).max_iter(2));
  const at::Tensor x = torch::randn({8, 16});
  opt.step([&] {
    opt.zero_grad();
    auto loss = net->forward(x).pow(2).mean();
    loss.backward();
    return loss;
  });
  ASSERT_FALSE(opt.state().empty());
  dtrain::TrainingState st;
  st.model = net.ptr().get();
  st.optimizer = &opt;
  st.step = 1;
  dtrain::CheckpointManager mgr(dir);
  std::string warned;
  dtrain::set_message_handler([&](dtrain::MessageLevel, const std::string& text) { warned += text; });
  mgr.save_async(st);
  mgr.wait();
  dtrain::set_message_handler(nullptr);
  EXPECT_THAT(warned, HasSubstr("this optimizer's state cannot be staged"));
  ASSERT_EQ(mgr.list().size(), 1u);
  torch::optim::LBFGS back(net->parameters(), torch::optim::LBFGSOptions(0.1));
  dtrain::TrainingState in;
  in.model = net.ptr().get();
  in.optimizer = &back;
  EXPECT_EQ(mgr.load_latest(in), mgr.list()[0]);
}

// Each staged optimizer's state tensors (the step counts as tensors too), by parameter.
std::vector<at::Tensor> optimizer_state(torch::optim::Optimizer& opt, torch::nn::Sequential& net) {
  std::vector<at::Tensor> out;
  for (const auto& p : net->parameters()) {
    auto& base = *opt.state().at(dtrain::compat::optimizer_state_key(p));
    if (auto* s = dynamic_cast<torch::optim::SGDParamState*>(&base)) {
      out.push_back(s->momentum_buffer().clone());
    } else if (auto* s = dynamic_cast<torch::optim::AdamWParamState*>(&base)) {
      out.insert(out.end(), {s->exp_avg().clone(), s->exp_avg_sq().clone(), at::scalar_tensor(double(s->step()))});
      if (s->max_exp_avg_sq().defined()) out.push_back(s->max_exp_avg_sq().clone());
    } else if (auto* s = dynamic_cast<torch::optim::AdagradParamState*>(&base)) {
      out.insert(out.end(), {s->sum().clone(), at::scalar_tensor(double(s->step()))});
    } else if (auto* s = dynamic_cast<torch::optim::RMSpropParamState*>(&base)) {
      out.insert(out.end(), {s->square_avg().clone(), at::scalar_tensor(double(s->step()))});
      if (s->momentum_buffer().defined()) out.push_back(s->momentum_buffer().clone());
      if (s->grad_avg().defined()) out.push_back(s->grad_avg().clone());
    } else {
      ADD_FAILURE() << "an optimizer state this test does not know";
    }
  }
  for (const auto& p : net->parameters()) out.push_back(p.detach().clone());
  return out;
}

std::unique_ptr<torch::optim::Optimizer> make_optimizer(const std::string& kind, std::vector<at::Tensor> params) {
  if (kind == "sgd") return std::make_unique<torch::optim::SGD>(params, torch::optim::SGDOptions(1e-2).momentum(0.9));
  if (kind == "adamw")
    return std::make_unique<torch::optim::AdamW>(params, torch::optim::AdamWOptions(1e-3).amsgrad(true));
  if (kind == "adagrad") return std::make_unique<torch::optim::Adagrad>(params, torch::optim::AdagradOptions(1e-2));
  return std::make_unique<torch::optim::RMSprop>(
      params, torch::optim::RMSpropOptions(1e-3).momentum(0.9).centered(true));  // every buffer it has
}

TEST_F(AsyncCheckpoint, EveryStagedOptimizerSavesTheStateOfTheCall) {
  for (const std::string kind : {"sgd", "adamw", "adagrad", "rmsprop"}) {
    SCOPED_TRACE(kind);
    fs::remove_all(dir);
    torch::manual_seed(5);
    auto net = make_net();
    auto opt = make_optimizer(kind, net->parameters());
    train_steps(net, *opt, 3);
    dtrain::TrainingState st;
    st.model = net.ptr().get();
    st.optimizer = opt.get();
    st.step = 3;
    dtrain::CheckpointManager mgr(dir);
    const auto at_save = optimizer_state(*opt, net);
    const std::string path = mgr.save_async(st);
    train_steps(net, *opt, 2);  // in place, while the thread serializes
    const auto live = optimizer_state(*opt, net);
    mgr.wait();
    auto back = make_net();
    auto opt_back = make_optimizer(kind, back->parameters());
    dtrain::TrainingState in;
    in.model = back.ptr().get();
    in.optimizer = opt_back.get();
    ASSERT_EQ(mgr.load_latest(in), path);
    const auto loaded = optimizer_state(*opt_back, back);
    ASSERT_EQ(loaded.size(), at_save.size());
    for (size_t i = 0; i < loaded.size(); ++i) EXPECT_TRUE(loaded[i].equal(at_save[i])) << "tensor " << i;
    const auto after = optimizer_state(*opt, net);
    for (size_t i = 0; i < after.size(); ++i) EXPECT_TRUE(after[i].equal(live[i])) << "live tensor " << i;
  }
}

TEST_F(AsyncCheckpoint, LoadLatestRightAfterSaveAsyncResumesFromTheSaveInFlight) {
  torch::manual_seed(6);
  auto net = make_net();
  torch::optim::Adam opt(net->parameters(), torch::optim::AdamOptions(1e-2));
  train_steps(net, opt, 2);
  dtrain::TrainingState st;
  st.model = net.ptr().get();
  st.optimizer = &opt;
  dtrain::CheckpointManager mgr(dir);
  st.step = 1;
  mgr.save(st);
  st.step = 2;
  const auto at_save = snapshot(net, opt);
  const std::string path = mgr.save_async(st);
  auto back = make_net();
  torch::optim::Adam opt_back(back->parameters(), torch::optim::AdamOptions(1e-2));
  dtrain::TrainingState in;
  in.model = back.ptr().get();
  in.optimizer = &opt_back;
  ASSERT_EQ(mgr.load_latest(in), path) << "the save in flight is the latest once it is written";
  EXPECT_EQ(in.step, 2);
  const auto loaded = snapshot(back, opt_back);
  for (size_t i = 0; i < loaded.size(); ++i) EXPECT_TRUE(loaded[i].equal(at_save[i])) << "tensor " << i;
  // A save in flight that fails: load_latest tells it instead of resuming from an older file.
  st.step = 3;
  fs::create_directories(dir + "/checkpoint_0000000003.pt/in_the_way");
  mgr.save_async(st);
  EXPECT_THAT(error_of([&] { mgr.load_latest(in); }),
              HasSubstr("the asynchronous save of " + dir + "/checkpoint_0000000003.pt failed"));
  EXPECT_EQ(mgr.load_latest(in), path) << "told once; then the newest good file";
}

TEST_F(AsyncCheckpoint, TheDestructorWithAFailedSaveOutstandingWarnsNamingTheFile) {
  auto net = make_net();
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(1e-2).momentum(0.9));
  train_steps(net, opt, 1);
  dtrain::TrainingState st;
  st.model = net.ptr().get();
  st.optimizer = &opt;
  st.step = 4;
  fs::create_directories(dir + "/checkpoint_0000000004.pt/in_the_way");
  std::string warned;
  dtrain::set_message_handler([&](dtrain::MessageLevel, const std::string& text) { warned += text; });
  {
    dtrain::CheckpointManager mgr(dir);
    mgr.save_async(st);
  }  // no wait(): the destructor waits, and cannot throw
  dtrain::set_message_handler(nullptr);
  EXPECT_THAT(warned, HasSubstr("the asynchronous save of " + dir + "/checkpoint_0000000004.pt failed"));
  EXPECT_TRUE(fs::exists(dir + "/checkpoint_0000000004.pt/in_the_way")) << "nothing else was touched";
}

}  // namespace
