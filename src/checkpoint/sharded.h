// Checkpoints of fully_shard'ed models: every rank writes its own shards and its optimizer's state
// for them to a file of its own beside the main file, which rank 0 writes last
// (Note [Sharded checkpoints] in sharded.cpp; the layout in dtrain/checkpoint.h).
#pragma once

#include <optional>
#include <string>
#include <vector>

#include <torch/serialize/archive.h>

#include "dtrain/checkpoint.h"

namespace dtrain::ckpt {

// Whether fully_shard holds any parameter of `model` (null: no).
bool holds_shards(const torch::nn::Module* model);
// "name dtype [whole shape]" per parameter, then per buffer: a sharded parameter by its whole shape,
// so that a model sharded over any world (or not at all) has the manifest of its architecture.
std::vector<std::pair<std::string, std::string>> whole_manifest(const torch::nn::Module& model);

// The file of rank `rank` of `world` beside the main file `main_path`:
// <prefix>_<step>.shard<rank>-of-<world>.pt.
std::string shard_path(const std::string& main_path, int rank, int world);
// Save, on every rank: writes this rank's shard file atomically and returns its record, three lines:
// the file's header line and layout (the main file records both, so that a load reads the shards of
// that very save and knows which rows each holds) and a digest of its sharded parameters' names.
std::string write_own_shard(const std::string& main_path, const TrainingState& st, int rank, int world);
// Save, on every rank, with every rank's record in rank order: throws (alike on every rank) when the
// ranks shard different parameters.
void check_shard_records(const std::vector<std::string>& records);
// The format version of the main file of a save with these records: 2 when some file does not hold
// its world rank's rows of the world (sharded over a subgroup), else 1 (Note [Sharded checkpoints]).
int format_version(const std::vector<std::string>& records);
// Save, on rank 0: the main file's part for the model (replicated tensors, the shard records).
void encode_sharded_model(torch::serialize::OutputArchive& a, const TrainingState& st,
                          const std::vector<std::string>& records);
// Whether a main file's archive is of a sharded save.
bool is_sharded_archive(torch::serialize::InputArchive& a);
// Load, on every rank: reads the shards it needs (by their recorded layouts, the rows of its own on
// any world and group size, or all of them), checks them, then restores st.model's parameters and
// buffers and st.optimizer's state.
// Throws before changing anything when a shard is missing or not of that save.
// Tensors are read onto the CPU and copied into the model's own (its devices).
void load_sharded_model(torch::serialize::InputArchive& a, TrainingState& st, const std::string& main_path);
// Rotation: removes the shard files in `dir` of checkpoints (by `prefix`) that `keep` (main file
// names) does not hold, for shard rank `rank` (-1: every rank's). Errors are ignored.
void remove_shards_except(const std::string& dir, const std::string& prefix, const std::vector<std::string>& keep,
                          int rank);

}  // namespace dtrain::ckpt
