// Checkpoints for exact resume: model, optimizer, GradScaler, sampler epoch and position, RNG states,
// step count and user values, written atomically by rank 0 and loaded by every rank.
//
//   dtrain::TrainingState st;                       // what to save and restore (null: left out)
//   st.model = ddp.module().get();  st.optimizer = &opt;  st.scaler = &scaler;  st.sampler = &sampler;
//   dtrain::CheckpointManager ckpt("/ckpt");        // keeps the newest 2 (CheckpointOptions().keep(k))
//   if (auto path = ckpt.load_latest(st)) { ... }   // every rank; st.step/epoch/values are restored
//   for (...) {                                     // train; keep st.step (and the rest) current
//     if (st.step % 100 == 0) ckpt.save(st);        // every rank calls it; rank 0 writes
//   }
//
// Steps of CheckpointManager::save() (a collective: every rank calls it):
//   1. Every rank packs its own RNG states (the default CPU generator; the current CUDA device's
//      when CUDA is available), st.values and its sampler rank and position; a gather gives rank 0
//      every rank's pack.
//   2. Rank 0 serializes one torch archive (the layout below) and writes
//      <dir>/<prefix>_<step, 10 digits>.pt atomically: a temporary file in the same folder, write,
//      fsync, rename over the name, fsync the folder. The previous checkpoints are untouched until
//      the new one is complete; then all but the newest `keep` writes are deleted, the new one never.
//   3. Rank 0 broadcasts the outcome: a failure (unwritable folder, disk full) throws the same
//      dtrain::Error, naming the file and the reason, on every rank, and leaves the older files intact.
// Steps of load_latest() (a collective too):
//   1. Rank 0 lists <dir>/<prefix>_*.pt and tries them newest write first: a file whose length or
//      CRC-32 is wrong, or whose archive does not parse, gives "dtrain warning: checkpoint <file> is
//      unusable (<reason>); falling back to the previous one" and the next older one is tried (one
//      whose header line cannot be read: "...; ignored", never tried).
// Which checkpoint is the latest (Note [Write order] in src/checkpoint/checkpoint.cpp): the most
// recently written, not the highest step. A run restarted from step 100 that saved step 150 resumes
// at its own 150, not at a step 300 an abandoned run left in the folder; rotation keeps the newest
// writes likewise, so a save is never deleted by its own rotation. When files of a later step than
// the one saved or loaded are present, save() and load_latest() say so once per process
// ("dtrain warning: checkpoint folder <dir> holds <file> from the later step 300, written before this
// save of step 150 ..."; "dtrain warning: load_latest: resuming from <file>, the most recent write
// in <dir>, although <file> has the later step 300 ..."). Writes are ordered by a stamp in each
// header line (nanoseconds since the epoch, above every stamp already in the folder), not by mtime,
// which is whole seconds on some file systems; files of older dtrains (no stamp) come before any
// stamped one, by step. A file stamped more than a week ahead of this host's clock is unusable
// ("... (its write stamp <n> is more than a week ahead of this host's clock ...); ignored"): no
// writer made it, and it would stay the latest for good.
//   2. Rank 0 broadcasts the chosen file's bytes, so every rank restores the same checkpoint, also on
//      nodes that do not share the folder. No file: std::nullopt everywhere; files but none usable:
//      an error naming them.
//   3. Every rank checks the model first (names, shapes and dtypes of every parameter and buffer, in
//      order; the first mismatch is the error: "... tensor 'fc1.weight' is Float [128, 3136] in the
//      checkpoint but Float [64, 3136] in the model ..."), then restores model, optimizer, scaler, sampler
//      (epoch, and the position where the next pass over the epoch starts, for every copy of the
//      sampler, the DataLoader's too), its own RNG states and values, step and epoch. All or nothing:
//      a checkpoint that fails half-way (a member it lacks, an optimizer state of another shape)
//      leaves all of them as they were (a copy of what it changes is kept while it runs).
//
// File format (version 1; 2 for a sharded model over subgroups, below): one text line
//   "DTRAIN-CHECKPOINT <version> <payload bytes> <crc32 of the payload, 8 hex digits> <write stamp>\n"
// (older dtrains write no stamp, and skip it when reading), then the payload: a torch::serialize
// archive (zip) with the keys
//   version, step, epoch, world_size, model_manifest ("name dtype [shape]" per line), model,
//   optimizer, scaler, sampler, sampler_position (rank 0's), sampler_positions (one per sampler rank),
//   rank_state_<r> (uint8, one per rank); of a sharded model, model_replicated, shards (one
//   header line per shard file), shard_layouts (one line per shard file: "<group rank>/<group
//   size>*<parameters>" per run of parameters alike) and shard_names (the sharded parameters)
//   instead of model and optimizer. A sharded save over the world writes version 1, which dtrains
//   before subgroups read; one over subgroups version 2, which they refuse (they took world rank r's
//   file for rank r's rows of the world). This dtrain reads both, and sharded files without layouts
//   as of the world.
// Python reads it with torch.jit.load(io.BytesIO(data[data.index(b"\n") + 1:])).
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
// N = M is the exact resume above, unchanged.
//
// A fully_shard'ed model (dtrain/fsdp.h) is on no rank whole, and no rank gathers it to save it
// (Note [Sharded checkpoints] in src/checkpoint/sharded.cpp). save() then has every rank write, before
// rank 0 writes the main file, its own shard file beside it,
//   <dir>/<prefix>_<step, 10 digits>.shard<world rank>-of-<world size>.pt   (framed as the main file)
// with its rows of every sharded parameter (FSDP2's to_local(): torch.chunk of dim 0 over the group
// it is sharded over, the world or a subgroup) and its optimizer's state for them (any torch::optim
// optimizer built on the shards). Each file records which rows it holds: per parameter, its rank in
// that group and the group's size. The main file holds what every rank holds alike (buffers,
// parameters no unit holds, scaler, sampler, RNG packs) and each shard file's header line and
// layout, so a load reads the shards of that very save; a save where any rank fails leaves no main
// file and no shard of it (every rank throws, naming the rank), and rotation removes a checkpoint's
// shard files with it. Every rank takes part in save() and load_latest(), and the model must be
// fully_shard'ed on every rank or on none, over the same parameters (each rank over its own group:
// replica groups {0, 1} and {2, 3}, as HSDP's, are fine). load_latest() restores onto any world and
// group size, or into a model without fully_shard: each rank reads, by their recorded layouts, the
// shard files holding its rows (one file of the same group rank and size, its own first: the exact
// resume continues bit for bit; else pieces of the files overlapping its rows, one of several that
// hold the same rows), and the optimizer's state tensors of a shard's shape are resliced with them,
// its other values taken from one of the files read. Every rank must read the shard files: on several
// nodes the folder must be one they share. A missing or foreign shard fails the load on every rank
// before anything changed. A checkpoint of the whole model does not load into a sharded one: load it
// before fully_shard.
//
// A tensor-parallel model (parallelize_module, dtrain/tensor_parallel.h) is saved the same way: each
// rank's shard file holds its part of every sharded parameter and its optimizer's state for them,
// a part being a range of dim 0 (ColwiseParallel) or dim 1 (a RowwiseParallel Linear's weight)
// as PyTorch's Shard(0)/Shard(1) cut it; the layout records the dimension ("<rank>/<size>@1"),
// which makes the files format version 3. It loads back onto the same layout (the exact resume,
// optimizer state as saved), onto another tp size along the same dimensions, or into the unsharded
// model (each rank reads the parts it needs, its optimizer state resliced from them); not onto a
// model sharded along other dimensions. A parameter both tensor-parallel and fully_shard'ed (2-D)
// cannot be checkpointed yet. save_async saves a tensor-parallel model as save() does, as it does a
// fully_shard'ed one.
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
}  // namespace ckpt
class GradScaler;
class DistributedSampler;

