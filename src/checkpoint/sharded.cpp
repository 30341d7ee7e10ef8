// Sharded checkpoints: each rank's shard file, the main file's part for the model, and the load that
// reslices the saved ranks' rows onto any layout (see sharded.h; the saved files' reading and the
// choice of which to read: saved_shards.h).
#include "checkpoint/sharded.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <map>
#include <set>
#include <sstream>
#include <tuple>
#include <unordered_map>

#include "checkpoint/file_io.h"
#include "checkpoint/param_shards.h"
#include "checkpoint/saved_shards.h"
#include "common/util.h"
#include "compat/optim_compat.h"
#include "dtrain/errors.h"
#include "dtrain/process_group.h"
#include "optim/state_device.h"

// Note [Sharded checkpoints]: a fully_shard'ed model is on no rank whole, and gathering it to one
// rank to write it would need the memory sharding saves. So every rank writes what it holds, as
// PyTorch's distributed checkpoint does: its rows of every sharded parameter (FSDP2's to_local())
// and its optimizer's state for them, in a shard file of its own (named by world rank and world
// size), atomically; rank 0 then writes the main file last, with what every rank holds alike
// (buffers, parameters no unit holds, scaler, sampler, RNG packs) and each shard file's record: its
// header line and its layout. A save whose main file exists is complete: a rank that failed to write
// its shard fails the save on every rank, each removes its own shard, and no main file names them.
//
// The layout says which rows a file holds: per sharded parameter, the rank inside the group it is
// sharded over and the group's size (FSDP2's layout: group rank g of n holds rows
// [g * ceil(d / n), (g + 1) * ceil(d / n)) of d). A model may be sharded over a subgroup, not the
// world: with two replica groups {0, 1} and {2, 3} each sharding the model (HSDP's replication),
// world ranks 0 and 2 hold the same rows, and world rank r's rows are not rank r's of the world. So a
// load never takes a file's world rank for its group rank: it reads the recorded layouts (a main
// file written before they were recorded was sharded over the world: file r holds rank r's rows of
// the saved world). The save checks, alike on every rank, that every rank shards the model (each
// over its own group) or none does, and that all shard the same parameters: a rank that did not
// would skip the others' all-gather, and a load could not say where each parameter's rows are.
//
// A load reads the main file (rank 0 picks and broadcasts it, as for any checkpoint), then every
// rank reads from the folder the shard files holding its target rows (its own group's layout, on any
// world and group size, or all rows into a model not sharded at all), per parameter: a file that
// holds them by the same group (its own file first: an exact resume continues bit for bit; else the
// lowest world rank's), or else pieces covering them left to right, each from the file whose rows
// reach furthest (the lowest world rank's on a tie: replicas hold equal rows, one is read). So every
// rank must see the shard files: on several nodes the folder must be shared. Optimizer state is
// resliced from the same pieces: a state tensor of the shard's shape is that parameter's rows (Adam's
// moments, SGD's momentum), any other value (a step count) is the same on every rank and taken from
// the lowest-numbered file read. When this rank's own file holds every parameter as this rank does
// (the exact resume, or another world with the same layout), its optimizer state loads as saved.
//
// The format version: the main and shard files of a save over subgroups are version 2, which older
// dtrains refuse (they would take world rank r's file for rank r's rows of the world); a save over
// the world writes version 1 as before, and dtrains on either side read it.

