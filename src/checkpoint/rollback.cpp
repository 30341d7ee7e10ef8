#include "checkpoint/rollback.h"

#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>
#include <torch/serialize/archive.h>

#include <sstream>

#include "checkpoint/rank_state.h"
#include "dtrain/amp.h"
#include "dtrain/errors.h"
#include "dtrain/sampler.h"
#include "dtrain/sharded_optimizer.h"
#include "optim/state_device.h"

namespace dtrain::ckpt {

namespace {

std::vector<at::Tensor> model_tensors(torch::nn::Module& m) {
  std::vector<at::Tensor> out = m.parameters();
  for (const at::Tensor& b : m.buffers()) out.push_back(b);
  return out;
}

template <class T>
std::string saved(const T& thing) {
  torch::serialize::OutputArchive a;
  thing.save(a);
  std::ostringstream os;
  a.save_to(os);
  return os.str();
}

}  // namespace

Rollback::Rollback(const TrainingState& st) : plain_(st) {
  if (st.model) {
    at::NoGradGuard no_grad;
    for (const at::Tensor& t : model_tensors(*st.model)) tensors_.push_back(t.detach().clone());
  }
  // A sharded optimizer's load fills a fresh optimizer first and changes its own state only once
  // that succeeded; saving it would need every rank (prepare_for_save). Others are kept here.
  if (st.optimizer && !dynamic_cast<ShardedOptimizerState*>(st.optimizer)) optimizer_ = saved(*st.optimizer);
  if (st.scaler && st.scaler->is_enabled()) scaler_ = saved(*st.scaler);
  if (st.sampler) sampler_ = saved(*st.sampler);
  if (st.rng) rng_ = pack_rank_state(true, RankState{});
}

void Rollback::put_back(TrainingState& st) const noexcept {
  auto attempt = [](const char* what, auto&& f) {
    try {
      f();
    } catch (const std::exception& e) {
      warn(detail::cat("restoring a checkpoint failed, and putting back the ", what,
                       " as it was failed too: ", e.what()));
    }
  };
  if (st.model && !tensors_.empty())
    attempt("model", [&] {
      at::NoGradGuard no_grad;
      const std::vector<at::Tensor> now = model_tensors(*st.model);
      DTRAIN_CHECK(now.size() == tensors_.size(), "the model has ", now.size(), " tensors, ", tensors_.size(),
                   " were kept");
      // A load that failed half-way may have swapped a tensor of another device in (Module::load's set_data).
      for (size_t i = 0; i < now.size(); ++i) {
        if (now[i].device() == tensors_[i].device())
          now[i].detach().copy_(tensors_[i]);
        else
          now[i].set_data(tensors_[i].clone());
      }
    });
  if (st.optimizer && !optimizer_.empty())
    attempt("optimizer", [&] {
      st.optimizer->state().clear();  // a load keeps what the archive does not name: start from none
      auto a = optim_state::parse_on_cpu(optimizer_);
      optim_state::load_onto_param_devices(*st.optimizer, a);
    });
  if (st.scaler && !scaler_.empty())
    attempt("gradient scaler", [&] {
      auto a = optim_state::parse_on_cpu(scaler_);
      st.scaler->load(a);
    });
  if (st.sampler && !sampler_.empty())
    attempt("sampler", [&] {
      auto a = optim_state::parse_on_cpu(sampler_);
      st.sampler->load(a);
    });
  if (!rng_.empty()) attempt("random generators", [&] { restore_rng(rng_); });
  st.sampler_position = plain_.sampler_position;
  st.step = plain_.step;
  st.epoch = plain_.epoch;
  st.values = plain_.values;
  st.saved_world_size = plain_.saved_world_size;
  st.saved_values = plain_.saved_values;
}

}  // namespace dtrain::ckpt