// The newest file format this dtrain reads and writes; it reads every older one too. A file carries
// the lowest version that reads it: 3 for a sharded checkpoint with a parameter sharded along a
// dimension other than 0 (tensor parallelism: a Rowwise Linear's weight), 2 for one of a model sharded
// over subgroups (whose shard files record their group's rows), 1 for every other.
constexpr int kCheckpointFormatVersion = 3;

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
  // returns once rank 0 has copied the state in host memory, and training goes on while its thread
  // serializes and writes the file. The next save(), save_async(), wait() or load_latest() first
  // waits for it; if it failed, that call throws on every rank, naming the file and the reason. A
  // crash or kill during the write leaves the previous checkpoints as they were, the latest for
  // load_latest. Staged: the model's parameters and buffers (as Module::save writes them) and the
  // state of LibTorch's Adam, AdamW, SGD, Adagrad and RMSprop (or a ZeroRedundancyOptimizer's);
  // another optimizer's archive is serialized before returning, and a fully_shard'ed or
  // tensor-parallel model's checkpoint (each rank's shard file) is saved as save() does.
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
  void finish_async();  // collective when a save_async() is outstanding

  std::string dir_;
  CheckpointOptions options_;
  bool async_outstanding_ = false;                 // every rank: a save_async() whose outcome is not told yet
  std::unique_ptr<ckpt::BackgroundWrite> writer_;  // rank 0
  std::unique_ptr<ckpt::StagingPool> staging_;     // rank 0: the copies, reused from save to save
};

// Single-process building blocks (no collectives; the RNG states and values are this process's).
// save_checkpoint writes atomically as step 2 above; load_checkpoint throws dtrain::Error naming the
// file for a bad header, a wrong length (truncated), a CRC mismatch (corrupt) or a model mismatch.
void save_checkpoint(const std::string& path, const TrainingState& state);
void load_checkpoint(const std::string& path, TrainingState& state);

}  // namespace dtrain
