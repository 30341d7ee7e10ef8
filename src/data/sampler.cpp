// DistributedSampler: the steps are numbered in include/dtrain/sampler.h and follow
// torch/utils/data/distributed.py (PyTorch 1.13) line for line.
#include "dtrain/sampler.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/ATen.h>
#include <torch/serialize/archive.h>

#include <mutex>

#include "dtrain/process_group.h"

namespace dtrain {

struct DistributedSampler::Reshard {
  std::mutex mutex;
  int64_t epoch = 0;                   // the epoch `segments` belong to
  std::vector<EpochSegment> segments;  // oldest first
};

namespace {
constexpr const char* kWhat = "DistributedSampler: ";

// Step 2 (and Note [Resharded epoch] step 3): `list` padded by wrapping around, or cut with
// drop_last, to a multiple of `replicas`.
std::vector<int64_t> arrange(std::vector<int64_t> list, int64_t replicas, bool drop_last) {
  const auto w = static_cast<size_t>(replicas);
  const size_t per_rank = drop_last ? list.size() / w : (list.size() + w - 1) / w;
  const size_t total = per_rank * w;
  if (list.size() < total) {
    const size_t original = list.size();
    list.reserve(total);
    for (size_t i = 0; list.size() < total; ++i) list.push_back(list[i % original]);
  } else {
    list.resize(total);
  }
  return list;
}

// Note [Resharded epoch] steps 1-2: the entries of `list` (arranged for segment.num_replicas ranks)
// that the segment did not consume, each dataset index once, in order. `n`: the dataset size.
std::vector<int64_t> rest_after(const std::vector<int64_t>& list, const EpochSegment& segment, size_t n) {
  const auto w = static_cast<size_t>(segment.num_replicas);
  std::vector<char> consumed(n, 0), taken(n, 0);
  for (size_t r = 0; r < w; ++r) {
    for (int64_t k = 0; k < segment.positions[r]; ++k) {
      const size_t j = r + static_cast<size_t>(k) * w;
      DTRAIN_ASSERT(j < list.size(), "resharded position ", j, " past the list of ", list.size());
      consumed[static_cast<size_t>(list[j])] = 1;
    }
  }
  std::vector<int64_t> rest;
  for (int64_t v : list) {
    const auto i = static_cast<size_t>(v);
    if (consumed[i] || taken[i]) continue;
    taken[i] = 1;
    rest.push_back(v);
  }
  return rest;
}

// The segments as one flat list (num_replicas, then its positions, per segment) for an archive.
std::vector<int64_t> flatten(const std::vector<EpochSegment>& segments) {
  std::vector<int64_t> flat;
  for (const auto& s : segments) {
    flat.push_back(s.num_replicas);
    flat.insert(flat.end(), s.positions.begin(), s.positions.end());
  }
  return flat;
}

std::vector<EpochSegment> unflatten(const std::vector<int64_t>& flat) {
  std::vector<EpochSegment> segments;
  for (size_t i = 0; i < flat.size();) {
    const int64_t w = flat[i++];
    DTRAIN_CHECK(w > 0 && static_cast<size_t>(w) <= flat.size() - i, kWhat, "saved resharded segments are malformed");
    segments.push_back({w, std::vector<int64_t>(flat.begin() + i, flat.begin() + i + w)});
    i += static_cast<size_t>(w);
  }
  return segments;
}
}  // namespace

DistributedSampler::DistributedSampler(size_t dataset_size, const DistributedSamplerOptions& options)
    : options_(options),
      dataset_size_(dataset_size),
      epoch_(std::make_shared<std::atomic<int64_t>>(0)),
      resume_(std::make_shared<std::atomic<int64_t>>(-1)),
      reshard_(std::make_shared<Reshard>()) {
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

std::vector<int64_t> DistributedSampler::epoch_rest() const {
  const auto n = static_cast<int64_t>(dataset_size_);
  // 1. The whole order: randperm(n) seeded with seed + epoch, or 0..n-1.
  std::vector<int64_t> order(dataset_size_);
  if (options_.shuffle()) {
    const auto seed = static_cast<uint64_t>(options_.seed() + epoch_->load());
    at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(seed);
    at::Tensor perm = at::randperm(n, gen, at::TensorOptions().dtype(at::kLong));  // (n,)
    const int64_t* p = perm.data_ptr<int64_t>();
    std::copy(p, p + n, order.begin());
  } else {
    for (int64_t i = 0; i < n; ++i) order[i] = i;
  }
  // Note [Resharded epoch]: what earlier world sizes left of this epoch.
  const std::vector<EpochSegment> segments = epoch_segments();
  for (const EpochSegment& s : segments)
    order = rest_after(arrange(std::move(order), s.num_replicas, options_.drop_last()), s, dataset_size_);
  return order;
}

std::vector<int64_t> DistributedSampler::indices() const {
  // 2. Pad by wrapping around (every rank gets the same count), or cut the tail.
  const std::vector<int64_t> all = arrange(epoch_rest(), num_replicas_, options_.drop_last());
  // 3. This rank's share: all[rank : total : num_replicas].
  std::vector<int64_t> mine;
  mine.reserve(all.size() / static_cast<size_t>(num_replicas_));
  for (size_t i = static_cast<size_t>(rank_); i < all.size(); i += static_cast<size_t>(num_replicas_)) {
    mine.push_back(all[i]);
  }
  DTRAIN_ASSERT(!epoch_segments().empty() || mine.size() == num_samples_, "rank ", rank_, " got ", mine.size(),
                " indices, expected ", num_samples_);
  return mine;
}

std::vector<EpochSegment> DistributedSampler::epoch_segments() const {
  std::lock_guard<std::mutex> lock(reshard_->mutex);
  if (reshard_->epoch != epoch_->load()) return {};
  return reshard_->segments;
}

void DistributedSampler::reshard_epoch(const EpochSegment& segment) {
  DTRAIN_CHECK(segment.num_replicas > 0, kWhat, "reshard_epoch: num_replicas must be > 0, got ", segment.num_replicas);
  DTRAIN_CHECK(segment.positions.size() == static_cast<size_t>(segment.num_replicas), kWhat,
               "reshard_epoch: ", segment.positions.size(),
               " positions given for num_replicas = ", segment.num_replicas,
               ": pass one position per rank of that world");
  // Each rank's count in the list that world had: the rest after the earlier segments, arranged.
  const size_t listed = arrange(epoch_rest(), segment.num_replicas, options_.drop_last()).size();
  const size_t per_rank = listed / static_cast<size_t>(segment.num_replicas);
  for (size_t r = 0; r < segment.positions.size(); ++r)
    DTRAIN_CHECK(segment.positions[r] >= 0 && static_cast<size_t>(segment.positions[r]) <= per_rank, kWhat,
                 "reshard_epoch: rank ", r, "'s position ", segment.positions[r], " is outside [0, ", per_rank,
                 "] (its count in epoch ", epoch(), " on ", segment.num_replicas, " ranks)");
  std::lock_guard<std::mutex> lock(reshard_->mutex);
  if (reshard_->epoch != epoch_->load()) {
    reshard_->epoch = epoch_->load();
    reshard_->segments.clear();
  }
  reshard_->segments.push_back(segment);
}

void DistributedSampler::start_pass() {
  pass_indices_ = indices();
  const int64_t resume = resume_->exchange(-1);
  position_ = resume > 0 ? std::min(static_cast<size_t>(resume), pass_indices_.size()) : 0;
  pass_started_ = true;
}

void DistributedSampler::resume_at(size_t position) {
  const size_t count = epoch_size();
  DTRAIN_CHECK(position <= count, kWhat, "resume_at(", position, ") is past the ", count, " indices of epoch ", epoch(),
               " on this rank");
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
  // Note [Resharded epoch]: the world sizes this epoch went through before this one.
  archive.write("epoch_segments", c10::IValue(flatten(epoch_segments())));
}

void DistributedSampler::load(torch::serialize::InputArchive& archive) {
  load_common(archive, /*replicas_checked=*/true);
}

void DistributedSampler::load_resharded(torch::serialize::InputArchive& archive, std::vector<int64_t> saved_positions) {
  const int64_t replicas = load_common(archive, /*replicas_checked=*/false);
  pass_indices_.clear();
  position_ = 0;
  pass_started_ = false;
  reshard_epoch({replicas, std::move(saved_positions)});
}

int64_t DistributedSampler::load_common(torch::serialize::InputArchive& archive, bool replicas_checked) {
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
  DTRAIN_CHECK(!replicas_checked || replicas == num_replicas_, kWhat, "saved with num_replicas = ", replicas,
               ", loading into one with num_replicas = ", num_replicas_,
               ": load it through dtrain::CheckpointManager, which reshards the epoch (Note [Resharded epoch])");
  DTRAIN_CHECK(replicas > 0, kWhat, "saved num_replicas is ", replicas);
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

  std::vector<EpochSegment> segments;
  if (archive.try_read("epoch_segments", v)) segments = unflatten(v.toIntVector());  // absent before resharding

  dataset_size_ = static_cast<size_t>(size);
  compute_sizes();
  epoch_->store(epoch);
  {
    std::lock_guard<std::mutex> lock(reshard_->mutex);
    reshard_->epoch = epoch;
    reshard_->segments = std::move(segments);
  }
  if (started && replicas == num_replicas_) {  // (load_resharded starts a new pass)
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
  return replicas;
}

}  // namespace dtrain
