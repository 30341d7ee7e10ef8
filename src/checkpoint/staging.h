// Staging for CheckpointManager::save_async (dtrain/checkpoint.h): an archive of the training state
// that no later step changes, made at about the cost of a memcpy of its tensors, so that its
// serialization and write can run on a thread of their own while training goes on.
#pragma once

#include <functional>
#include <mutex>
#include <string>
#include <thread>

#include <torch/serialize/archive.h>

namespace torch::nn {
class Module;
}
namespace torch::optim {
class Optimizer;
}

namespace dtrain::ckpt {

// What Module::save writes (parameters, then buffers, then each serializable child in its own
// archive), each tensor a copy: the archive reads as Module::save's and no later step reaches it.
void save_module_staged(const torch::nn::Module& module, torch::serialize::OutputArchive& archive);

// After optimizer.save(archive): gives the live optimizer copies of its state tensors, so that the
// archive keeps the tensors as they were (one copy, where a copy into the archive would take two).
// Knows the states of LibTorch's Adam, AdamW, SGD, Adagrad and RMSprop; false (nothing changed) for
// any other optimizer, whose archive the caller must then serialize before the next step.
bool restage_optimizer_state(torch::optim::Optimizer& optimizer);

// One background write at a time: run() starts `work` on its own thread (after finishing the last);
// finish() waits for it and returns, once, what it threw ("" when it succeeded). An exception never
// leaves the thread.
class BackgroundWrite {
 public:
  BackgroundWrite() = default;
  BackgroundWrite(const BackgroundWrite&) = delete;
  BackgroundWrite& operator=(const BackgroundWrite&) = delete;
  ~BackgroundWrite();  // waits
  void run(std::string what, std::function<void()> work);
  bool pending() const { return thread_.joinable(); }
  const std::string& what() const { return what_; }
  std::string finish();

 private:
  std::thread thread_;
  std::string what_;
  std::mutex mu_;
  std::string error_;
};

}  // namespace dtrain::ckpt