namespace dtrain::ckpt {

namespace fs = std::filesystem;

namespace {

using Layouts = ParamShards;

// The shape in rows: a 0-dim parameter is sharded as one row.
std::vector<int64_t> row_shape(std::vector<int64_t> shape) { return shape.empty() ? std::vector<int64_t>{1} : shape; }

// Each piece followed by a newline, so that util::split gives back empty pieces too.
std::string lines(const std::vector<std::string>& pieces) {
  std::string s;
  for (const std::string& p : pieces) s += p + "\n";
  return s;
}

std::string describe(at::ScalarType dtype, at::IntArrayRef shape) {
  std::ostringstream s;
  s << dtype << " " << shape;
  return s.str();
}

// The name of every parameter and buffer of `model` by its TensorImpl.
std::unordered_map<const c10::TensorImpl*, std::string> names_of(const torch::nn::Module& model) {
  std::unordered_map<const c10::TensorImpl*, std::string> out;
  for (const auto& kv : model.named_parameters()) out.emplace(kv.value().unsafeGetTensorImpl(), kv.key());
  return out;
}

// A unit's parameters are whole between its forward and backward: no shard to save or load into.
void check_sharded_now(const torch::nn::Module& model, const Layouts& layouts) {
  for (const auto& kv : model.named_parameters()) {
    auto it = layouts.find(kv.value().unsafeGetTensorImpl());
    DTRAIN_CHECK(it == layouts.end() || !it->second.whole, "CheckpointManager: parameter '", kv.key(),
                 "' is gathered right now (between its unit's forward and backward): save or load between steps");
  }
}

// The lowest format version that reads shard file `file` of `world` with this layout: 3 when a
// parameter is sharded along a dimension other than 0 (tensor parallelism), which version 2 cannot
// record; 2 when the file holds other rows than its world rank's of the world (a subgroup), which
// dtrains before version 2 would take; else 1.
int version_of_layout(const FileLayout& layout, int64_t file, int64_t world) {
  int version = 1;
  for (const ShardGroup& g : layout) {
    if (g.dim != 0) return 3;
    if (g != ShardGroup{file, world}) version = 2;
  }
  return version;
}

// A shard file's record as write_own_shard returns it.
struct Record {
  std::string header, layout, digest;
};

std::vector<Record> parse_records(const std::vector<std::string>& records) {
  std::vector<Record> out;
  for (const std::string& r : records) {
    const std::vector<std::string> parts = util::split(r);
    DTRAIN_ASSERT(parts.size() == 3, "a shard record of ", parts.size(), " lines");
    out.push_back(Record{parts[0], parts[1], parts[2]});
  }
  return out;
}

// The optimizer's parameters in param_groups order.
std::vector<at::Tensor> optimizer_params(const torch::optim::Optimizer& opt) {
  std::vector<at::Tensor> out;
  for (const auto& g : opt.param_groups())
    for (const auto& p : g.params()) out.push_back(p);
  return out;
}

// saved_dim: the dimension the save sharded the parameter along, the one a whole target's rows
// are counted in.
Target target_of(const std::string& name, const at::Tensor& param, const Layouts& layouts, int64_t saved_dim) {
  Target t;
  t.name = name;
  auto it = layouts.find(param.unsafeGetTensorImpl());
  if (it == layouts.end()) {
    t.shape = row_shape(param.sizes().vec());
    t.group.dim = std::min<int64_t>(saved_dim, static_cast<int64_t>(t.shape.size()) - 1);
    t.hi = t.shape[static_cast<size_t>(t.group.dim)];
  } else {
    t.shape = row_shape(it->second.full_shape);
    t.group = ShardGroup{it->second.group.rank(), it->second.group.size(), it->second.dim};
    std::tie(t.lo, t.hi) = rows_of(t.shape[static_cast<size_t>(t.group.dim)], t.group.rank, t.group.size);
  }
  return t;
}

// The optimizer's state on another layout (Note [Sharded checkpoints]): one saved file's archive
// gives the param groups (learning rates as a scheduler left them) and the kinds of state; each
// sharded parameter's state tensors are then replaced by this rank's rows, assembled from the pieces
// its rows came from. Planned first (everything read), applied once every rank has its plan.
struct OptimizerPlan {
  torch::serialize::InputArchive* whole = nullptr;     // loaded as it is
  std::vector<std::pair<size_t, std::string>> states;  // then: optimizer parameter -> its new state's archive
};

// The plan of an optimizer over the parameters `targets` holds, whose rows come from `pieces` (by name;
// the save's sharded parameters only).
OptimizerPlan plan_resliced(const torch::optim::Optimizer& opt, SavedShards& saved,
                            const std::map<std::string, Target>& targets,
                            const std::map<std::string, std::vector<Piece>>& pieces) {
  SavedShard& base = saved.any_read();
  DTRAIN_CHECK(base.optimizer, "checkpoint shard ", base.file,
               " holds no optimizer state: it was saved without one; leave TrainingState::optimizer null");
  const std::vector<at::Tensor> params = optimizer_params(opt);
  DTRAIN_CHECK(base.opt_names.size() == params.size(), "checkpoint shard ", base.file, " holds the state of ",
               base.opt_names.size(), " optimizer parameters, but the optimizer has ", params.size(),
               ": build the optimizer on the same parameters, in the same order");
  OptimizerPlan plan;
  plan.whole = &*base.optimizer;
  for (size_t q = 0; q < params.size(); ++q) {
    const std::string& name = base.opt_names[q];
    auto from = pieces.find(name);
    if (from == pieces.end() || base.opt_state[q].empty()) continue;
    const at::Tensor& base_rows = base.rows.at(name);
    torch::serialize::OutputArchive out;
    for (const auto& [key, value] : base.opt_state[q]) {
      if (!value.isTensor() || value.toTensor().sizes() != base_rows.sizes()) {
        out.write(key, value);  // the same on every rank (a step count)
        continue;
      }
      const at::Tensor rows = assemble(
          saved, targets.at(name), from->second, value.toTensor().options(), [&, q = q, key = key](SavedShard& s) {
            DTRAIN_CHECK(q < s.opt_state.size() && s.opt_state[q].count(key), "checkpoint shard ", s.file,
                         " lacks the optimizer state '", key, "' of '", name, "' that ", base.file, " holds");
            return s.opt_state[q].at(key).toTensor();
          });
      out.write(key, c10::IValue(rows.reshape(params[q].sizes()).clone()));
    }
    std::ostringstream bytes;
    out.save_to(bytes);
    plan.states.emplace_back(q, bytes.str());
  }
  return plan;
}

void apply(torch::optim::Optimizer& opt, const OptimizerPlan& plan) {
  opt.load(*plan.whole);  // read onto the CPU: moved to the parameters' devices below
  const std::vector<at::Tensor> params = optimizer_params(opt);
  for (const auto& [q, bytes] : plan.states) {
    auto st = opt.state().find(compat::optimizer_state_key(params[q]));
    DTRAIN_ASSERT(st != opt.state().end(), "no optimizer state after loading the saved archive");
    torch::serialize::InputArchive in;
    in.load_from(bytes.data(), bytes.size());
    st->second->serialize(in);
  }
  optim_state::move_to_param_devices(opt);
}

// What the main file holds of the model besides its shards: parameters no unit holds, and buffers.
std::map<std::string, at::Tensor> read_replicated(torch::serialize::InputArchive& a, const std::string& main_path) {
  torch::serialize::InputArchive rep;
  DTRAIN_CHECK(a.try_read("model_replicated", rep), "checkpoint ", main_path, " lacks model_replicated");
  const std::vector<std::string> names = util::split(read_string(rep, "names", main_path));
  std::map<std::string, at::Tensor> out;
  for (size_t i = 0; i < names.size(); ++i) out.emplace(names[i], read_tensor(rep, "t" + std::to_string(i), main_path));
  return out;
}

// Every rank's outcome of `fn`: a failure on any rank throws on every rank, naming it (a rank that
// went on alone would wait in the next collective).
void on_every_rank(const std::function<void()>& fn) {
  std::string mine;
  try {
    fn();
  } catch (const c10::Error& e) {
    mine = util::one_line(e.what_without_backtrace());
  } catch (const std::exception& e) {
    mine = util::one_line(e.what());
  }
  if (!is_initialized() || world_size() == 1) {
    if (!mine.empty()) throw Error(mine);
    return;
  }
  const std::vector<std::string> all = all_gather_bytes(mine);
  for (size_t r = 0; r < all.size(); ++r)
    if (!all[r].empty())
      throw Error(static_cast<int>(r) == rank() ? all[r] : detail::cat("rank ", r, " failed to load: ", all[r]));
}

}  // namespace

bool holds_shards(const torch::nn::Module* model) { return model && !param_shards(*model).empty(); }

std::vector<std::pair<std::string, std::string>> whole_manifest(const torch::nn::Module& model) {
  const Layouts layouts = param_shards(model);
  std::vector<std::pair<std::string, std::string>> out;
  for (const auto& p : model.named_parameters()) {
    auto it = layouts.find(p.value().unsafeGetTensorImpl());
    out.emplace_back(p.key(),
                     describe(p.value().scalar_type(),
                              it == layouts.end() ? p.value().sizes() : at::IntArrayRef(it->second.full_shape)));
  }
  for (const auto& b : model.named_buffers())
    out.emplace_back(b.key(), describe(b.value().scalar_type(), b.value().sizes()));
  return out;
}

std::string shard_path(const std::string& main_path, int rank, int world) {
  const std::string stem = main_path.substr(0, main_path.size() - 3);  // without ".pt"
  return detail::cat(stem, ".shard", rank, "-of-", world, ".pt");
}

std::string write_own_shard(const std::string& main_path, const TrainingState& st, int rank, int world) {
  const Layouts layouts = param_shards(*st.model);
  check_sharded_now(*st.model, layouts);
  torch::serialize::OutputArchive a;
  std::vector<std::string> names;
  FileLayout layout;
  for (const auto& kv : st.model->named_parameters()) {
    auto it = layouts.find(kv.value().unsafeGetTensorImpl());
    if (it == layouts.end()) continue;
    // A copy: the shard is a view of its unit's flat storage, which serializing the view would write whole.
    a.write("shard_" + std::to_string(names.size()), it->second.shard.detach().clone(), /*is_buffer=*/true);
    names.push_back(kv.key());
    layout.push_back(ShardGroup{it->second.group.rank(), it->second.group.size(), it->second.dim});
  }
  const int version = version_of_layout(layout, rank, world);
  a.write("version", c10::IValue(static_cast<int64_t>(version)));
  a.write("step", c10::IValue(st.step));
  a.write("rank", c10::IValue(static_cast<int64_t>(rank)));
  a.write("world_size", c10::IValue(static_cast<int64_t>(world)));
  a.write("names", c10::IValue(lines(names)));
  a.write("layout", c10::IValue(encode_layout(layout)));
  if (st.optimizer) {
    torch::serialize::OutputArchive o;
    st.optimizer->save(o);
    a.write("optimizer", o);
    const auto by_impl = names_of(*st.model);
    std::vector<std::string> opt_names;
    for (const at::Tensor& p : optimizer_params(*st.optimizer)) {
      auto it = by_impl.find(p.unsafeGetTensorImpl());
      opt_names.push_back(it == by_impl.end() ? "" : it->second);
    }
    a.write("optimizer_params", c10::IValue(lines(opt_names)));
  }
  std::ostringstream os;
  a.save_to(os);
  const std::string framed = frame(os.str(), 1, version);
  write_atomic(shard_path(main_path, rank, world), framed);
  char digest[16];
  std::snprintf(digest, sizeof digest, "%08x", crc32_of(lines(names)));
  return lines({framed.substr(0, framed.find('\n')), encode_layout(layout), digest});
}

void check_shard_records(const std::vector<std::string>& records) {
  const std::vector<Record> all = parse_records(records);
  for (size_t r = 1; r < all.size(); ++r)
    DTRAIN_CHECK(all[r].digest == all[0].digest, "CheckpointManager::save: the sharded parameters of rank ", r, " (",
                 decode_layout(all[r].layout, "the save").size(), ") are not those of rank 0 (",
                 decode_layout(all[0].layout, "the save").size(),
                 "): every rank must fully_shard the same modules of the same model, each over its own group");
}

int format_version(const std::vector<std::string>& records) {
  const std::vector<Record> all = parse_records(records);
  const auto world = static_cast<int64_t>(all.size());
  int version = 1;
  for (int64_t r = 0; r < world; ++r)
    version =
        std::max(version, version_of_layout(decode_layout(all[static_cast<size_t>(r)].layout, "the save"), r, world));
  return version;
}

void encode_sharded_model(torch::serialize::OutputArchive& a, const TrainingState& st,
                          const std::vector<std::string>& records) {
  const Layouts layouts = param_shards(*st.model);
  // What every rank holds alike: the parameters no unit holds, and the buffers.
  torch::serialize::OutputArchive rep;
  std::vector<std::string> names;
  auto add = [&](const std::string& name, const at::Tensor& t) {
    rep.write("t" + std::to_string(names.size()), t.detach(), /*is_buffer=*/true);
    names.push_back(name);
  };
  for (const auto& kv : st.model->named_parameters())
    if (!layouts.count(kv.value().unsafeGetTensorImpl())) add(kv.key(), kv.value());
  for (const auto& kv : st.model->named_buffers()) add(kv.key(), kv.value());
  rep.write("names", c10::IValue(lines(names)));
  a.write("model_replicated", rep);
  std::vector<std::string> headers, file_layouts, sharded;
  for (const Record& r : parse_records(records)) {
    headers.push_back(r.header);
    file_layouts.push_back(r.layout);
  }
  for (const auto& kv : st.model->named_parameters())
    if (layouts.count(kv.value().unsafeGetTensorImpl())) sharded.push_back(kv.key());
  a.write("shards", c10::IValue(lines(headers)));
  a.write("shard_layouts", c10::IValue(lines(file_layouts)));
  a.write("shard_names", c10::IValue(lines(sharded)));
}

bool is_sharded_archive(torch::serialize::InputArchive& a) {
  c10::IValue v;
  return a.try_read("shards", v);
}

void load_sharded_model(torch::serialize::InputArchive& a, TrainingState& st, const std::string& main_path) {
  std::vector<std::pair<at::Tensor, at::Tensor>> copies;  // destination, source
  std::optional<SavedShards> saved;
  OptimizerPlan plan;
  // 1. Everything read and assembled; nothing changes until every rank has all of its part.
  on_every_rank([&] {
    saved.emplace(a, main_path);
    const Layouts layouts = param_shards(*st.model);
    check_sharded_now(*st.model, layouts);
    const int64_t own = is_initialized() ? rank() : 0;
    std::map<std::string, size_t> sharded;  // the save's sharded parameters, by name
    for (size_t p = 0; p < saved->names().size(); ++p) sharded.emplace(saved->names()[p], p);
    // Whether this rank's own file holds every parameter as this rank does: its optimizer state then
    // loads as it was saved (the exact resume).
    bool as_saved = !layouts.empty() && own < saved->count();
    std::map<std::string, Target> targets;
    std::map<std::string, std::vector<Piece>> pieces;
    for (const auto& kv : st.model->named_parameters()) {
      auto p = sharded.find(kv.key());
      const int64_t saved_dim = p == sharded.end() ? 0 : saved->group(0, p->second).dim;
      Target t = target_of(kv.key(), kv.value(), layouts, saved_dim);
      const bool here = layouts.count(kv.value().unsafeGetTensorImpl()) != 0;
      if (p == sharded.end()) {
        as_saved = as_saved && !here;
      } else {
        DTRAIN_CHECK(t.group.dim == saved_dim, "checkpoint ", main_path, " holds '", kv.key(), "' sharded along dim ",
                     saved_dim, " but this model shards it along dim ", t.group.dim,
                     ": load it into the unsharded model, or one sharded as it was saved");
        as_saved = as_saved && here && saved->group(own, p->second) == t.group;
        std::vector<Piece> from = plan_pieces(*saved, p->second, t, own);
        at::Tensor rows =
            assemble(*saved, t, from, kv.value().options(), [&](SavedShard& s) { return s.rows.at(kv.key()); });
        copies.emplace_back(kv.value(), rows.reshape(kv.value().sizes()));
        pieces.emplace(kv.key(), std::move(from));
      }
      targets.emplace(kv.key(), std::move(t));
    }
    const std::map<std::string, at::Tensor> replicated = read_replicated(a, main_path);
    auto from_replicated = [&](const std::string& name, const at::Tensor& dst) {
      auto it = replicated.find(name);
      DTRAIN_CHECK(it != replicated.end(), "checkpoint ", main_path, " holds '", name,
                   "' in none of its files: was it saved by another version of the model?");
      copies.emplace_back(dst, it->second.reshape(dst.sizes()));
    };
    for (const auto& kv : st.model->named_parameters())
      if (!sharded.count(kv.key())) from_replicated(kv.key(), kv.value());
    for (const auto& kv : st.model->named_buffers()) from_replicated(kv.key(), kv.value());
    if (!st.optimizer) return;
    if (as_saved) {
      SavedShard& mine = saved->at(own);
      DTRAIN_CHECK(mine.optimizer, "checkpoint shard ", mine.file,
                   " holds no optimizer state: it was saved without one; leave TrainingState::optimizer null");
      plan.whole = &*mine.optimizer;
    } else {
      plan = plan_resliced(*st.optimizer, *saved, targets, pieces);
    }
  });
  // 2.
  {
    torch::NoGradGuard no_grad;
    for (auto& [dst, src] : copies) dst.copy_(src);
  }
  if (st.optimizer) apply(*st.optimizer, plan);
}

void remove_shards_except(const std::string& dir, const std::string& prefix, const std::vector<std::string>& keep,
                          int rank) {
  std::set<std::string> kept;
  for (const std::string& k : keep) kept.insert(fs::path(k).filename().string().substr(0, prefix.size() + 11));
  const std::string head = prefix + "_";
  const std::string mine = rank < 0 ? "" : detail::cat(".shard", rank, "-of-");
  std::error_code ec;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    // <prefix>_<10 digits>.shard<r>-of-<n>.pt
    if (name.size() < head.size() + 10 + 3 || name.compare(0, head.size(), head) != 0) continue;
    const std::string stem = name.substr(0, head.size() + 10);
    const std::string rest = name.substr(stem.size());
    if (!util::is_digits(stem.substr(head.size())) || rest.rfind(".shard", 0) != 0 ||
        rest.compare(rest.size() - 3, 3, ".pt") != 0)
      continue;
    if (!mine.empty() && rest.rfind(mine, 0) != 0) continue;
    std::error_code rm;
    if (!kept.count(stem)) fs::remove(it->path(), rm);
  }
}

}  // namespace dtrain::ckpt
