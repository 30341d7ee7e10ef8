// DistributedSampler: torch.utils.data.DistributedSampler for C++, index for index.
//
//   dtrain::DistributedSampler sampler(dataset.size().value());        // rank/world from dtrain
//   auto loader = torch::data::make_data_loader(
//       dataset, sampler, torch::data::DataLoaderOptions().batch_size(64).workers(2));
//   for (int64_t epoch = 0; epoch < epochs; ++epoch) {
//     sampler.set_epoch(epoch);             // reaches the loader's copy: copies share the epoch
//     for (auto& batch : *loader) { ... }
//   }
//
// or as a plain index list:  for (int64_t i : sampler.indices()) ...
//
// Semantics are PyTorch's exactly (tests/data/sampler_golden.json holds PyTorch's own output):
//   1. indices = shuffle ? randperm(n, Generator seeded with seed + epoch) : 0..n-1
//      (the same at::randperm and mt19937 as Python, so the order is identical);
//   2. without drop_last, pad to total_size = ceil(n / num_replicas) * num_replicas by repeating the
//      list from its start (several times over if n is tiny), so every rank gets the same count;
//      with drop_last, cut to total_size = floor(n / num_replicas) * num_replicas;
//   3. rank r takes indices[r : total_size : num_replicas].
//
// Note [set_epoch]: the order depends only on seed + epoch. Without set_epoch every epoch repeats the
// same order (PyTorch warns about the same thing): call set_epoch(epoch) before each epoch. Because
// make_data_loader takes the sampler by value, copies of a DistributedSampler share their epoch, so
// set_epoch on your copy is seen by the loader's copy at its next begin() (= reset()). Everything
// else (configuration, dataset size, position in the epoch) belongs to each copy.
//
// Note [Resharded epoch]: an epoch that N ranks had partly consumed continues on M != N ranks (a
// checkpoint loaded by another world size; dtrain/checkpoint.h calls reshard_epoch()):
//   1. L = the list of steps 1-2 for N ranks (padded or cut). Rank r had consumed positions[r] of its
//      own indices, i.e. the positions r, r+N, ..., r+(positions[r]-1)*N of L; with equal positions p
//      the first p*N entries of L. C = the dataset indices at those positions (padded duplicates
//      included: such an index was trained, whichever copy of it was taken).
//   2. rest = the entries of L that are not in C, in L's order, each dataset index once (a padded
//      duplicate of an index still in rest is dropped; one of an index in C too). With drop_last,
//      the tail L had cut stays out of this epoch, as it would have without the restart.
//   3. The rest of the epoch is rest arranged for M ranks as a whole epoch would be: padded by wrapping
//      around rest (or cut, with drop_last) to a multiple of M, rank r taking rest[r::M], so every
//      rank has the same number of steps. An empty rest (the epoch was done) gives nothing.
// Over the whole epoch every dataset index of L is then trained exactly once, plus the padded
// duplicates of each world (< N and < M of them). A second world change in the same epoch applies
// 1-3 again to the list of step 3 (the segments are kept, and saved with the sampler). The next epoch
// (set_epoch to another value) is a normal epoch for M ranks; N == M never reshards (exact resume).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include <torch/data/samplers/base.h>

#include "dtrain/detail/arg.h"
#include "dtrain/errors.h"

namespace dtrain {

// Part of an epoch consumed by one world size before the world changed (Note [Resharded epoch]):
// `num_replicas` ranks, rank r having taken positions[r] indices of its list.
struct EpochSegment {
  int64_t num_replicas = 0;
  std::vector<int64_t> positions;  // (num_replicas)
};

// Options of DistributedSampler, builder style:
//   dtrain::DistributedSampler s(n, dtrain::DistributedSamplerOptions().num_replicas(4).rank(1).seed(42));
struct DistributedSamplerOptions {
  // Number of processes taking part. Unset: dtrain::world_size() (the process group must be
  // initialized, or pass it).
  DTRAIN_ARG(std::optional<int64_t>, num_replicas, std::nullopt)
  // This process's rank in [0, num_replicas). Unset: dtrain::rank().
  DTRAIN_ARG(std::optional<int64_t>, rank, std::nullopt)
  // Shuffle with randperm seeded by seed + epoch (the default, as PyTorch).
  DTRAIN_ARG(bool, shuffle, true)
  // Must be the same on every rank. seed + epoch seeds the generator; a negative sum wraps to
  // 2^64 + sum, as torch.Generator.manual_seed does in PyTorch 1.13.
  DTRAIN_ARG(int64_t, seed, 0)
  // Drop the tail so every rank gets n / num_replicas indices, instead of padding by wrapping around.
  DTRAIN_ARG(bool, drop_last, false)
};

class DistributedSampler : public torch::data::samplers::Sampler<std::vector<size_t>> {
 public:
  // dataset_size: the number of samples (dataset.size().value()). Throws dtrain::Error on a bad
  // rank/num_replicas, or when they are unset and the process group is not initialized.
  explicit DistributedSampler(size_t dataset_size,
                              const DistributedSamplerOptions& options = DistributedSamplerOptions());

