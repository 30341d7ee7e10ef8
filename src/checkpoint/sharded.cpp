// Sharded checkpoints through DCP (see sharded.h).
#include "checkpoint/sharded.h"

#include <torch/nn/module.h>
#include <torch/optim/sgd.h>

#include <filesystem>
#include <optional>
#include <set>
#include <sstream>
#include <unordered_map>

#include "checkpoint/agree.h"
#include "checkpoint/dcp_metadata.h"
#include "checkpoint/file_io.h"
#include "checkpoint/staging.h"
#include "checkpoint/frame.h"
#include "common/util.h"
#include "compat/optim_compat.h"
#include "dtrain/dcp.h"
#include "dtrain/errors.h"
#include "dtrain/process_group.h"
#include "dtrain/shard_spec.h"

// Note [Sharded checkpoints]: a sharded model is on no rank whole, and gathering it to one rank to
// write it would need the memory sharding saves. So every rank writes what it holds, through the one
// engine that describes any sharding: DCP (dtrain/dcp.h). The model's and optimizer's state, under
// PyTorch's keys, each parameter as the chunk this rank holds of it (its ShardSpec's box), goes to a
// DCP folder beside the main file, <prefix>_<step>.dcp/, where every rank writes its items and rank 0
// the folder's `.metadata` last. Then rank 0 writes the main file, as for any checkpoint, with what
// DCP does not hold (RNG packs, sampler, scaler, step, values) and the record of the folder: its
// `.metadata`'s length and CRC-32. So:
//   - a save killed at any point leaves no main file naming a half-written folder: the latest
//     checkpoint is the previous one;
//   - a later save of the same step that failed half-way rewrote the folder (dcp::save first removes
//     its `.metadata`): the main file's record no longer matches, the checkpoint is unusable, and
//     load_latest falls back to the previous one, never mixing two saves;
//   - a load reshards by DCP's chunks, onto any world, any sharding of the same model (fully_shard,
//     tensor parallelism, both, over any groups) or none, and Python's dcp.load reads the folder;
//   - every rank must see the folder: on several nodes it must be one they share.

