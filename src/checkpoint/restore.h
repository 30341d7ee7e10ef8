// Reading a checkpoint's archive back into a TrainingState (restore.cpp): what checkpoint.cpp's
// load_checkpoint and CheckpointManager::load_latest call once they hold a file's payload.
#pragma once

#include <string>

#include <torch/serialize/input-archive.h>

#include "dtrain/checkpoint.h"

namespace dtrain::ckpt {

// Parses the payload into `a` (every tensor onto the CPU) and checks its format version; throws
// dtrain::Error with the reason, without the file's name.
void parse(const std::string& payload, torch::serialize::InputArchive& a);
// Why this dtrain does not read a parsed archive ("" when it does): a sharded model saved in the
// retired format of a shard file per rank, with the way to convert it.
std::string retired_format(torch::serialize::InputArchive& a, const std::string& file);
// Restores `st` as the process of rank `my_rank`, all or nothing: a checkpoint that fails half-way
// leaves `st` as it was. A sharded model's load is a collective (every rank calls it).
void restore(torch::serialize::InputArchive& a, TrainingState& st, const std::string& file, int my_rank);

}  // namespace dtrain::ckpt