  // Sets the epoch of this sampler and of every copy of it (Note [set_epoch]).
  void set_epoch(int64_t epoch);
  int64_t epoch() const;

  // This rank's indices for the current epoch (a fresh list on each call): in a resharded epoch,
  // this rank's part of the rest (Note [Resharded epoch]).
  std::vector<int64_t> indices() const;
  // indices().size(): size(), except in a resharded epoch.
  size_t epoch_size() const { return indices().size(); }
  // Indices per rank (len(sampler) in Python): the same on every rank.
  size_t size() const { return num_samples_; }
  // size() * num_replicas(): the padded (or cut) length of the whole list.
  size_t total_size() const { return num_samples_ * static_cast<size_t>(num_replicas_); }
  size_t dataset_size() const { return dataset_size_; }
  int64_t num_replicas() const { return num_replicas_; }
  int64_t rank() const { return rank_; }
  const DistributedSamplerOptions& options() const { return options_; }

  // --- torch::data::samplers::Sampler (what the DataLoader calls) ---------------------------------
  // (c10::optional: LibTorch 1.13's own optional; an alias of std::optional in 2.x.)
  // Starts a new pass over the current epoch's indices; new_size replaces the dataset size.
  void reset(c10::optional<size_t> new_size = c10::nullopt) override;
  // The next up to batch_size indices of this pass; nullopt when the pass is done. A pass started
  // without reset() uses the epoch current when its first batch is taken.
  c10::optional<std::vector<size_t>> next(size_t batch_size) override;
  // Saves the epoch, the position in the pass and the configuration; load() restores the epoch (for
  // every copy) and the position, and throws if the configuration differs.
  void save(torch::serialize::OutputArchive& archive) const override;
  void load(torch::serialize::InputArchive& archive) override;
  // Position in the current pass (indices handed out so far).
  size_t position() const { return position_; }
  // Makes the next pass of this sampler or of any copy of it (the DataLoader's) start at `position`
  // of the epoch's index list instead of 0, once: how a resumed run continues mid-epoch
  // (dtrain/checkpoint.h). Later passes start at 0 again.
  void resume_at(size_t position);
  // The current epoch was partly consumed by `segment.num_replicas` ranks (Note [Resharded epoch]):
  // from the next pass of this sampler or of any copy, this epoch is the rest of it, split over this
  // sampler's num_replicas. Throws when a position is outside [0, that rank's count]. Applies until
  // the epoch changes; calls in the same epoch stack up (a second world change).
  void reshard_epoch(const EpochSegment& segment);
  // The segments that apply to the current epoch (empty: a normal epoch).
  std::vector<EpochSegment> epoch_segments() const;
  // load() for an archive that another num_replicas saved (load() requires the same): restores the
  // epoch and its earlier segments, then reshard_epoch(segment) with segment.num_replicas the saved
  // one. How dtrain/checkpoint.h loads a checkpoint on another world size.
  void load_resharded(torch::serialize::InputArchive& archive, std::vector<int64_t> saved_positions);

 private:
  void compute_sizes();
  // Steps 1 and Note [Resharded epoch]: the epoch's order, less what earlier world sizes consumed.
  std::vector<int64_t> epoch_rest() const;
  void start_pass();
  // load()'s common part; `replicas_checked`: the saved num_replicas must equal this one.
  int64_t load_common(torch::serialize::InputArchive& archive, bool replicas_checked);

  DistributedSamplerOptions options_;
  int64_t num_replicas_ = 1;
  int64_t rank_ = 0;
  size_t dataset_size_ = 0;
  size_t num_samples_ = 0;
  std::shared_ptr<std::atomic<int64_t>> epoch_;   // shared by copies (Note [set_epoch])
  std::shared_ptr<std::atomic<int64_t>> resume_;  // shared by copies: resume_at()'s position, or -1
  struct Reshard;                                 // shared by copies: reshard_epoch()'s segments
  std::shared_ptr<Reshard> reshard_;

  // The current pass (next()).
  std::vector<int64_t> pass_indices_;
  size_t position_ = 0;
  bool pass_started_ = false;
};

}  // namespace dtrain
