// The program test_checkpoint_async.py kills in the middle of a background write.
//   checkpoint_async_tool save DIR MB   a model of about MB MiB with Adam: save() of step 1, then
//                                       save_async() of step 2, "staged" on stdout, then it sleeps
//                                       (the test kills it with SIGKILL while the thread writes)
//   checkpoint_async_tool save_and_wait DIR MB   the same, then waits for the write and exits
//   checkpoint_async_tool load DIR MB   load_latest() into the same model: "loaded step N" on stdout
#include <chrono>
#include <iostream>
#include <thread>

#include <torch/torch.h>

#include "dtrain/checkpoint.h"

namespace {

torch::nn::Sequential make_model(int64_t mib) {
  torch::nn::Sequential m;
  const int64_t width = 1024, layers = std::max<int64_t>(1, mib * (1 << 20) / (4 * width * width));
  for (int64_t i = 0; i < layers; ++i) m->push_back(torch::nn::Linear(width, width));
  return m;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) {
    std::cerr << "usage: checkpoint_async_tool save|load DIR MB\n";
    return 2;
  }
  const std::string mode = argv[1], dir = argv[2];
  try {
    auto model = make_model(argc > 3 ? std::stoll(argv[3]) : 1);
    torch::optim::Adam opt(model->parameters());
    dtrain::TrainingState st;
    st.model = model.ptr().get();
    st.optimizer = &opt;
    dtrain::CheckpointManager mgr(dir, dtrain::CheckpointOptions().keep(5));
    if (mode == "load") {
      std::cout << (mgr.load_latest(st) ? "loaded step " + std::to_string(st.step) : "no checkpoint") << std::endl;
      return 0;
    }
    st.step = 1;
    mgr.save(st);
    st.step = 2;
    mgr.save_async(st);
    std::cout << "staged" << std::endl;
    if (mode == "save") std::this_thread::sleep_for(std::chrono::seconds(60));
    mgr.wait();
  } catch (const std::exception& e) {
    std::cerr << "checkpoint_async_tool: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
