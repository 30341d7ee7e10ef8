// Staged copies of a module's and an optimizer's tensors, and the thread that writes them.
#include "checkpoint/staging.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/nn/module.h>
#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>

#include "common/util.h"

namespace dtrain::ckpt {

namespace {

// A copy that loads as the original: Module::load checks requires_grad against the module's.
at::Tensor staged(const at::Tensor& t) {
  if (!t.defined()) return t;
  return t.detach().clone().requires_grad_(t.requires_grad());
}

at::Tensor copy(const at::Tensor& t) { return t.defined() ? t.clone() : t; }

}  // namespace

void save_module_staged(const torch::nn::Module& module, torch::serialize::OutputArchive& archive) {
  for (const auto& p : module.named_parameters(/*recurse=*/false)) archive.write(p.key(), staged(p.value()));
  for (const auto& b : module.named_buffers(/*recurse=*/false))
    archive.write(b.key(), staged(b.value()), /*is_buffer=*/true);
  for (const auto& child : module.named_children()) {
    if (!child.value()->is_serializable()) continue;
    torch::serialize::OutputArchive child_archive(archive.compilation_unit());
    save_module_staged(*child.value(), child_archive);
    archive.write(child.key(), child_archive);
  }
}

bool restage_optimizer_state(torch::optim::Optimizer& optimizer) {
  using namespace torch::optim;
  for (const auto& kv : optimizer.state()) {
    const OptimizerParamState* s = kv.second.get();
    if (!dynamic_cast<const AdamParamState*>(s) && !dynamic_cast<const AdamWParamState*>(s) &&
        !dynamic_cast<const SGDParamState*>(s) && !dynamic_cast<const AdagradParamState*>(s) &&
        !dynamic_cast<const RMSpropParamState*>(s))
      return false;
  }
  for (auto& kv : optimizer.state()) {
    OptimizerParamState* s = kv.second.get();
    if (auto* a = dynamic_cast<AdamParamState*>(s)) {
      a->exp_avg(copy(a->exp_avg())).exp_avg_sq(copy(a->exp_avg_sq())).max_exp_avg_sq(copy(a->max_exp_avg_sq()));
    } else if (auto* w = dynamic_cast<AdamWParamState*>(s)) {
      w->exp_avg(copy(w->exp_avg())).exp_avg_sq(copy(w->exp_avg_sq())).max_exp_avg_sq(copy(w->max_exp_avg_sq()));
    } else if (auto* g = dynamic_cast<SGDParamState*>(s)) {
      g->momentum_buffer(copy(g->momentum_buffer()));
    } else if (auto* d = dynamic_cast<AdagradParamState*>(s)) {
      d->sum(copy(d->sum()));
    } else if (auto* r = dynamic_cast<RMSpropParamState*>(s)) {
      r->square_avg(copy(r->square_avg())).momentum_buffer(copy(r->momentum_buffer())).grad_avg(copy(r->grad_avg()));
    }
  }
  return true;
}

BackgroundWrite::~BackgroundWrite() { (void)finish(); }

void BackgroundWrite::run(std::string what, std::function<void()> work) {
  (void)finish();
  what_ = std::move(what);
  error_.clear();
  thread_ = std::thread([this, work = std::move(work)] {
    std::string error;
    try {
      work();
    } catch (const c10::Error& e) {
      error = util::one_line(e.what_without_backtrace());
    } catch (const std::exception& e) {
      error = util::one_line(e.what());
    } catch (...) {
      error = "an unknown error";
    }
    std::lock_guard<std::mutex> lock(mu_);
    error_ = error;
  });
}

std::string BackgroundWrite::finish() {
  if (thread_.joinable()) thread_.join();
  std::lock_guard<std::mutex> lock(mu_);
  std::string e;
  e.swap(error_);  // told once
  return e;
}

}  // namespace dtrain::ckpt
