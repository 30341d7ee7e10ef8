// Checkpoints for exact resume: model, optimizer, GradScaler, sampler epoch and position, RNG states,
// step count and user values, written atomically and loaded by every rank.
//
//   dtrain::TrainingState st;                       // what to save and restore (null: left out)
//   st.model = ddp.module().get();  st.optimizer = &opt;  st.scaler = &scaler;  st.sampler = &sampler;
//   dtrain::CheckpointManager ckpt("/ckpt");        // keeps the newest 2 (CheckpointOptions().keep(k))
//   if (auto path = ckpt.load_latest(st)) { ... }   // every rank; st.step/epoch/values are restored
//   for (...) {                                     // train; keep st.step (and the rest) current
//     if (st.step % 100 == 0) ckpt.save(st);        // every rank calls it
//   }
//
// What a caller may rely on (how, and the files: docs/design.md, "Checkpoint files"):
//   - save() and load_latest() are collectives: every rank calls them. A failure on any rank (an
//     unwritable folder, a full disk, a damaged file) throws the same dtrain::Error on every rank,
//     naming the file, the rank and the reason.
//   - A checkpoint is complete or absent: a save killed at any point (kill -9 included) leaves the
//     older checkpoints as they were, the latest for load_latest. Rotation keeps the newest `keep`
//     writes and never deletes the one just written.
//   - The latest checkpoint is the most recent write, not the highest step (Note [Write order] in
//     src/checkpoint/write_order.cpp): a run restarted from step 100 that saved step 150 resumes at
//     its own 150, not at a step 300 an abandoned run left in the folder; save() and load_latest()
//     warn once when a later step is present.
//   - load_latest() tries the checkpoints newest first: one that is truncated, corrupt (CRC-32) or
//     does not parse gives "dtrain warning: checkpoint <file> is unusable (<reason>); falling back to
//     the previous one". No checkpoint: std::nullopt everywhere; some but none usable: an error.
//   - Every rank restores the same checkpoint (rank 0 picks it and broadcasts it), also on nodes that
//     do not share the folder, except a sharded model's (below).
//   - The model is checked first (names, shapes and dtypes of every parameter and buffer; the first
//     mismatch is the error: "... tensor 'fc1.weight' is Float [128, 3136] in the checkpoint but
//     Float [64, 3136] in the model ..."). All or nothing: a checkpoint that fails half-way leaves
//     every member of the TrainingState as it was.
//
// Note [exact resume]: restoring all of the above makes the continued run compute bit-identical
// steps as long as the program itself is deterministic (same thread count, same world size, no
// data-dependent nondeterminism). train_fashion_mnist's fault tests check this with params_sha256.
//
// Loading on another world size (N ranks saved, M load; an elastic restart) reshards:
//   - model, optimizer and GradScaler are the same on every rank (DDP) and load as they are; a
//     ZeroRedundancyOptimizer keeps the share of the new world's partition of the whole state;
//   - the sampler's epoch continues with what the N ranks had not consumed, split over M ranks,
//     each dataset index of the epoch trained once (Note [Resharded epoch] in dtrain/sampler.h);
//     st.sampler_position is then 0, the start of that rest;
//   - RNG states and values: rank r < N takes rank r's; a rank r >= N has none of its own: its
//     generators are seeded from a number drawn from rank 0's saved CPU state mixed with r, and its
//     values start empty. st.saved_world_size and st.saved_values (every saved rank's) let the
//     caller merge running sums (train_fashion_mnist gives them all to rank 0).
//
// A sharded model (fully_shard, parallelize_module, or both on a mesh) is on no rank whole, and no
// rank gathers it: every rank writes its part of the model and optimizer into a DCP folder beside
// the main file (dtrain/dcp.h; Note [Sharded checkpoints] in src/checkpoint/sharded.cpp), which
// Python's dcp.load reads into a PyTorch model sharded alike, or any other way. It loads onto any
// world and any sharding of the same model, or none; on the same layout bit for bit. The optimizer
// must be Adam, AdamW or SGD (the states PyTorch's keys describe). Every rank must see the folder:
// on several nodes, one they share. Checkpoints of the retired per-rank shard-file format (versions
// 1 to 3 with shard files) are refused in one line saying how to convert them.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "dtrain/detail/arg.h"

namespace torch::nn {
class Module;
}
namespace torch::optim {
class Optimizer;
}

