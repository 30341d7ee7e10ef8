// Per-rank part of a checkpoint: this process's RNG states and TrainingState::values, packed into
// bytes so rank 0 can gather every rank's pack (dtrain/checkpoint.h, save step 1).
#pragma once

#include <map>
#include <string>

namespace dtrain::ckpt {

// Layout: u64 length + the CPU generator's state; u64 length + the current CUDA device's generator
// state (length 0 without CUDA); u64 count, then per value u64 key length + key + double.
std::string pack_rank_state(bool rng, const std::map<std::string, double>& values);
// Restores the RNG states (when `rng`; a CUDA state is skipped when this process has no CUDA) and
// returns the values. Throws dtrain::Error on a malformed pack.
std::map<std::string, double> unpack_rank_state(const std::string& pack, bool rng);

}  // namespace dtrain::ckpt
