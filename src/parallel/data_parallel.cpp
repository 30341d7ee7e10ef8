// DataParallel's core: replicas made once, refreshed in place, run in threads, gradients reduced
// into the module at the end of backward. Steps 1-4 are described in include/dtrain/data_parallel.h.
#include <ATen/ATen.h>
#include <ATen/ThreadLocalState.h>

#include <mutex>

#include "compat/autograd_compat.h"
#include "dtrain/data_parallel.h"

namespace dtrain::detail {
namespace {

bool same_device(const c10::Device& want, const c10::Device& have) {
  return want.type() == have.type() && (!want.has_index() || !have.has_index() || want.index() == have.index());
}

}  // namespace

struct DataParallelCore::Impl {
  DataParallelOptions options{{}};
  std::vector<std::shared_ptr<torch::nn::Module>> replicas;  // [0] is the module itself
  std::vector<std::vector<at::Tensor>> params, buffers;      // per replica, parameters() order
  std::vector<compat::NodePtr> accumulators;                 // of replicas 1..n-1 (kept alive)
  std::mutex mu;
  bool armed = false;  // a forward with grad is waiting for its backward
  size_t used = 0;     // replicas used by that forward

  // Step 4, at the end of backward: replica gradients into the module's gradients.
  void reduce_gradients() {
    std::lock_guard<std::mutex> g(mu);
    at::NoGradGuard ng;
    for (size_t r = 1; r < used; ++r)
      for (size_t j = 0; j < params[r].size(); ++j) {
        at::Tensor& rg = params[r][j].mutable_grad();
        if (!rg.defined()) continue;
        at::Tensor& target = params[0][j].mutable_grad();
        at::Tensor moved = rg.to(params[0][j].device());
        if (!target.defined())
          target = moved.is_same(rg) ? moved.clone() : moved;
        else
          target.add_(moved);
        rg = at::Tensor();
      }
    armed = false;
  }

