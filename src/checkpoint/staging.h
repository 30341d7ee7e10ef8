// Staging for CheckpointManager::save_async (dtrain/checkpoint.h): an archive of the training state
// that no later step changes, made at about the cost of a memcpy of its tensors, so that its
// serialization and write can run on a thread of their own while training goes on.
#pragma once

#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <torch/serialize/archive.h>

namespace torch::nn {
class Module;
}
namespace torch::optim {
class Optimizer;
}

namespace dtrain::ckpt {

// The copies a save stages, kept from one save to the next (double buffering): a copy into a
// tensor of the last save costs a memcpy, where a fresh one also page-faults every page it touches
// (a third more than the memcpy itself for 1 GB, measured by bench_checkpoint).
class StagingPool {
 public:
  // A tensor of t's dtype, shape, device and requires_grad holding t's values; held until release()
  // unless `held` is false (a copy that stays live, as an optimizer's new state).
  at::Tensor copy_of(const at::Tensor& t, bool held = true);
  // t goes back to the pool at release() (an optimizer's old state tensor, once it is written).
  void hold(const at::Tensor& t);
  // Everything held is free for the next save: call it once the archive that used them is gone.
  void release();

 private:
  std::map<std::string, std::vector<at::Tensor>> free_;
  std::vector<at::Tensor> held_;
};

// What Module::save writes (parameters, then buffers, then each serializable child in its own
// archive), each tensor a copy: the archive reads as Module::save's and no later step reaches it.
void save_module_staged(const torch::nn::Module& module, torch::serialize::OutputArchive& archive, StagingPool& pool);

// After optimizer.save(archive): gives the live optimizer copies of its state tensors, so that the
// archive keeps the tensors as they were (one copy, where a copy into the archive would take two).
// Knows the states of LibTorch's Adam, AdamW, SGD, Adagrad and RMSprop; false (nothing changed) for
// any other optimizer, whose archive the caller must then serialize before the next step.
bool restage_optimizer_state(torch::optim::Optimizer& optimizer, StagingPool& pool);

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
