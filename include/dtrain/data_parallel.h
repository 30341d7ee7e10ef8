// Single-process DataParallel and model parallelism (the tutorial's sections 2 and 5.1).
//
//   tutorial::SimpleModel model;
//   dtrain::DataParallel dp(model, dtrain::DataParallelOptions({at::kCPU, at::kCPU}));  // 2 CPU replicas
//   at::Tensor out = dp(x);            // x scattered along dim 0, replicas run in parallel threads
//   loss(out).backward();              // the summed gradients are in model's own parameters
//   opt.step();                        // an optimizer over model->parameters() works unchanged
//
// Protocol of one forward:
//   1. Scatter: every tensor argument is chunked along `dim` (at::chunk: a batch smaller than the
//      number of devices uses fewer replicas, as PyTorch); other arguments go to every replica.
//   2. Refresh: replicas 1..n-1 (created ONCE, by clone(), unlike LibTorch's functional
//      data_parallel which clones on every call, pytorch/pytorch#40581) get the module's current
//      parameters and buffers copied in place. Replica 0 is the module itself, so its BatchNorm
//      running statistics are the ones kept (PyTorch's DataParallel behaves the same).
//   3. Run the replicas in parallel threads (grad mode and autocast state carried over; the first
//      exception is rethrown on the caller's thread) and gather the outputs on output_device.
//   4. Backward: when backward finishes, the replicas' gradients are added into the module's own
//      parameters' gradients and the replicas' are cleared.
//
// The module must be clonable (derive from torch::nn::Cloneable<Impl>), or pass a replica factory.
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include <c10/core/Device.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/pimpl.h>

#include "dtrain/detail/arg.h"
#include "dtrain/errors.h"

namespace dtrain {

struct DataParallelOptions {
  explicit DataParallelOptions(std::vector<c10::Device> device_ids) : device_ids_(std::move(device_ids)) {}
  // The devices of the replicas; the module must live on device_ids[0]. CPU devices may repeat.
  DTRAIN_ARG(std::vector<c10::Device>, device_ids, {})
  // Where outputs are gathered (default: device_ids[0]).
  DTRAIN_ARG(std::optional<c10::Device>, output_device, std::nullopt)
  // The dimension inputs are scattered along and outputs gathered along.
  DTRAIN_ARG(int64_t, dim, 0)
};

namespace detail {

// Not API: DataParallel's non-template core (src/parallel/data_parallel.cpp), here only because the
// class template calls it.
class DataParallelCore {
 public:
  using Factory = std::function<std::shared_ptr<torch::nn::Module>()>;
  DataParallelCore(std::shared_ptr<torch::nn::Module> module, DataParallelOptions options, Factory factory);
  ~DataParallelCore();
  // Steps 1-2: chunks of every tensor argument, per replica; returns the number of replicas used.
  size_t prepare(const std::vector<at::Tensor>& inputs, std::vector<std::vector<at::Tensor>>& chunks);
  // Step 3: runs fn(replica_index) for each used replica, in parallel; rethrows the first failure.
  void run_parallel(size_t n, const std::function<void(size_t)>& fn);
  // Step 3: gathers outputs on output_device along dim, and arms step 4.
  at::Tensor gather(const std::vector<at::Tensor>& outputs);
  std::shared_ptr<torch::nn::Module> replica(size_t i) const;
  const DataParallelOptions& options() const;
  size_t num_replicas() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

template <typename T>
struct ScatterArg {  // a non-tensor argument: the same for every replica
  static const T& pick(const T& v, const std::vector<at::Tensor>&, size_t&) { return v; }
  static void collect(const T&, std::vector<at::Tensor>&) {}
};
template <>
struct ScatterArg<at::Tensor> {
  static at::Tensor pick(const at::Tensor&, const std::vector<at::Tensor>& chunks, size_t& next) {
    return chunks[next++];
  }
  static void collect(const at::Tensor& t, std::vector<at::Tensor>& out) { out.push_back(t); }
};

}  // namespace detail

template <typename ModuleType>
class DataParallel {
 public:
  using Factory = std::function<std::shared_ptr<ModuleType>()>;