namespace dtrain {

namespace ckpt {
class BackgroundWrite;
class StagingPool;
struct PendingShardedSave;
}  // namespace ckpt
class GradScaler;
class DistributedSampler;

// The newest file format this dtrain reads and writes. A file carries the lowest version that reads it:
// 4 for a sharded model's (its model in a DCP folder), 1 for every other.
constexpr int kCheckpointFormatVersion = 4;

// What a checkpoint holds. Null pointers are neither saved nor restored.
struct TrainingState {
  // The inner model (ddp.module().get()), not the DDP wrapper; a fully_shard'ed model as it is.
  torch::nn::Module* model = nullptr;
  torch::optim::Optimizer* optimizer = nullptr;
  GradScaler* scaler = nullptr;
  DistributedSampler* sampler = nullptr;
  // Indices of the current epoch this rank has consumed (batches done x batch size). -1: the
  // sampler's own position(), which is 0 for a copy that the DataLoader does not drive.
  int64_t sampler_position = -1;
  int64_t step = 0;   // optimizer steps done: names the file
  int64_t epoch = 0;  // the caller's meaning (e.g. the epoch in progress)
  // Pipeline parallelism (torchtitan's model_parts): `model` is this rank's part of a model cut
  // across ranks (a pipeline stage, the whole model's parameter names kept). Every rank then writes
  // and reads its own part's parameters and optimizer state in the checkpoint's DCP folder, as for a
  // sharded model; the checkpoint's manifest is the union of the ranks' parts, and each rank's part is
  // checked against it on load (names, dtypes, whole shapes). Set it alike on every rank.
  bool model_part = false;
  // Per-rank values (running loss sums, counters): saved for every rank, restored to each rank.
  std::map<std::string, double> values;
  bool rng = true;  // save and restore the RNG states
  // Set by loading: the world size that saved the checkpoint, and every saved rank's `values` (for a
  // caller that merges them when the world changed: `values` only has this rank's, or none).
  int64_t saved_world_size = 0;
  std::vector<std::map<std::string, double>> saved_values;
};

struct CheckpointOptions {
  // Checkpoints kept in the folder, newest first (>= 1). 2 keeps a previous one to fall back to.
  DTRAIN_ARG(int64_t, keep, 2)
  // File names: <prefix>_<step, 10 digits>.pt.
  DTRAIN_ARG(std::string, prefix, "checkpoint")
};

class CheckpointManager {
 public:
  // Rank 0 creates `dir` if needed (the error names it) at the first save().
  explicit CheckpointManager(std::string dir, CheckpointOptions options = CheckpointOptions());

  // Collective. Returns the path written. Throws dtrain::Error on every rank if rank 0 fails.
  std::string save(const TrainingState& state);
  // Collective. The same checkpoint as save(), written in the background (Note [Asynchronous saves]):
  // returns once the state is copied in host memory, and training goes on while a thread serializes
  // and writes it. The next save(), save_async(), wait() or load_latest() first waits for it; if it
  // failed, that call throws on every rank, naming the file and the reason. A crash or kill during
  // the write leaves the previous checkpoints as they were, the latest for load_latest. Staged: the
  // model's parameters and buffers (as Module::save writes them) and the state of LibTorch's Adam,
  // AdamW, SGD, Adagrad and RMSprop (or a ZeroRedundancyOptimizer's); another optimizer's archive is
  // serialized before returning. A sharded model: every rank stages its chunks (dcp::get_state_dict's
  // tensors) and writes its part of the DCP folder on its own thread; the folder's metadata and the
  // main file are written by the next call (a collective), so call wait() on every rank before the
  // manager goes: its destructor cannot, and a save it did not finish is then not a checkpoint.
  std::string save_async(const TrainingState& state);
  // Collective: waits for the last save_async(); throws on every rank if it failed.
  void wait();
  // Waits for a save_async() still writing; a failure is then a warning (a destructor cannot throw,
  // nor run a collective).
  ~CheckpointManager();
  CheckpointManager(const CheckpointManager&) = delete;
  CheckpointManager& operator=(const CheckpointManager&) = delete;
  // Collective. The path restored, or std::nullopt when the folder holds no checkpoint.
  std::optional<std::string> load_latest(TrainingState& state);
  // This process's view of the folder: checkpoint paths, oldest write first (the last is the latest).
  std::vector<std::string> list() const;

  const std::string& dir() const { return dir_; }
  const CheckpointOptions& options() const { return options_; }

 private:
  std::string save_impl(const TrainingState& state, bool background);
  void stage_and_write(const std::string& path, const TrainingState& state, const std::vector<std::string>& packs);
  std::string start_sharded_async(const std::string& path, const TrainingState& state,
                                  const std::vector<std::string>& packs, const std::string& manifest);
  void finish_sharded_async();  // collective
  void finish_async();          // collective when a save_async() is outstanding

  std::string dir_;
  CheckpointOptions options_;
  bool async_outstanding_ = false;                 // every rank: a save_async() whose outcome is not told yet
  std::unique_ptr<ckpt::BackgroundWrite> writer_;  // rank 0 (every rank for a sharded model)
  std::unique_ptr<ckpt::StagingPool> staging_;     // rank 0 (every rank for a sharded model): the copies
  std::shared_ptr<ckpt::PendingShardedSave> sharded_pending_;  // a sharded model's save_async, to finish
};

// Single-process building blocks (no collectives; the RNG states and values are this process's).
// save_checkpoint writes atomically as step 2 above; load_checkpoint throws dtrain::Error naming the
// file for a bad header, a wrong length (truncated), a CRC mismatch (corrupt) or a model mismatch.
void save_checkpoint(const std::string& path, const TrainingState& state);
void load_checkpoint(const std::string& path, TrainingState& state);

}  // namespace dtrain
