// What a healing replica receives (save_state / load_state) and the sampler whose position moves only
// with committed steps (dtrain/fault_tolerance.h).
#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <sstream>

#include "dtrain/fault_tolerance.h"

namespace dtrain::ft {

std::string save_state(const torch::nn::Module& module, const torch::optim::Optimizer& optimizer,
                       const std::string& extra) {
  torch::serialize::OutputArchive model_archive, optim_archive, all;
  module.save(model_archive);
  optimizer.save(optim_archive);
  all.write("model", model_archive);
  all.write("optimizer", optim_archive);
  at::Tensor e = at::empty({static_cast<int64_t>(extra.size())}, at::kByte);
  if (!extra.empty()) std::memcpy(e.data_ptr(), extra.data(), extra.size());
  all.write("extra", e);
  std::ostringstream out;
  all.save_to(out);
  return out.str();
}

std::string load_state(torch::nn::Module& module, torch::optim::Optimizer& optimizer, const std::string& bytes) {
  torch::serialize::InputArchive all, model_archive, optim_archive;
  try {
    all.load_from(bytes.data(), bytes.size());
    all.read("model", model_archive);
    all.read("optimizer", optim_archive);
    module.load(model_archive);
    optimizer.load(optim_archive);
    at::Tensor e;
    all.read("extra", e);
    return std::string(static_cast<const char*>(e.data_ptr()), e.numel());
  } catch (const c10::Error& err) {
    throw Error(detail::cat("fault tolerance: the state received from a peer does not fit this model or optimizer (",
                            err.what_without_backtrace(), "): every replica must build the same model and optimizer"));
  }
}

ReplicaSampler::ReplicaSampler(int64_t size, uint64_t seed, bool shuffle)
    : size_(size), seed_(seed), shuffle_(shuffle) {
  DTRAIN_CHECK(size > 0, "ReplicaSampler: size is ", size, ": give the dataset's size (> 0)");
  make_order();
}

void ReplicaSampler::make_order() {
  order_.resize(size_);
  if (shuffle_) {
    at::Generator g = at::detail::createCPUGenerator(seed_ + static_cast<uint64_t>(epoch_));
    at::Tensor perm = at::randperm(size_, g, at::kLong);
    std::memcpy(order_.data(), perm.data_ptr<int64_t>(), size_ * sizeof(int64_t));
  } else {
    for (int64_t i = 0; i < size_; ++i) order_[i] = i;
  }
}

std::vector<int64_t> ReplicaSampler::indices(int participant_rank, int num_participants, int64_t batch) const {
  DTRAIN_CHECK(num_participants > 0 && participant_rank < num_participants && batch > 0, "ReplicaSampler: participant ",
               participant_rank, " of ", num_participants, ", batch ", batch,
               ": give the Manager's participant_rank() and num_participants() and a batch > 0");
  std::vector<int64_t> out;
  if (participant_rank < 0) return out;  // healing: no samples this step
  const int64_t end = std::min(size_, position_ + num_participants * batch);
  for (int64_t i = position_ + participant_rank; i < end; i += num_participants) out.push_back(order_[i]);
  return out;
}

void ReplicaSampler::advance(int num_participants, int64_t batch) {
  position_ = std::min(size_, position_ + num_participants * batch);
  if (position_ == size_) {
    ++epoch_;
    position_ = 0;
    make_order();
  }
}

std::string ReplicaSampler::state() const { return detail::cat(epoch_, " ", position_); }

void ReplicaSampler::load_state(const std::string& state) {
  std::istringstream s(state);
  int64_t epoch = 0, position = 0;
  DTRAIN_CHECK(static_cast<bool>(s >> epoch >> position) && position >= 0 && position < size_ && epoch >= 0,
               "ReplicaSampler: state '", state, "' is not 'epoch position' within ", size_,
               " samples: pass what state() returned on a replica of the same dataset");
  epoch_ = epoch;
  position_ = position;
  make_order();
}

}  // namespace dtrain::ft