namespace dtrain::ckpt {

namespace fs = std::filesystem;

namespace {

std::string describe(at::ScalarType dtype, at::IntArrayRef shape) {
  std::ostringstream s;
  s << dtype << " " << shape;
  return s.str();
}

// The spec of a parameter no rank holds whole, or none.
std::optional<ShardSpec> sharded_spec(const at::Tensor& param) {
  auto spec = shard_spec_of(param);
  if (spec && !spec->is_sharded()) spec.reset();
  return spec;
}

bool many_ranks() { return is_initialized() && world_size() > 1; }

std::string metadata_record(const std::string& folder) {
  const std::string bytes = util::read_file(folder + "/.metadata", "checkpoint metadata");
  char crc[9];
  std::snprintf(crc, sizeof crc, "%08x", crc32_of(bytes));
  return detail::cat(fs::path(folder).filename().string(), " ", bytes.size(), " ", crc);
}

// The names of the parameters this rank holds sharded, one per line.
std::string sharded_names(const torch::nn::Module& model) {
  std::string out;
  for (const auto& kv : model.named_parameters())
    if (sharded_spec(kv.value())) out += kv.key() + "\n";
  return out;
}

// Every rank shards the same parameters (each over its own group): else a parameter one rank holds
// whole and another in part would be stored twice over, chunks that overlap, which no load could
// read. Throws alike on every rank, naming the first that differs.
void check_same_shards(const torch::nn::Module& model) {
  if (!many_ranks()) return;
  const std::vector<std::string> all = all_gather_bytes(sharded_names(model));
  for (size_t r = 1; r < all.size(); ++r) {
    if (all[r] == all[0]) continue;
    const std::vector<std::string> a = util::split(all[0]), b = util::split(all[r]);
    throw Error(detail::cat("CheckpointManager::save: the sharded parameters of rank ", r, " (", b.size(),
                            ") are not those of rank 0 (", a.size(),
                            "): every rank must fully_shard the same modules of the same model, each over its own "
                            "group"));
  }
}

// An SGD with momentum makes a parameter's momentum buffer at its first step, and get_state_dict
// lists only the buffers there are: before a load, every buffer the checkpoint holds and the
// optimizer lacks is made (zero; the load fills it), as PyTorch's set_state_dict makes the states
// by a step of zero gradients. Without it a resume before the first step would drop the momentum.
void make_saved_momentum(const TrainingState& st, const std::string& folder) {
  if (!st.optimizer) return;
  const dcp::detail::Metadata saved =
      dcp::detail::decode(util::read_file(folder + "/.metadata", "checkpoint metadata"));
  std::unordered_map<const c10::TensorImpl*, std::string> names;
  for (const auto& kv : st.model->named_parameters()) names[kv.value().unsafeGetTensorImpl()] = kv.key();
  for (auto& group : st.optimizer->param_groups()) {
    if (!dynamic_cast<torch::optim::SGDOptions*>(&group.options())) continue;
    for (const at::Tensor& p : group.params()) {
      auto it = names.find(p.unsafeGetTensorImpl());
      const auto key = compat::optimizer_state_key(p);
      if (it == names.end() || st.optimizer->state().count(key) ||
          !saved.tensors.count("optim.state." + it->second + ".momentum_buffer"))
        continue;
      auto state = std::make_unique<torch::optim::SGDParamState>();
      state->momentum_buffer(at::zeros_like(p, at::MemoryFormat::Preserve));
      st.optimizer->state()[key] = std::move(state);
    }
  }
}

}  // namespace

bool holds_shards(const torch::nn::Module* model) {
  if (!model) return false;
  for (const auto& kv : model->named_parameters())
    if (sharded_spec(kv.value())) return true;
  return false;
}

std::vector<std::pair<std::string, std::string>> whole_manifest(const torch::nn::Module& model) {
  std::vector<std::pair<std::string, std::string>> out;
  for (const auto& p : model.named_parameters()) {
    const auto spec = sharded_spec(p.value());
    out.emplace_back(p.key(),
                     describe(p.value().scalar_type(), spec ? at::IntArrayRef(spec->full_shape()) : p.value().sizes()));
  }
  for (const auto& b : model.named_buffers())
    out.emplace_back(b.key(), describe(b.value().scalar_type(), b.value().sizes()));
  return out;
}

std::string dcp_folder(const std::string& main_path) {
  return main_path.substr(0, main_path.size() - 3) + ".dcp";  // without ".pt"
}

std::shared_ptr<dcp::detail::SaveInProgress> begin_sharded_save(const std::string& main_path, const TrainingState& st,
                                                                StagingPool* staging) {
  // A model cut into parts (pipeline stages) shards different parameters on each rank by design.
  if (!st.model_part) check_same_shards(*st.model);
  dcp::StateDict sd;
  throw_first_failure(failure_of([&] {
    sd = dcp::get_state_dict(*st.model, st.optimizer);
    if (staging)
      for (dcp::Entry& e : sd)
        if (e.is_tensor()) e.tensor = staging->copy_of(e.tensor);
  }));
  return std::make_shared<dcp::detail::SaveInProgress>(std::move(sd), dcp_folder(main_path), Group());
}

std::string finish_sharded_save(dcp::detail::SaveInProgress& save) {
  save.finish();  // throws alike on every rank
  // Rank 0's record of the folder, on every rank.
  std::string record;
  if (!is_initialized() || rank() == 0) {
    std::string mine;
    const std::string error = failure_of([&] { mine = metadata_record(save.dir()); });
    record = error.empty() ? "ok " + mine : error;
  }
  if (many_ranks()) record = broadcast_bytes(record, 0);
  DTRAIN_CHECK(record.rfind("ok ", 0) == 0, "cannot read back the metadata of ", save.dir(), ": ", record);
  return record.substr(3);
}

std::string check_folder(const std::string& main_path, const std::string& record) {
  const std::string folder = dcp_folder(main_path);
  std::string now;
  const std::string error = failure_of([&] { now = metadata_record(folder); });
  if (!error.empty()) return "its model folder " + folder + " is unusable: " + error;
  if (now != record)
    return "its model folder " + folder +
           " was rewritten after it (by a later save of the same step that did not "
           "finish?): its .metadata is '" +
           now + "', the checkpoint's '" + record + "'";
  return "";
}

void load_sharded(const std::string& main_path, const std::string& record, TrainingState& st,
                  const std::string& failure) {
  dcp::StateDict sd;
  std::string mine = failure;
  if (mine.empty())
    mine = failure_of([&] {
      const std::string why = check_folder(main_path, record);
      DTRAIN_CHECK(why.empty(), "checkpoint ", main_path, ": ", why);
      make_saved_momentum(st, dcp_folder(main_path));
      sd = dcp::get_state_dict(*st.model, st.optimizer);
    });
  throw_first_failure(mine);
  dcp::load(sd, dcp_folder(main_path));  // all or nothing on every rank
  dcp::set_state_dict(*st.model, st.optimizer, sd);
}

void remove_folders_except(const std::string& dir, const std::string& prefix, const std::vector<std::string>& keep) {
  std::set<std::string> kept;  // <prefix>_<10 digits>
  for (const std::string& k : keep) kept.insert(fs::path(k).filename().string().substr(0, prefix.size() + 11));
  const std::string head = prefix + "_";
  std::error_code ec;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (name.size() <= head.size() + 10 || name.compare(0, head.size(), head) != 0) continue;
    const std::string stem = name.substr(0, head.size() + 10), rest = name.substr(stem.size());
    if (!util::is_digits(stem.substr(head.size())) || kept.count(stem)) continue;
    // Its DCP folder; and the shard files of a checkpoint of the retired per-rank format, which
    // rotation removes with their main file.
    const bool shard_file = rest.rfind(".shard", 0) == 0 && rest.size() > 3 && rest.substr(rest.size() - 3) == ".pt";
    std::error_code rm;
    if (rest == ".dcp")
      fs::remove_all(it->path(), rm);
    else if (shard_file)
      fs::remove(it->path(), rm);
  }
}

}  // namespace dtrain::ckpt