  void on_replica_grad() {
    std::lock_guard<std::mutex> g(mu);
    if (!armed) return;
    armed = false;  // queue once per backward
    compat::queue_end_of_backward_callback([this] { reduce_gradients(); });
  }
};

DataParallelCore::DataParallelCore(std::shared_ptr<torch::nn::Module> module, DataParallelOptions options,
                                   Factory factory)
    : impl_(std::make_unique<Impl>()) {
  auto& s = *impl_;
  s.options = std::move(options);
  const auto& devs = s.options.device_ids();
  DTRAIN_CHECK(module, "DataParallel: the module is null: pass a constructed model");
  DTRAIN_CHECK(!devs.empty(), "DataParallel: device_ids is empty: pass at least one device, e.g. {at::kCPU, at::kCPU}");
  for (const auto& d : devs)
    DTRAIN_CHECK(d.type() == devs[0].type(), "DataParallel: device_ids mix device types (", devs[0], " and ", d,
                 "): use devices of one type");
  DTRAIN_CHECK(s.options.dim() >= 0, "DataParallel: dim must be >= 0, got ", s.options.dim());
  if (!s.options.output_device()) s.options.output_device(devs[0]);
  for (const auto& p : module->parameters())
    DTRAIN_CHECK(same_device(devs[0], p.device()),
                 "DataParallel: the module must have its parameters on device_ids[0] (", devs[0],
                 ") but a parameter is on ", p.device(), ": call module->to(", devs[0], ") first");
  s.replicas.push_back(module);
  for (size_t i = 1; i < devs.size(); ++i) {
    std::shared_ptr<torch::nn::Module> r;
    if (factory) {
      r = factory();
      r->to(devs[i]);
    } else {
      try {
        r = module->clone(devs[i]);
      } catch (const std::exception& e) {
        throw Error(detail::cat("DataParallel: cannot clone the module (", module->name(),
                                "): derive it from torch::nn::Cloneable<", module->name(),
                                "> or pass a replica factory"));
      }
    }
    s.replicas.push_back(std::move(r));
  }
  for (auto& r : s.replicas) {
    s.params.push_back(r->parameters());
    s.buffers.push_back(r->buffers());
    DTRAIN_CHECK(s.params.back().size() == s.params[0].size() && s.buffers.back().size() == s.buffers[0].size(),
                 "DataParallel: a replica from the factory has ", s.params.back().size(), " parameters, the module ",
                 s.params[0].size(), ": the factory must build the same model");
  }
  for (size_t r = 1; r < s.replicas.size(); ++r)
    for (auto& p : s.params[r]) {
      if (!p.requires_grad()) continue;
      s.accumulators.push_back(compat::grad_accumulator(p));
      compat::add_post_hook(s.accumulators.back(), [impl = impl_.get()] { impl->on_replica_grad(); });
    }
}

DataParallelCore::~DataParallelCore() = default;

size_t DataParallelCore::prepare(const std::vector<at::Tensor>& inputs, std::vector<std::vector<at::Tensor>>& chunks) {
  auto& s = *impl_;
  const auto& devs = s.options.device_ids();
  DTRAIN_CHECK(!inputs.empty(), "DataParallel: forward got no tensor argument to scatter");
  // Step 1.
  size_t n = devs.size();
  std::vector<std::vector<at::Tensor>> per_input;
  for (const auto& t : inputs) {
    DTRAIN_CHECK(t.dim() > s.options.dim(), "DataParallel: cannot scatter a tensor of shape ", t.sizes(), " along dim ",
                 s.options.dim());
    per_input.push_back(t.chunk(static_cast<int64_t>(devs.size()), s.options.dim()));
    n = std::min(n, per_input.back().size());
  }
  chunks.assign(n, {});
  for (size_t i = 0; i < n; ++i)
    for (auto& pi : per_input) chunks[i].push_back(pi[i].to(devs[i]));
  // Step 2: refresh the replicas that will run. Not while an earlier forward still waits for its
  // backward: its graph saved these very tensors, and no optimizer step can have happened since.
  // (LibTorch's optimizers do not bump parameter versions, so versions cannot tell what changed.)
  at::NoGradGuard ng;
  {
    std::lock_guard<std::mutex> g(s.mu);
    if (s.armed) return n;
  }
  for (size_t j = 0; j < s.params[0].size(); ++j)
    for (size_t r = 1; r < n; ++r) s.params[r][j].copy_(s.params[0][j]);
  for (size_t j = 0; j < s.buffers[0].size(); ++j)
    for (size_t r = 1; r < n; ++r) s.buffers[r][j].copy_(s.buffers[0][j]);
  for (size_t r = 1; r < n; ++r) s.replicas[r]->train(s.replicas[0]->is_training());
  return n;
}

void DataParallelCore::run_parallel(size_t n, const std::function<void(size_t)>& fn) {
  // Step 3: the caller's thread-local state (grad mode, autocast) in every worker.
  at::ThreadLocalState state;
  std::exception_ptr first;
  std::mutex mu;
  auto guarded = [&](size_t i) {
    try {
      at::ThreadLocalStateGuard g(state);
      fn(i);
    } catch (...) {
      std::lock_guard<std::mutex> l(mu);
      if (!first) first = std::current_exception();
    }
  };
  std::vector<std::thread> threads;
  for (size_t i = 1; i < n; ++i) threads.emplace_back(guarded, i);
  guarded(0);
  for (auto& t : threads) t.join();
  if (first) std::rethrow_exception(first);
}

at::Tensor DataParallelCore::gather(const std::vector<at::Tensor>& outputs) {
  auto& s = *impl_;
  const auto out_dev = *s.options.output_device();
  std::vector<at::Tensor> moved;
  for (const auto& o : outputs) moved.push_back(o.to(out_dev));
  at::Tensor out = moved.size() == 1 ? moved[0] : at::cat(moved, s.options.dim());
  std::lock_guard<std::mutex> g(s.mu);
  s.used = outputs.size();
  s.armed = at::GradMode::is_enabled() && out.requires_grad();
  return out;
}

std::shared_ptr<torch::nn::Module> DataParallelCore::replica(size_t i) const { return impl_->replicas.at(i); }
const DataParallelOptions& DataParallelCore::options() const { return impl_->options; }
size_t DataParallelCore::num_replicas() const { return impl_->replicas.size(); }

}  // namespace dtrain::detail