  DataParallel(std::shared_ptr<ModuleType> module, DataParallelOptions options, Factory factory = nullptr)
      : module_(std::move(module)),
        core_(std::make_unique<detail::DataParallelCore>(module_, std::move(options), wrap(factory))) {
    // Module is a virtual base of Cloneable modules: the typed handles need a dynamic cast, once.
    for (size_t i = 0; i < core_->num_replicas(); ++i)
      replicas_.push_back(std::dynamic_pointer_cast<ModuleType>(core_->replica(i)));
  }
  DataParallel(torch::nn::ModuleHolder<ModuleType> holder, DataParallelOptions options, Factory factory = nullptr)
      : DataParallel(holder.ptr(), std::move(options), std::move(factory)) {}

  // Scatter, run the replicas in parallel, gather (a tensor output).
  template <typename... Args>
  at::Tensor forward(const Args&... args) {
    std::vector<at::Tensor> tensors;
    (detail::ScatterArg<std::decay_t<Args>>::collect(args, tensors), ...);
    std::vector<std::vector<at::Tensor>> chunks;  // chunks[replica][tensor argument]
    const size_t n = core_->prepare(tensors, chunks);
    std::vector<at::Tensor> outputs(n);
    core_->run_parallel(n, [&](size_t i) {
      size_t next = 0;
      outputs[i] = replicas_[i]->forward(detail::ScatterArg<std::decay_t<Args>>::pick(args, chunks[i], next)...);
    });
    return core_->gather(outputs);
  }
  template <typename... Args>
  at::Tensor operator()(const Args&... args) {
    return forward(args...);
  }

  const std::shared_ptr<ModuleType>& module() const { return module_; }
  std::vector<at::Tensor> parameters(bool recurse = true) const { return module_->parameters(recurse); }
  const DataParallelOptions& options() const { return core_->options(); }
  size_t num_replicas() const { return core_->num_replicas(); }

 private:
  static detail::DataParallelCore::Factory wrap(const Factory& f) {
    if (!f) return nullptr;
    return [f]() -> std::shared_ptr<torch::nn::Module> { return f(); };
  }
  std::shared_ptr<ModuleType> module_;
  std::unique_ptr<detail::DataParallelCore> core_;
  std::vector<std::shared_ptr<ModuleType>> replicas_;
};

template <typename M>
DataParallel(std::shared_ptr<M>, DataParallelOptions) -> DataParallel<M>;
template <typename M>
DataParallel(torch::nn::ModuleHolder<M>, DataParallelOptions) -> DataParallel<M>;
template <typename M, typename F>
DataParallel(std::shared_ptr<M>, DataParallelOptions, F) -> DataParallel<M>;
template <typename M, typename F>
DataParallel(torch::nn::ModuleHolder<M>, DataParallelOptions, F) -> DataParallel<M>;

// --- model parallelism -----------------------------------------------------------------------------

// Splits layer counts for `sizes` (e.g. parameter counts per layer) into `parts` contiguous stages
// minimizing the largest stage (every stage gets at least one layer). Used by the pipeline too.
std::vector<int64_t> balance_by_size(const std::vector<int64_t>& sizes, int64_t parts);

// A Sequential split into stages, stage i on devices[i]; activations move at the boundaries.
// balance: layers per stage (sums to the number of layers); empty = balanced by parameter count.
// The output stays on the last stage's device.
class ModelParallelSequentialImpl : public torch::nn::Module {
 public:
  ModelParallelSequentialImpl(torch::nn::Sequential sequential, std::vector<c10::Device> devices,
                              std::vector<int64_t> balance = {});
  at::Tensor forward(at::Tensor x);
  const std::vector<torch::nn::Sequential>& stages() const { return stages_; }
  const std::vector<c10::Device>& devices() const { return devices_; }
  const std::vector<int64_t>& balance() const { return balance_; }

 private:
  std::vector<torch::nn::Sequential> stages_;
  std::vector<c10::Device> devices_;
  std::vector<int64_t> balance_;
};
TORCH_MODULE(ModelParallelSequential);

}  // namespace dtrain
