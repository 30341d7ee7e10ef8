// DistributedSampler: the steps are numbered in include/dtrain/sampler.h and follow
// torch/utils/data/distributed.py (PyTorch 1.13) line for line.
#include "dtrain/sampler.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/ATen.h>
#include <torch/serialize/archive.h>

#include "dtrain/process_group.h"

namespace dtrain {

namespace {
constexpr const char* kWhat = "DistributedSampler: ";
}  // namespace

DistributedSampler::DistributedSampler(size_t dataset_size, const DistributedSamplerOptions& options)
    : options_(options),
      dataset_size_(dataset_size),
      epoch_(std::make_shared<std::atomic<int64_t>>(0)),
      resume_(std::make_shared<std::atomic<int64_t>>(-1)) {
  if (options.num_replicas()) {
    num_replicas_ = *options.num_replicas();
  } else {
    DTRAIN_CHECK(is_initialized(), kWhat,
                 "num_replicas not given and the process group is not initialized: call "
                 "dtrain::init_process_group() first or pass num_replicas and rank");
    num_replicas_ = world_size();
  }
  if (options.rank()) {
    rank_ = *options.rank();
  } else {
    DTRAIN_CHECK(is_initialized(), kWhat,
                 "rank not given and the process group is not initialized: call "
                 "dtrain::init_process_group() first or pass num_replicas and rank");
    rank_ = dtrain::rank();
  }
  DTRAIN_CHECK(num_replicas_ > 0, kWhat, "num_replicas must be > 0, got ", num_replicas_);
  DTRAIN_CHECK(rank_ >= 0 && rank_ < num_replicas_, kWhat, "rank must be in [0, ", num_replicas_ - 1,
               "] (num_replicas = ", num_replicas_, "), got rank ", rank_);
  compute_sizes();
}

void DistributedSampler::compute_sizes() {
  const auto replicas = static_cast<size_t>(num_replicas_);
  // PyTorch: drop_last and n % r != 0 -> ceil((n - r) / r) = floor(n / r) (0 when n < r);
  // otherwise ceil(n / r).
  num_samples_ = options_.drop_last() ? dataset_size_ / replicas : (dataset_size_ + replicas - 1) / replicas;
}

void DistributedSampler::set_epoch(int64_t epoch) { epoch_->store(epoch); }

int64_t DistributedSampler::epoch() const { return epoch_->load(); }

std::vector<int64_t> DistributedSampler::indices() const {
  const auto n = static_cast<int64_t>(dataset_size_);
  // 1. The whole order: randperm(n) seeded with seed + epoch, or 0..n-1.
  std::vector<int64_t> all(dataset_size_);
  if (options_.shuffle()) {
    const auto seed = static_cast<uint64_t>(options_.seed() + epoch_->load());
    at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(seed);
    at::Tensor perm = at::randperm(n, gen, at::TensorOptions().dtype(at::kLong));  // (n,)
    const int64_t* p = perm.data_ptr<int64_t>();
    std::copy(p, p + n, all.begin());
  } else {
    for (int64_t i = 0; i < n; ++i) all[i] = i;
  }
  // 2. Pad by wrapping around (every rank gets the same count), or cut the tail.
  const size_t total = total_size();
  if (all.size() < total) {
    DTRAIN_ASSERT(!all.empty(), "padding an empty index list to ", total);
    const size_t original = all.size();
    all.reserve(total);
    for (size_t i = 0; all.size() < total; ++i) all.push_back(all[i % original]);
  } else {
    all.resize(total);
  }
  // 3. This rank's share: all[rank : total : num_replicas].
  std::vector<int64_t> mine;
  mine.reserve(num_samples_);
  for (size_t i = static_cast<size_t>(rank_); i < total; i += static_cast<size_t>(num_replicas_)) {
    mine.push_back(all[i]);
  }
  DTRAIN_ASSERT(mine.size() == num_samples_, "rank ", rank_, " got ", mine.size(), " indices, expected ", num_samples_);
  return mine;
}

void DistributedSampler::start_pass() {
  pass_indices_ = indices();
  const int64_t resume = resume_->exchange(-1);
  position_ = resume > 0 ? std::min(static_cast<size_t>(resume), pass_indices_.size()) : 0;
  pass_started_ = true;
}

void DistributedSampler::resume_at(size_t position) {
  DTRAIN_CHECK(position <= num_samples_, kWhat, "resume_at(", position, ") is past the ", num_samples_,
               " indices of an epoch on this rank");
  resume_->store(static_cast<int64_t>(position));
}

void DistributedSampler::reset(c10::optional<size_t> new_size) {
  if (new_size) {
    dataset_size_ = *new_size;
    compute_sizes();
  }
  start_pass();
}

c10::optional<std::vector<size_t>> DistributedSampler::next(size_t batch_size) {
  if (!pass_started_) start_pass();
  if (position_ >= pass_indices_.size()) return c10::nullopt;
  const size_t end = std::min(pass_indices_.size(), position_ + batch_size);
  std::vector<size_t> batch(pass_indices_.begin() + position_, pass_indices_.begin() + end);
  position_ = end;
  return batch;
}

void DistributedSampler::save(torch::serialize::OutputArchive& archive) const {
  archive.write("epoch", c10::IValue(epoch_->load()));
  archive.write("position", c10::IValue(static_cast<int64_t>(position_)));
  archive.write("pass_started", c10::IValue(pass_started_));
  archive.write("dataset_size", c10::IValue(static_cast<int64_t>(dataset_size_)));
  archive.write("num_replicas", c10::IValue(num_replicas_));
  archive.write("seed", c10::IValue(options_.seed()));
  archive.write("shuffle", c10::IValue(options_.shuffle()));
  archive.write("drop_last", c10::IValue(options_.drop_last()));
}

void DistributedSampler::load(torch::serialize::InputArchive& archive) {
  c10::IValue v;
  auto read_int = [&](const char* key) {
    archive.read(key, v);
    return v.toInt();
  };
  auto read_bool = [&](const char* key) {
    archive.read(key, v);
    return v.toBool();
  };
  const int64_t replicas = read_int("num_replicas");
  DTRAIN_CHECK(replicas == num_replicas_, kWhat, "saved with num_replicas = ", replicas,
               ", loading into one with num_replicas = ", num_replicas_);
  const int64_t seed = read_int("seed");
  DTRAIN_CHECK(seed == options_.seed(), kWhat, "saved with seed = ", seed,
               ", loading into one with seed = ", options_.seed());
  const bool shuffle = read_bool("shuffle");
  DTRAIN_CHECK(shuffle == options_.shuffle(), kWhat, "saved with shuffle = ", shuffle,
               ", loading into one with shuffle = ", options_.shuffle());
  const bool drop_last = read_bool("drop_last");
  DTRAIN_CHECK(drop_last == options_.drop_last(), kWhat, "saved with drop_last = ", drop_last,
               ", loading into one with drop_last = ", options_.drop_last());
  const int64_t size = read_int("dataset_size");
  DTRAIN_CHECK(size >= 0, kWhat, "saved dataset_size is negative: ", size);
  const int64_t epoch = read_int("epoch");
  const int64_t position = read_int("position");
  const bool started = read_bool("pass_started");

  dataset_size_ = static_cast<size_t>(size);
  compute_sizes();
  epoch_->store(epoch);
  if (started) {
    pass_indices_ = indices();
    pass_started_ = true;
    DTRAIN_CHECK(position >= 0 && static_cast<size_t>(position) <= pass_indices_.size(), kWhat, "saved position ",
                 position, " is outside [0, ", pass_indices_.size(), "]");
    position_ = static_cast<size_t>(position);
  } else {
    pass_indices_.clear();
    position_ = 0;
    pass_started_ = false;
  }
}

}  // namespace dtrain
