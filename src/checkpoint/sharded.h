// Checkpoints of sharded models (fully_shard, parallelize_module, both): the model and optimizer as a
// DCP folder beside the main file, which rank 0 writes last (Note [Sharded checkpoints] in
// sharded.cpp; the layout in docs/design.md, "Checkpoint files").
#pragma once

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "checkpoint/dcp_phases.h"
#include "dtrain/checkpoint.h"

namespace dtrain::ckpt {

class StagingPool;

// Whether any parameter of `model` is sharded (null: no).
bool holds_shards(const torch::nn::Module* model);
// "name dtype [whole shape]" per parameter, then per buffer: a sharded parameter by its whole shape,
// so that a model sharded over any world (or not at all) has the manifest of its architecture.
std::vector<std::pair<std::string, std::string>> whole_manifest(const torch::nn::Module& model);

// The DCP folder of the checkpoint whose main file is `main_path`: <prefix>_<step>.dcp beside it.
std::string dcp_folder(const std::string& main_path);
// Save, on every rank (collectives over the world), in phases so that save_async can write on a
// thread: begin (the ranks agree; the model's and optimizer's state under PyTorch's keys,
// dcp::get_state_dict, planned into dcp_folder(main_path); with `staging` every tensor is a copy from
// it, which no later step changes), then write() on any thread, then finish, which returns the
// record the main file keeps of the folder, the same on every rank: its name and its `.metadata`'s
// length and CRC-32, so that a load never reads a folder another save rewrote.
std::shared_ptr<dcp::detail::SaveInProgress> begin_sharded_save(const std::string& main_path, const TrainingState& st,
                                                                StagingPool* staging);
std::string finish_sharded_save(dcp::detail::SaveInProgress& save);
// Whether the folder of `main_path` is still the one `record` describes; "" if so, else why not.
std::string check_folder(const std::string& main_path, const std::string& record);
// Load, on every rank (collective): fills st.model (sharded or whole) and st.optimizer from the
// folder, resharded onto this world's layout by DCP's chunks. All or nothing: a failure on any rank
// throws on every rank before anything changed. `failure`: this rank's failure so far ("" if none),
// told to every rank here, so that no rank waits in a collective another has left.
void load_sharded(const std::string& main_path, const std::string& record, TrainingState& st,
                  const std::string& failure);
// Rotation, on rank 0: removes every DCP folder in `dir` (by `prefix`) whose main file `keep` does not
// hold (a rotated checkpoint's, or a failed save's). Errors are ignored.
void remove_folders_except(const std::string& dir, const std::string& prefix, const std::vector<std::string>& keep);

}  // namespace dtrain::ckpt
