// Checkpoints: the archive layout, the model check, and the collective save/load of
// CheckpointManager (steps in include/dtrain/checkpoint.h); reading an archive back: restore.cpp.
#include "dtrain/checkpoint.h"

#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>
#include <torch/serialize/archive.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <map>
#include <optional>
#include <sstream>
#include <tuple>

#include "checkpoint/agree.h"
#include "checkpoint/file_io.h"
#include "checkpoint/staging.h"
#include "checkpoint/write_order.h"
#include "checkpoint/rank_state.h"
#include "checkpoint/restore.h"
#include "checkpoint/sharded.h"
#include "common/util.h"
#include "dtrain/amp.h"
#include "dtrain/errors.h"
#include "dtrain/process_group.h"
#include "dtrain/sampler.h"
#include "dtrain/sharded_optimizer.h"

namespace dtrain {

namespace fs = std::filesystem;
using ckpt::Found;
using ckpt::later_step;
using ckpt::next_write_stamp;
using ckpt::parse;
using ckpt::restore;
using ckpt::retired_format;
using ckpt::scan;

namespace {

// The manifest ("name dtype [d0, d1]" per parameter, then per buffer, in registration order: what
// Module::save writes, flattened; a sharded parameter by its whole shape) is compared before
// anything is loaded, so a checkpoint of another model is caught with the first tensor that differs
// instead of LibTorch's set_() silently taking any shape.
std::string manifest_text(const torch::nn::Module& model) {
  std::string s;
  for (const auto& [name, desc] : ckpt::whole_manifest(model)) s += name + " " + desc + "\n";
  return s;
}

at::Tensor bytes_tensor(const std::string& s) {
  at::Tensor t = at::empty({static_cast<int64_t>(s.size())}, at::kByte);
  if (!s.empty()) std::memcpy(t.data_ptr(), s.data(), s.size());
  return t;
}

int64_t sampler_position_of(const TrainingState& st) {
  return st.sampler_position >= 0 ? st.sampler_position : static_cast<int64_t>(st.sampler->position());
}

// This process's pack (save step 1).
std::string own_pack(const TrainingState& st) {
  ckpt::RankState rs;
  rs.values = st.values;
  if (st.sampler) {
    rs.sampler_rank = st.sampler->rank();
    rs.sampler_position = sampler_position_of(st);
  }
  return ckpt::pack_rank_state(st.rng, rs);
}

// The format version of a main file: 1, or 4 for a sharded model's (its model in a DCP folder).
int version_of(bool sharded) { return sharded ? kCheckpointFormatVersion : 1; }

// The payload (a torch archive) of `state`, with the per-rank packs of every rank; for a sharded model,
// the record of its DCP folder instead of the model and optimizer (Note [Sharded checkpoints]).
// `staged`: the model's tensors are copies from it (Note [Asynchronous saves]).
void fill_archive(torch::serialize::OutputArchive& a, const TrainingState& st,
                  const std::vector<std::string>& rank_packs, bool sharded, ckpt::StagingPool* staged,
                  const std::string& manifest) {
  a.write("version", c10::IValue(static_cast<int64_t>(version_of(sharded))));
  a.write("step", c10::IValue(st.step));
  a.write("epoch", c10::IValue(st.epoch));
  a.write("world_size", c10::IValue(static_cast<int64_t>(rank_packs.size())));
  if (st.model) {
    if (sharded) {  // its record ("dcp") is the caller's to write, once the folder is complete
      a.write("dcp_optimizer", c10::IValue(st.optimizer != nullptr));
    } else {
      torch::serialize::OutputArchive m;
      if (staged)
        ckpt::save_module_staged(*st.model, m, *staged);
      else
        st.model->save(m);
      a.write("model", m);
    }
    a.write("model_manifest", c10::IValue(manifest));
  }
  if (st.optimizer && !sharded) {  // a sharded model's: in its DCP folder
    torch::serialize::OutputArchive o;
    st.optimizer->save(o);
    a.write("optimizer", o);
  }
  if (st.scaler && st.scaler->is_enabled()) {  // a disabled scaler has no state (as PyTorch's)
    torch::serialize::OutputArchive s;
    st.scaler->save(s);
    a.write("scaler", s);
  }
  if (st.sampler) {
    torch::serialize::OutputArchive s;
    st.sampler->save(s);
    a.write("sampler", s);
    a.write("sampler_position", c10::IValue(sampler_position_of(st)));
    // Every sampler rank's position, so that another world size can reshard the epoch (Note
    // [Resharded epoch]); -1 for a sampler rank no process reported.
    std::vector<int64_t> positions(static_cast<size_t>(st.sampler->num_replicas()), -1);
    for (const std::string& pack : rank_packs) {
      const ckpt::RankState rs = ckpt::read_rank_state(pack);
      if (rs.sampler_rank >= 0 && rs.sampler_rank < st.sampler->num_replicas() && positions[rs.sampler_rank] < 0)
        positions[rs.sampler_rank] = rs.sampler_position;
    }
    a.write("sampler_positions", c10::IValue(positions));
  }
  for (size_t r = 0; r < rank_packs.size(); ++r)
    a.write("rank_state_" + std::to_string(r), bytes_tensor(rank_packs[r]), /*is_buffer=*/true);
}

std::string serialize(torch::serialize::OutputArchive& a) {
  std::ostringstream os;
  a.save_to(os);
  return os.str();
}

std::string encode(const TrainingState& st, const std::vector<std::string>& rank_packs, const std::string& manifest,
                   const std::string& dcp_record = "") {
  torch::serialize::OutputArchive a;
  fill_archive(a, st, rank_packs, !dcp_record.empty(), /*staged=*/nullptr, manifest);
  if (!dcp_record.empty()) a.write("dcp", c10::IValue(dcp_record));
  return serialize(a);
}

bool distributed() { return is_initialized() && world_size() > 1; }

// Rank 0's string on every rank (itself when not distributed).
std::string broadcast_string(const std::string& s) { return distributed() ? broadcast_bytes(s, 0) : s; }

// Every rank's pack on rank 0 (only rank 0 writes the file).
std::vector<std::string> gather_packs(const std::string& mine) {
  return distributed() ? gather_bytes(mine, 0) : std::vector<std::string>{mine};
}

// Step 2 of save() on rank 0, after the folder exists: write, then rotate (Note [Write order]).
void write_and_rotate(const std::string& dir, const CheckpointOptions& options, const std::string& path,
                      const std::string& payload, int64_t step, int version) {
  // Every rank's shard is written by now, so no write of this folder's checkpoints is under way:
  // what a save killed mid-write left goes.
  ckpt::sweep_temp_files(dir, options.prefix() + "_");
  const std::vector<Found> before = scan(dir, options.prefix());
  ckpt::write_atomic(path, ckpt::frame(payload, next_write_stamp(before), version));
  if (const Found* later = later_step(before, path, step))
    warn_once("checkpoint-later-step",
              detail::cat("checkpoint folder ", dir, " holds ", later->path, " from the later step ", later->step,
                          ", written before this save of step ", step,
                          " (a restarted run, or a step counter that went back?): the latest checkpoint is now this "
                          "one, the most recent write, which load_latest resumes from, and rotation (keep=",
                          options.keep(), ") removes the oldest writes first, whatever their steps"));
  // The newest `keep` writes stay; this one is the newest by its stamp, and never removed.
  const std::vector<Found> all = scan(dir, options.prefix());
  std::error_code ec;
  std::vector<std::string> kept;
  for (size_t i = 0; i < all.size(); ++i) {
    if (i + static_cast<size_t>(options.keep()) < all.size() && all[i].path != path)
      fs::remove(all[i].path, ec);
    else
      kept.push_back(all[i].path);
  }
  ckpt::remove_folders_except(dir, options.prefix(), kept);  // theirs, and those of failed saves
}

// Step 1 of load_latest() on rank 0: the most recent usable write (Note [Write order]). Its outcome
// line: "" (no file), "ok <path>" (its bytes in `framed`) or "error <msg>".
std::string pick_latest(const std::string& dir, const CheckpointOptions& options, std::string& framed) {
  const std::vector<Found> files = scan(dir, options.prefix());
  auto warn = [](const std::string& path, const std::string& why, const char* then) {
    dtrain::warn(detail::cat("checkpoint ", path, " is unusable (", util::one_line(why), "); ", then));
  };
  std::vector<const Found*> candidates;  // newest write first
  for (auto it = files.rbegin(); it != files.rend(); ++it) {
    if (it->stamp)
      candidates.push_back(&*it);
    else
      warn(it->path, it->why, "ignored");
  }
  for (size_t i = 0; i < candidates.size(); ++i) {
    const Found& c = *candidates[i];
    try {
      std::string f = util::read_file(c.path, "checkpoint file");
      torch::serialize::InputArchive probe;
      parse(ckpt::unframe(f), probe);  // checks that it parses, and that a sharded model's folder is its own
      // Never a silent fall back past it to an older checkpoint of the same run.
      if (const std::string retired = retired_format(probe, c.path); !retired.empty()) return "error " + retired;
      c10::IValue record;
      if (probe.try_read("dcp", record))
        if (const std::string why = ckpt::check_folder(c.path, record.toStringRef()); !why.empty()) throw Error(why);
      framed = std::move(f);
      const std::vector<Found> older(files.begin(), files.begin() + (candidates[i] - files.data()));
      if (const Found* later = later_step(older, c.path, c.step))
        warn_once("checkpoint-later-step-load",
                  detail::cat("load_latest: resuming from ", c.path, ", the most recent write in ", dir, ", although ",
                              later->path, " has the later step ", later->step,
                              ": it was written before (an abandoned run's?) and is ignored"));
      return "ok " + c.path;
    } catch (const std::exception& e) {
      warn(c.path, e.what(), i + 1 == candidates.size() ? "no older one is left" : "falling back to the previous one");
    }
  }
  if (files.empty()) return "";
  return "error none of the " + std::to_string(files.size()) + " checkpoint(s) in " + dir +
         " is usable (see the warnings above): remove them to start afresh, or restore a good copy";
}

}  // namespace

// --- single process ----------------------------------------------------------------------------------

void save_checkpoint(const std::string& path, const TrainingState& state) {
  DTRAIN_CHECK(!state.model_part, "save_checkpoint(", path,
               "): TrainingState::model_part is set, and this process holds only its part of the model: save it with "
               "CheckpointManager::save on every rank (each writes its part of a DCP folder)");
  DTRAIN_CHECK(!ckpt::holds_shards(state.model), "save_checkpoint(", path,
               "): the model is sharded (fully_shard or parallelize_module), and this process holds only its "
               "shards: save it with CheckpointManager::save on every rank (each writes its part of a DCP folder)");
  // Note [Write order]: stamped after the folder's files of the same name pattern, if it has one.
  const fs::path p(path);
  const std::string name = p.filename().string();
  std::vector<Found> found;
  const size_t us = name.rfind('_');
  if (us != std::string::npos && us > 0 && name.size() == us + 1 + 10 + 3)
    found = scan(p.has_parent_path() ? p.parent_path().string() : ".", name.substr(0, us));
  ckpt::sweep_temp_files(p.has_parent_path() ? p.parent_path().string() : ".", name);
  ckpt::write_atomic(path, ckpt::frame(encode(state, {own_pack(state)}, state.model ? manifest_text(*state.model) : ""),
                                       next_write_stamp(found)));
}

void load_checkpoint(const std::string& path, TrainingState& state) {
  std::string payload;
  try {
    payload = ckpt::unframe(util::read_file(path, "checkpoint file"));
  } catch (const Error& e) {
    throw Error("checkpoint " + path + " is unusable: " + e.what());
  }
  torch::serialize::InputArchive a;
  try {
    parse(payload, a);
  } catch (const Error& e) {
    throw Error("checkpoint " + path + " is unusable: " + e.what());
  }
  if (const std::string retired = retired_format(a, path); !retired.empty()) throw Error(retired);
  restore(a, state, path, is_initialized() ? rank() : 0);
}

// --- CheckpointManager -------------------------------------------------------------------------------

CheckpointManager::CheckpointManager(std::string dir, CheckpointOptions options)
    : dir_(std::move(dir)), options_(std::move(options)) {
  DTRAIN_CHECK(!dir_.empty(), "CheckpointManager: the checkpoint folder is empty: pass a folder path");
  DTRAIN_CHECK(options_.keep() >= 1, "CheckpointOptions: keep must be >= 1, got ", options_.keep());
  DTRAIN_CHECK(!options_.prefix().empty() && options_.prefix().find('/') == std::string::npos,
               "CheckpointOptions: prefix must be a non-empty file name without '/', got '", options_.prefix(), "'");
}

std::vector<std::string> CheckpointManager::list() const {
  std::vector<std::string> out;
  for (Found& f : scan(dir_, options_.prefix())) out.push_back(std::move(f.path));
  return out;
}

namespace {

// Whether the model is fully_shard'ed, which every rank must agree on: a rank whose model is not
// would skip the DCP folder's collectives that the others wait in (with fully_shard over subgroups,
// some ranks may have left their model whole). Throws alike on every rank when they differ.
bool sharded_everywhere(const TrainingState& st) {
  const bool mine = ckpt::holds_shards(st.model) || (st.model && st.model_part);
  if (!distributed()) return mine;
  const std::string flags = std::string(mine ? "1" : "0") + (st.model && st.model_part ? "p" : "w");
  const std::vector<std::string> all = all_gather_bytes(flags);
  for (size_t r = 1; r < all.size(); ++r) {
    DTRAIN_CHECK(all[r][1] == all[0][1], "CheckpointManager::save: TrainingState::model_part is ",
                 all[r][1] == 'p' ? "set" : "not set", " on rank ", r, " but ", all[0][1] == 'p' ? "set" : "not set",
                 " on rank 0: set it on every rank whose model is a part of the whole (pipeline stages) or on none");
    DTRAIN_CHECK(all[r][0] == all[0][0], "CheckpointManager::save: the model of rank ", r, " is ",
                 all[r][0] == '1' ? "" : "not ", "sharded, that of rank 0 is ", all[0][0] == '1' ? "" : "not ",
                 "sharded (fully_shard or parallelize_module): shard the model on every rank (over a group of one "
                 "on a rank that trains alone) or on none");
  }
  return mine;
}

// The manifest the main file keeps (rank 0's, on every rank): the model's own, or with model_part the
// union in rank order of every rank's part (collective then), each name once. Throws alike on every
// rank when two ranks' parts hold one name with different dtypes or shapes.
std::string model_manifest(const TrainingState& st) {
  if (!st.model) return "";
  const std::string mine = manifest_text(*st.model);
  if (!st.model_part || !distributed()) return mine;
  std::string all_parts;
  std::map<std::string, std::pair<std::string, size_t>> seen;  // name -> (description, rank)
  const std::vector<std::string> parts = all_gather_bytes(mine);
  for (size_t r = 0; r < parts.size(); ++r) {
    for (const std::string& line : util::split(parts[r])) {
      const size_t sp = line.find(' ');
      const std::string name = line.substr(0, sp), desc = sp == std::string::npos ? "" : line.substr(sp + 1);
      auto [it, fresh] = seen.emplace(name, std::make_pair(desc, r));
      DTRAIN_CHECK(fresh || it->second.first == desc, "CheckpointManager::save: tensor '", name, "' is ", desc,
                   " on rank ", r, " but ", it->second.first, " on rank ", it->second.second,
                   ": the parts of a model (TrainingState::model_part) must agree on the tensors they share");
      if (fresh) all_parts += line + "\n";
    }
  }
  return all_parts;
}

// Save step 2 of a sharded model (Note [Sharded checkpoints]): the folder exists on every rank, then
// every rank prepares its part of the model's DCP folder (staged from `staging` when given). Throws
// alike on every rank.
std::shared_ptr<dcp::detail::SaveInProgress> begin_dcp_folder(const std::string& dir, const std::string& path,
                                                              const TrainingState& st, ckpt::StagingPool* staging) {
  ckpt::throw_first_failure(ckpt::failure_of([&] {
    std::error_code ec;
    fs::create_directories(dir, ec);
    DTRAIN_CHECK(fs::is_directory(dir), "cannot create the checkpoint folder ", dir, ": ",
                 ec ? ec.message() : "a file of that name is in the way", ": choose another folder");
  }));
  return ckpt::begin_sharded_save(path, st, staging);
}

}  // namespace

// A sharded model's save_async between its start and its finish (Note [Asynchronous saves]).
struct ckpt::PendingShardedSave {
  std::shared_ptr<dcp::detail::SaveInProgress> dcp;       // its items written by writer_'s thread
  std::shared_ptr<torch::serialize::OutputArchive> main;  // rank 0: the main file, but the folder's record
  std::string path;
  int64_t step = 0;
};

CheckpointManager::~CheckpointManager() {
  if (sharded_pending_)
    warn("the asynchronous save of " + sharded_pending_->path +
         " was not finished: its folder's metadata and main file are written by wait() (or the next save or "
         "load_latest) on every rank, which the manager's destructor cannot run; the previous checkpoint stays the "
         "latest");
  if (!writer_) return;
  const std::string what = writer_->what();
  const std::string error = writer_->finish();
  if (!error.empty()) warn("the asynchronous save of " + what + " failed: " + error);
}

// Note [Asynchronous saves]: save_async() runs the collective part of a save (the ranks' packs
// gathered on rank 0, a ZeroRedundancyOptimizer's state consolidated there) on the caller's thread,
// as save() does; then rank 0 builds the archive from copies: the model's tensors are written as
// copies (save_module_staged), and the optimizer's state is written as it is while the live
// optimizer gets copies instead (restage_optimizer_state), so one memcpy of the state stages all
// of it. The copies come from a pool that keeps those of the last save once its write is done
// (ckpt::StagingPool): from the second save on, staging page-faults nothing, at the cost of one
// more copy of the state held between saves (double buffering). Serializing the archive (a zip with CRCs) and writing
// the file, the slow parts, run on a thread of rank 0's. Only that thread touches the archive, and no collective runs
// on it: the outcome is told at the next collective call of the manager (finish_async), where rank 0 broadcasts it. The
// file is written as save() writes it (temporary name, fsync, rename), so a crash mid-write leaves the folder's older
// checkpoints as they were.
// A sharded model's save_async stages on every rank: dcp::get_state_dict's tensors are copied from the
// pool, the DCP plan is agreed on the caller's thread (a collective), and each rank's thread writes
// its own items file. The folder's `.metadata` needs every rank's outcome, so it is written, and then
// rank 0's main file, at the next collective call (finish_sharded_async): until then the checkpoint
// does not exist, and the previous one is the latest.
std::string CheckpointManager::start_sharded_async(const std::string& path, const TrainingState& state,
                                                   const std::vector<std::string>& packs, const std::string& manifest) {
  if (!staging_) staging_ = std::make_unique<ckpt::StagingPool>();
  auto pending = std::make_shared<ckpt::PendingShardedSave>();
  pending->dcp = begin_dcp_folder(dir_, path, state, staging_.get());  // collective
  pending->path = path;
  pending->step = state.step;
  if (!is_initialized() || rank() == 0) {
    pending->main = std::make_shared<torch::serialize::OutputArchive>();
    fill_archive(*pending->main, state, packs, /*sharded=*/true, nullptr, manifest);
  }
  if (!writer_) writer_ = std::make_unique<ckpt::BackgroundWrite>();
  writer_->run(path, [save = pending->dcp] { save->write(); });
  sharded_pending_ = std::move(pending);
  async_outstanding_ = true;
  return path;
}

void CheckpointManager::finish_sharded_async() {
  const auto p = std::move(sharded_pending_);
  sharded_pending_.reset();
  writer_->finish();  // its failure, if any, is the SaveInProgress's, told by finish() below
  std::string error;
  try {
    const std::string record = ckpt::finish_sharded_save(*p->dcp);  // collective: throws alike
    if (p->main) {
      p->main->write("dcp", c10::IValue(record));
      write_and_rotate(dir_, options_, p->path, serialize(*p->main), p->step, version_of(true));
    }
  } catch (const c10::Error& e) {
    error = util::one_line(e.what_without_backtrace());
  } catch (const std::exception& e) {
    error = util::one_line(e.what());
  }
  staging_->release();
  error = broadcast_string(error);  // rank 0's main file too
  if (!error.empty()) throw Error("the asynchronous save of " + p->path + " failed: " + error);
}

void CheckpointManager::finish_async() {
  if (!async_outstanding_) return;
  async_outstanding_ = false;
  if (sharded_pending_) return finish_sharded_async();
  std::string error, what;
  if (writer_) {
    what = writer_->what();
    error = writer_->finish();
    staging_->release();  // the archive is gone: its copies serve the next save
  }
  error = broadcast_string(error.empty() ? "" : what + "\n" + error);
  if (error.empty()) return;
  const size_t nl = error.find('\n');
  throw Error((distributed() && rank() != 0 ? "rank 0's asynchronous save of " : "the asynchronous save of ") +
              error.substr(0, nl) + " failed: " + error.substr(nl + 1));
}

void CheckpointManager::wait() { finish_async(); }

std::string CheckpointManager::save(const TrainingState& state) {
  finish_async();
  return save_impl(state, /*background=*/false);
}

std::string CheckpointManager::save_async(const TrainingState& state) {
  finish_async();
  return save_impl(state, /*background=*/true);
}

std::string CheckpointManager::save_impl(const TrainingState& state, bool background) {
  DTRAIN_CHECK(state.step >= 0 && state.step <= 9999999999LL,
               "CheckpointManager::save: step must be in [0, 9999999999], got ", state.step);
  char name[32];
  std::snprintf(name, sizeof name, "_%010lld.pt", static_cast<long long>(state.step));
  const std::string path = (fs::path(dir_) / (options_.prefix() + name)).string();
  const auto packs = gather_packs(own_pack(state));  // 1.
  const bool sharded = sharded_everywhere(state);
  const std::string manifest = model_manifest(state);  // collective with model_part
  // A sharded optimizer's state is spread over its group: gathered on rank 0, which writes it.
  if (auto* zero = dynamic_cast<ShardedOptimizerState*>(state.optimizer)) {
    DTRAIN_CHECK(!sharded,
                 "CheckpointManager::save: a ZeroRedundancyOptimizer over a fully_shard'ed model: "
                 "fully_shard already shards the optimizer's state; build a torch::optim optimizer on the shards");
    zero->prepare_for_save(0);
  }
  // 2. A sharded model's DCP folder, written by every rank before rank 0 writes the main file.
  if (sharded && background) return start_sharded_async(path, state, packs, manifest);
  std::string dcp_record;
  if (sharded) {
    auto save = begin_dcp_folder(dir_, path, state, nullptr);
    save->write();
    dcp_record = ckpt::finish_sharded_save(*save);
  }
  std::string error;
  if (!is_initialized() || rank() == 0) {  // 3.
    try {
      std::error_code ec;
      fs::create_directories(dir_, ec);
      DTRAIN_CHECK(fs::is_directory(dir_), "cannot create the checkpoint folder ", dir_, ": ",
                   ec ? ec.message() : "a file of that name is in the way", ": choose another folder");
      if (background && !sharded) {
        stage_and_write(path, state, packs);
      } else {
        write_and_rotate(dir_, options_, path, encode(state, packs, manifest, dcp_record), state.step,
                         version_of(sharded));
      }
    } catch (const c10::Error& e) {
      error = util::one_line(e.what_without_backtrace());
    } catch (const std::exception& e) {
      error = util::one_line(e.what());
    }
  }
  error = broadcast_string(error);                                         // 4.
  if (background && !sharded && error.empty()) async_outstanding_ = true;  // every rank: told at the next call
  if (!error.empty()) {
    throw Error(distributed() && rank() != 0 ? "rank 0 failed to save a checkpoint: " + error : error);
  }
  return path;
}

void CheckpointManager::stage_and_write(const std::string& path, const TrainingState& state,
                                        const std::vector<std::string>& packs) {
  if (!staging_) staging_ = std::make_unique<ckpt::StagingPool>();
  auto archive = std::make_shared<torch::serialize::OutputArchive>();
  fill_archive(*archive, state, packs, /*sharded=*/false, staging_.get(),
               state.model ? manifest_text(*state.model) : "");
  std::string payload;  // serialized here when the optimizer's state cannot be staged
  if (state.optimizer && !dynamic_cast<ShardedOptimizerState*>(state.optimizer) &&
      !ckpt::restage_optimizer_state(*state.optimizer, *staging_)) {
    warn_once("checkpoint-async-optimizer",
              "save_async: this optimizer's state cannot be staged (not Adam, AdamW, SGD, Adagrad or RMSprop): "
              "its checkpoints are serialized before save_async returns, and only written in the background");
    payload = serialize(*archive);
    archive.reset();
  }
  if (!writer_) writer_ = std::make_unique<ckpt::BackgroundWrite>();
  writer_->run(path, [dir = dir_, options = options_, path, archive, payload, step = state.step]() mutable {
    if (archive) payload = serialize(*archive);
    write_and_rotate(dir, options, path, payload, step, 1);
  });
}

std::optional<std::string> CheckpointManager::load_latest(TrainingState& state) {
  finish_async();
  // 1. Rank 0 picks the newest usable file. Its outcome line: "" (none), "ok <path>" or "error <msg>".
  std::string outcome, framed;
  if (!is_initialized() || rank() == 0) outcome = pick_latest(dir_, options_, framed);
  // 2.
  outcome = broadcast_string(outcome);
  if (outcome.empty()) return std::nullopt;
  if (outcome.rfind("error ", 0) == 0) throw Error(outcome.substr(6));
  const std::string path = outcome.substr(3);
  // The framed bytes travel, so every rank checks the CRC-32 of what it received.
  framed = broadcast_string(framed);
  std::string payload;
  try {
    payload = ckpt::unframe(framed);
  } catch (const Error& e) {
    throw Error("checkpoint " + path + " arrived damaged from rank 0: " + e.what());
  }
  // 3.
  torch::serialize::InputArchive a;
  parse(payload, a);
  restore(a, state, path, is_initialized() ? rank() : 0);
  return path;
}

}  // namespace dtrain
