// PyTorch's distributed checkpoint format (torch.distributed.checkpoint, "DCP"): save and load a
// state dict as a folder that Python's dcp.load reads on any world size, and read what Python's
// dcp.save wrote, onto any world size.
//
//   auto sd = dtrain::dcp::get_state_dict(*model, &optimizer);   // keys as PyTorch's get_state_dict
//   dtrain::dcp::save(sd, "/ckpt/step_100");                       // collective: every rank writes its part
//   ...
//   auto sd = dtrain::dcp::get_state_dict(*model, &optimizer);   // the same on the loading side
//   dtrain::dcp::load(sd, "/ckpt/step_100");                       // fills sd's tensors in place
//   dtrain::dcp::set_state_dict(*model, &optimizer, sd);          // steps and hyperparameters
//
// and in Python, with a model and optimizer of the same architecture:
//   msd, osd = get_state_dict(model, optim)
//   sd = {"model": msd, "optim": osd}; dcp.load(sd, checkpoint_id="/ckpt/step_100")
//   set_state_dict(model, optim, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
//
// The folder (DCP's FileSystemWriter layout): `.metadata`, a pickle of DCP's Metadata (every key's
// shape, dtype and chunks, and where each stored item is), and `__<rank>_0.distcp` per rank that
// stored something, each item in it a torch.save archive. Steps of save() (a collective over
// `process_group`):
//   1. Rank 0 removes an old `.metadata`, so that a save that fails half-way leaves a folder no load
//      takes for a checkpoint, never one whose metadata points into files of another save.
//   2. Every rank's plan (its keys, chunks, shapes, dtypes) is gathered on every rank, and each item
//      held by several ranks (a replicated tensor, a value, rows of an HSDP replica) is given to one
//      of them, the one with the fewest bytes so far (as DCP's deduplication): written once.
//      Ranks that disagree on a key's whole shape or dtype fail here, on every rank, naming it.
//   3. Every rank writes its items to its own file (a temporary name, fsync, rename), then rank 0
//      writes `.metadata` the same way, last: the checkpoint exists once it is complete.
//   4. The outcome is shared: a failure on any rank throws the same dtrain::Error on every rank,
//      naming the rank and the file.
// load() reads `.metadata` on every rank, checks every key of `state_dict` first (present, same
// whole shape; a missing key or a shape that differs throws before anything changed, naming both),
// then fills each tensor in place from the stored chunks that overlap it (any world size, any
// chunking) and replaces each value. Keys in the checkpoint that `state_dict` lacks are ignored, as
// DCP's planner does. What a load detects, each as one dtrain::Error naming the file: a missing or
// malformed `.metadata`; an item file that is missing or shorter than `.metadata` says; an item
// whose bytes changed after the save (every zip entry's CRC-32 is checked, which LibTorch's reader
// and Python's dcp.load skip); an item that is not a torch.save archive or not a tensor of the
// recorded sizes. A change that keeps the archive's CRC-32s consistent (a file rewritten on purpose)
// is not detected: load only folders you trust.
//
// Keys (get_state_dict) are PyTorch's: "model.<parameter or buffer name>", and for the optimizer
// "optim.state.<parameter name>.<state name>" (Adam's exp_avg, exp_avg_sq, step, max_exp_avg_sq;
// SGD's momentum_buffer) and "optim.param_groups.<i>.<option>" (lr, betas, eps, weight_decay, ..., and
// params: the names of the group's parameters), with the options Python's optimizer of the same
// kind expects. A sharded parameter and its optimizer state are the box of the whole this rank
// holds, as its ShardSpec says (dtrain/shard_spec.h), written as a chunk at those offsets, as a
// DTensor's: fully_shard's rows (FSDP2's Shard(0)), a tensor-parallel part (Shard(0) / Shard(1)),
// or, for tensor parallelism inside fully_shard (2-D), fully_shard's rows of TP's part: the offsets
// add up per dimension (a Colwise weight of 16 rows on {dp 2, tp 2}: rank (d, t) holds rows
// 8 t + 4 d .. + 4; a Rowwise one's rows 4 d .. + 4 of columns 8 t .. + 8), which PyTorch's dcp.load
// reads into its model parallelized the same way (parallelize_module on mesh["tp"], then
// fully_shard on mesh["dp"]) or any other layout. A ZeroRedundancyOptimizer's state is its owner's
// alone; a DDP model's parameters are whole on every rank and written once. get_state_dict refuses
// a fully_shard unit gathered right now (between forward and backward): save between steps.
#pragma once

#include <cstdint>
#include <string>
#include <variant>
#include <vector>

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>

#include "dtrain/process_group.h"

namespace torch::nn {
class Module;
}
namespace torch::optim {
class Optimizer;
}

namespace dtrain::dcp {

// A key as a path in the nested state dict: {"optim", "param_groups", 0, "lr"} is the flat key
// "optim.param_groups.0.lr" (list indices are integers).
using Path = std::vector<std::variant<std::string, int64_t>>;
std::string flat_key(const Path& path);

// One entry: a tensor (whole, or this rank's chunk of a larger tensor) or another value.
struct Entry {
  Path path;
  at::Tensor tensor;                  // defined: a tensor entry
  std::vector<int64_t> global_shape;  // a chunk: the whole tensor's shape; empty: `tensor` is whole
  std::vector<int64_t> offsets;       // a chunk: where it starts in the whole, per dimension
  c10::IValue value;                  // a value entry (double, int, bool, string, None, tuples, lists)

  static Entry whole(Path path, at::Tensor tensor);
  static Entry chunk(Path path, at::Tensor tensor, std::vector<int64_t> global_shape, std::vector<int64_t> offsets);
  static Entry of_value(Path path, c10::IValue value);
  bool is_tensor() const { return tensor.defined(); }
  std::string key() const { return flat_key(path); }
};
using StateDict = std::vector<Entry>;

// The model's parameters and buffers under "model.", and (with an optimizer: torch::optim::Adam,
// AdamW, SGD, or a ZeroRedundancyOptimizer over one of those) its state and groups under "optim.".
// Tensors are the model's and the optimizer's own (load() writes into them); an optimizer that has
// not stepped yet gets its zero state first, as PyTorch's get_state_dict does.
StateDict get_state_dict(torch::nn::Module& model, torch::optim::Optimizer* optimizer = nullptr);
// After load(): puts the loaded steps and hyperparameters into the optimizer (the tensors are
// already in place). Throws naming a value of the wrong type.
void set_state_dict(torch::nn::Module& model, torch::optim::Optimizer* optimizer, const StateDict& state_dict);

// Collective over `process_group`: every member calls them with its own state dict.
void save(const StateDict& state_dict, const std::string& dir, const Group& process_group = Group());
void load(StateDict& state_dict, const std::string& dir, const Group& process_group = Group());

}  // namespace dtrain::dcp
