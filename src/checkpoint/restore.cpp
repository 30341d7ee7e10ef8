// Reading a checkpoint's archive back into a TrainingState: its format checks, the model's manifest
// check, and the all-or-nothing restore (steps in include/dtrain/checkpoint.h; the layout in
// docs/design.md, "Checkpoint files"). checkpoint.cpp writes the archive and runs the collectives.
#include "checkpoint/restore.h"

#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <algorithm>
#include <map>
#include <string>
#include <vector>

#include "checkpoint/rank_state.h"
#include "checkpoint/rollback.h"
#include "checkpoint/sharded.h"
#include "common/util.h"
#include "dtrain/amp.h"
#include "dtrain/errors.h"
#include "dtrain/sampler.h"
#include "optim/state_device.h"

namespace dtrain::ckpt {

namespace {

// A part of a model (TrainingState::model_part) against the saved manifest: each of its tensors must
// be there alike; the checkpoint may hold more (the other ranks' parts), as DCP loads by name.
void check_part_manifest(const std::vector<std::pair<std::string, std::string>>& saved,
                         const std::vector<std::pair<std::string, std::string>>& mine, const std::string& head,
                         const std::string& tail) {
  std::map<std::string, std::string> by_name(saved.begin(), saved.end());
  for (const auto& [name, desc] : mine) {
    auto it = by_name.find(name);
    if (it == by_name.end()) throw Error(head + "the model's tensor '" + name + "' is not in the checkpoint" + tail);
    if (it->second != desc)
      throw Error(head + "tensor '" + name + "' is " + it->second + " in the checkpoint but " + desc + " in the model" +
                  tail);
  }
}

// The saved manifest against the model's (manifest_text in checkpoint.cpp writes it): the first
// tensor that differs is the error, before anything is loaded.
void check_manifest(const std::string& saved_text, const torch::nn::Module& model, const std::string& file, bool part) {
  std::vector<std::pair<std::string, std::string>> saved;
  for (const std::string& line : util::split(saved_text)) {
    const size_t sp = line.find(' ');
    saved.emplace_back(line.substr(0, sp), sp == std::string::npos ? "" : line.substr(sp + 1));
  }
  const auto mine = ckpt::whole_manifest(model);
  const std::string head = "checkpoint " + file + " does not match the model: ";
  const std::string tail =
      " (a checkpoint of a different model? use another checkpoint folder or build the same model)";
  if (part) return check_part_manifest(saved, mine, head, tail);
  for (size_t i = 0; i < std::max(saved.size(), mine.size()); ++i) {
    if (i >= saved.size())
      throw Error(head + "the model's tensor '" + mine[i].first + "' is not in the checkpoint" + tail);
    if (i >= mine.size())
      throw Error(head + "the checkpoint's tensor '" + saved[i].first + "' is not in the model" + tail);
    if (saved[i].first != mine[i].first)
      throw Error(head + "tensor #" + std::to_string(i) + " is '" + saved[i].first + "' in the checkpoint but '" +
                  mine[i].first + "' in the model" + tail);
    if (saved[i].second != mine[i].second)
      throw Error(head + "tensor '" + mine[i].first + "' is " + saved[i].second + " in the checkpoint but " +
                  mine[i].second + " in the model" + tail);
  }
}

std::string tensor_bytes(const at::Tensor& t) {
  const at::Tensor c = t.cpu().contiguous();
  return std::string(static_cast<const char*>(c.data_ptr()), c.numel());
}

int64_t read_int(torch::serialize::InputArchive& a, const char* key) {
  c10::IValue v;
  a.read(key, v);
  return v.toInt();
}

}  // namespace

// Parses the payload into `a` and checks its version; throws with the reason (no file name).
// Every tensor is read onto the CPU, and restore_all puts each where its model's or optimizer's
// tensor is: rank 0 saved its own GPU's tensors, which every rank must get on its own device, and
// LibTorch's Optimizer::load faults on an archive read onto a GPU (optim/state_device.h).
void parse(const std::string& payload, torch::serialize::InputArchive& a) {
  try {
    a = optim_state::parse_on_cpu(payload);
  } catch (const c10::Error& e) {
    throw Error("its archive does not parse: " + std::string(e.what_without_backtrace()).substr(0, 200));
  }
  c10::IValue v;
  DTRAIN_CHECK(a.try_read("version", v) && v.isInt(), "its archive has no format version");
  DTRAIN_CHECK(v.toInt() >= 1 && v.toInt() <= kCheckpointFormatVersion, "its archive has format version ", v.toInt(),
               " (this dtrain reads versions 1 to ", kCheckpointFormatVersion, ")");
}

// Why this dtrain does not read a parsed archive ("" when it does): a sharded model saved in the
// retired format of a shard file per rank (versions 2 and 3, and 1 with shard records), which its
// dtrain (2026-12-05 and older) still reads and can turn into a whole checkpoint.
std::string retired_format(torch::serialize::InputArchive& a, const std::string& file) {
  c10::IValue v, shards;
  a.try_read("version", v);
  if (v.toInt() != 2 && v.toInt() != 3 && !a.try_read("shards", shards)) return "";
  return detail::cat("checkpoint ", file, " holds a sharded model in format version ", v.toInt(),
                     " (a shard file per rank), which this dtrain no longer reads: load it with a dtrain of "
                     "2026-12-05 or older into the model without fully_shard or parallelize_module, save that with "
                     "save_checkpoint, and load the file into this dtrain's model before sharding it");
}

namespace {

// Module::load from an archive read onto the CPU, each parameter and buffer then back on the device
// it was on. Module::load swaps a tensor of another device in with set_data, which keeps its
// identity: the optimizer's references to the parameters stay valid, and so they do here.
void load_in_place(torch::nn::Module& model, torch::serialize::InputArchive& archive) {
  std::vector<at::Tensor> tensors = model.parameters();
  for (const at::Tensor& b : model.buffers()) tensors.push_back(b);
  std::vector<at::Device> devices;
  for (const at::Tensor& t : tensors) devices.push_back(t.device());
  model.load(archive);
  at::NoGradGuard no_grad;
  for (size_t i = 0; i < tensors.size(); ++i)
    if (tensors[i].device() != devices[i]) tensors[i].set_data(tensors[i].to(devices[i]));
}

// Restores `st` from a parsed archive as this process of rank `my_rank` (Note [Resharded epoch] when
// the saved world differs).
// The checks of restore_all before anything changes: the model's manifest, the members asked for, and
// every saved rank's pack.
std::vector<std::string> check_and_read_packs(torch::serialize::InputArchive& a, TrainingState& st,
                                              const std::string& file) {
  if (st.model) {
    c10::IValue manifest;
    DTRAIN_CHECK(a.try_read("model_manifest", manifest), "checkpoint ", file,
                 " holds no model: it was saved without one; leave TrainingState::model null");
    check_manifest(manifest.toStringRef(), *st.model, file, st.model_part);
  }
  c10::IValue in_dcp;
  if (st.optimizer && a.try_read("dcp_optimizer", in_dcp)) {
    DTRAIN_CHECK(in_dcp.toBool(), "checkpoint ", file,
                 " holds no optimizer state: it was saved without one; leave that member of TrainingState null");
    DTRAIN_CHECK(st.model, "checkpoint ", file,
                 " keeps the optimizer's state with its sharded model: set TrainingState::model too");
  }
  const int64_t world = read_int(a, "world_size");
  DTRAIN_CHECK(world >= 1, "checkpoint ", file, " has world_size ", world);
  // The file's number sizes nothing: the ranks' states are read while there are, so a damaged or
  // hostile world_size costs no more than the states the file holds.
  std::vector<std::string> packs;
  for (int64_t r = 0; r < world; ++r) {
    at::Tensor pack;
    DTRAIN_CHECK(a.try_read("rank_state_" + std::to_string(r), pack, /*is_buffer=*/true), "checkpoint ", file,
                 " lacks the state of rank ", r, " of its world_size ", world);
    packs.push_back(tensor_bytes(pack));
  }
  return packs;
}

void restore_all(torch::serialize::InputArchive& a, TrainingState& st, const std::string& file, int my_rank) {
  auto sub = [&](const char* key, torch::serialize::InputArchive& out) {
    DTRAIN_CHECK(a.try_read(key, out), "checkpoint ", file, " holds no ", key,
                 " state: it was saved without one; leave that member of TrainingState null");
  };
  c10::IValue record;
  const bool sharded = a.try_read("dcp", record);
  // The model first, checked before anything changes. A sharded model's load is a collective: a
  // check failed here is told to every rank there, so that none waits for this one.
  std::vector<std::string> packs;
  std::string failure;
  try {
    packs = check_and_read_packs(a, st, file);
  } catch (const std::exception& e) {
    if (!(sharded && st.model)) throw;
    failure = util::one_line(e.what());
  }
  const auto world = static_cast<int64_t>(packs.size());
  if (st.model && sharded) {
    ckpt::load_sharded(file, record.toStringRef(), st, failure);  // the optimizer's state too
  } else if (st.model) {
    DTRAIN_CHECK(!st.model_part, "checkpoint ", file,
                 " holds a whole model in one archive, which a part of a model (TrainingState::model_part) cannot "
                 "load: resume from a checkpoint of the parts, or of a sharded model (a DCP folder)");
    DTRAIN_CHECK(!ckpt::holds_shards(st.model), "checkpoint ", file,
                 " holds a whole model, saved without fully_shard or parallelize_module: load it into the model "
                 "before sharding it (whose shards then come from it), or resume from a checkpoint of the sharded "
                 "model");
    torch::serialize::InputArchive m;
    sub("model", m);
    load_in_place(*st.model, m);
  }
  // A sharded optimizer (ShardedOptimizerState) keeps this world's share of the whole state it
  // reads: resharded as is.
  if (st.optimizer && !(st.model && sharded)) {
    torch::serialize::InputArchive o;
    sub("optimizer", o);
    optim_state::load_onto_param_devices(*st.optimizer, o);
  }
  if (st.scaler && st.scaler->is_enabled()) {
    torch::serialize::InputArchive s;
    sub("scaler", s);
    st.scaler->load(s);
  }
  if (st.sampler) {
    torch::serialize::InputArchive s;
    sub("sampler", s);
    c10::IValue v;
    std::vector<int64_t> positions;
    if (a.try_read("sampler_positions", v)) positions = v.toIntVector();  // absent before resharding
    const auto replicas = static_cast<size_t>(st.sampler->num_replicas());
    if (!positions.empty() && positions.size() != replicas) {
      // Note [Resharded epoch]: the rest of the epoch is split over this world.
      for (size_t r = 0; r < positions.size(); ++r)
        DTRAIN_CHECK(positions[r] >= 0, "checkpoint ", file, " lacks the sampler position of rank ", r, " of ",
                     positions.size(), ": load it on ", positions.size(), " ranks");
      st.sampler->load_resharded(s, positions);
      st.sampler_position = 0;
    } else {
      st.sampler->load(s);
      const auto mine = static_cast<size_t>(st.sampler->rank());
      st.sampler_position =
          mine < positions.size() && positions[mine] >= 0 ? positions[mine] : read_int(a, "sampler_position");
      st.sampler->resume_at(static_cast<size_t>(st.sampler_position));
    }
  }
  st.step = read_int(a, "step");
  st.epoch = read_int(a, "epoch");
  // RNG and values: rank r < world takes rank r's; a rank beyond the saved world has none of its
  // own (Note [Resharded epoch] in dtrain/sampler.h, RNG in dtrain/checkpoint.h).
  st.saved_world_size = world;
  st.saved_values.clear();
  for (const std::string& pack : packs) st.saved_values.push_back(ckpt::read_rank_state(pack).values);
  if (my_rank < world) {
    st.values = st.saved_values[static_cast<size_t>(my_rank)];
    if (st.rng) ckpt::restore_rng(packs[static_cast<size_t>(my_rank)]);
  } else {
    warn_once("checkpoint-world",
              detail::cat("checkpoint ", file, " was saved by ", world, " ranks: rank ", my_rank,
                          " has no saved state: its RNG is seeded from rank 0's and its values start empty"));
    st.values.clear();
    if (st.rng) ckpt::derive_rng(packs[0], my_rank);
  }
}

}  // namespace

// restore_all, all or nothing: a checkpoint that fails half-way (a member it lacks, an optimizer
// state of another shape) leaves `st` as it was.
void restore(torch::serialize::InputArchive& a, TrainingState& st, const std::string& file, int my_rank) {
  const ckpt::Rollback before(st);
  try {
    restore_all(a, st, file, my_rank);
  } catch (...) {
    before.put_back(st);
    throw;
  }
}

}  // namespace dtrain::ckpt
