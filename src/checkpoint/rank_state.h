// Per-rank part of a checkpoint: this process's RNG states, TrainingState::values and sampler
// position, packed into bytes so rank 0 can gather every rank's pack (dtrain/checkpoint.h, save step 1).
#pragma once

#include <cstdint>
#include <map>
#include <string>

namespace dtrain::ckpt {

struct RankState {
  std::map<std::string, double> values;
  int64_t sampler_rank = -1;  // the rank of its DistributedSampler; -1: none saved
  int64_t sampler_position = 0;
};

// Layout: u64 length + the CPU generator's state; u64 length + the current CUDA device's generator
// state (length 0 without CUDA); u64 count, then per value u64 key length + key + double; then
// (absent in files written before resharding) i64 sampler rank (-1: none) + i64 sampler position.
std::string pack_rank_state(bool rng, const RankState& state);
// The values and sampler position of a pack. Throws dtrain::Error on a malformed pack.
RankState read_rank_state(const std::string& pack);
// Restores the pack's RNG states (a CUDA state is skipped when this process has no CUDA).
void restore_rng(const std::string& pack);
// For a rank that has no pack of its own (more ranks than saved): seeds the default generators
// (CPU, and the current CUDA device's) from a number drawn from `pack`'s CPU state mixed with `rank`, so
// the new rank's stream is reproducible from the checkpoint and differs from every saved rank's.
void derive_rng(const std::string& pack, int64_t rank);

}  // namespace dtrain::ckpt
