// Sharded checkpoints: each rank's shard file, the main file's part for the model, and the load that
// reslices the saved ranks' rows onto any world (see sharded.h).
#include "checkpoint/sharded.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <algorithm>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <sstream>
#include <tuple>
#include <unordered_map>

#include "checkpoint/file_io.h"
#include "common/util.h"
#include "compat/optim_compat.h"
#include "dtrain/errors.h"
#include "dtrain/process_group.h"
#include "fsdp/shard_layout.h"

// Note [Sharded checkpoints]: a fully_shard'ed model is on no rank whole, and gathering it to one
// rank to write it would need the memory sharding saves. So every rank writes what it holds, as
// PyTorch's distributed checkpoint does: its rows of every sharded parameter (FSDP2's to_local())
// and its optimizer's state for them, in a shard file of its own, atomically; rank 0 then writes the
// main file last, with what every rank holds alike (buffers, parameters no unit holds, scaler,
// sampler, RNG packs) and each shard file's header line. A save whose main file exists is complete:
// a rank that failed to write its shard fails the save on every rank, each removes its own shard,
// and no main file names them. A load reads the main file (rank 0 picks and broadcasts it, as for any
// checkpoint), then every rank reads from the folder the shard files holding its rows: its own on
// the world size that saved (an exact resume), and those whose rows overlap its new ones on
// another (FSDP2's layout on the new world), or all of them into a model not sharded at all. So
// every rank must see the shard files: on several nodes the folder must be shared. Optimizer state
// is resliced the same way: a state tensor of the shard's shape is that parameter's rows (Adam's
// moments, SGD's momentum), any other value (a step count) is the same on every rank and taken from
// saved rank 0's.

namespace dtrain::ckpt {

namespace fs = std::filesystem;

namespace {

using Layouts = std::unordered_map<const c10::TensorImpl*, fsdp::ShardLayout>;

// The shape in rows: a 0-dim parameter is sharded as one row.
std::vector<int64_t> row_shape(std::vector<int64_t> shape) { return shape.empty() ? std::vector<int64_t>{1} : shape; }

// Rows [lo, hi) of dim 0 that rank r of n holds of a parameter of `rows` rows (FSDP2's layout: chunks
// of ceil(rows / n); the ranks past the end hold none).
std::pair<int64_t, int64_t> rows_of(int64_t rows, int64_t r, int64_t n) {
  const int64_t chunk = (rows + n - 1) / n;
  const int64_t lo = std::min(rows, r * chunk);
  return {lo, std::min(rows, lo + chunk)};
}

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

at::Tensor read_tensor(torch::serialize::InputArchive& a, const std::string& key, const std::string& file) {
  at::Tensor t;
  DTRAIN_CHECK(a.try_read(key, t, /*is_buffer=*/true), "checkpoint shard ", file, " lacks ", key);
  return t;
}

std::string read_string(torch::serialize::InputArchive& a, const std::string& key, const std::string& file) {
  c10::IValue v;
  DTRAIN_CHECK(a.try_read(key, v) && v.isString(), "checkpoint ", file, " lacks ", key);
  return v.toStringRef();
}

// The name of every parameter and buffer of `model` by its TensorImpl.
std::unordered_map<const c10::TensorImpl*, std::string> names_of(const torch::nn::Module& model) {
  std::unordered_map<const c10::TensorImpl*, std::string> out;
  for (const auto& kv : model.named_parameters()) out.emplace(kv.value().unsafeGetTensorImpl(), kv.key());
  return out;
}

int world_size_or_one() { return is_initialized() ? world_size() : 1; }

// Every sharded parameter of `model` must be sharded over the world: a shard file is a world rank's.
void check_world_group(const torch::nn::Module& model, const Layouts& layouts) {
  for (const auto& kv : model.named_parameters()) {
    auto it = layouts.find(kv.value().unsafeGetTensorImpl());
    if (it == layouts.end()) continue;
    DTRAIN_CHECK(it->second.group.is_default() || it->second.group.size() == world_size_or_one(),
                 "CheckpointManager: parameter '", kv.key(), "' is sharded over a group of ", it->second.group.size(),
                 " of the ", world_size_or_one(),
                 " ranks: sharded checkpoints need fully_shard over the whole world; save its full_state_dict() "
                 "yourself instead");
    DTRAIN_CHECK(!it->second.whole, "CheckpointManager: parameter '", kv.key(),
                 "' is gathered right now (between its unit's forward and backward): save or load between steps");
  }
}

// --- the optimizer's archive (LibTorch's format: param_groups/<i>/params/<j> name each parameter's
// entry in "state" by a key of the saving process) ---------------------------------------------------

// Per optimizer parameter (in param_groups order), its state's values by name; empty: no state.
using SavedState = std::vector<std::map<std::string, c10::IValue>>;

SavedState read_optimizer_state(torch::serialize::InputArchive& opt) {
  torch::serialize::InputArchive groups, states;
  opt.read("param_groups", groups);
  opt.read("state", states);
  at::Tensor n_groups;
  groups.read("param_groups/size", n_groups);
  SavedState out;
  for (int64_t i = 0; i < n_groups.item<int64_t>(); ++i) {
    torch::serialize::InputArchive group;
    groups.read("param_groups/" + std::to_string(i), group);
    at::Tensor n;
    group.read("params/size", n);
    for (int64_t j = 0; j < n.item<int64_t>(); ++j) {
      c10::IValue key;
      group.read("params/" + std::to_string(j), key);
      std::map<std::string, c10::IValue> values;
      torch::serialize::InputArchive one;
      if (states.try_read(key.toStringRef(), one))
        for (const std::string& name : one.keys()) {
          c10::IValue v;
          one.read(name, v);
          values.emplace(name, std::move(v));
        }
      out.push_back(std::move(values));
    }
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

// --- one saved rank's shard file -----------------------------------------------------------------

struct SavedShard {
  std::string file;
  std::map<std::string, at::Tensor> rows;  // parameter name -> the rows it held
  std::vector<std::string> opt_names;      // per optimizer parameter: its model name ("" if none)
  std::optional<torch::serialize::InputArchive> optimizer;
  SavedState opt_state;
};

SavedShard read_shard(const std::string& path, const std::string& header, std::optional<at::Device> device) {
  std::string bytes;
  try {
    bytes = util::read_file(path, "checkpoint shard");
  } catch (const std::exception& e) {
    throw Error(detail::cat("rank ", is_initialized() ? rank() : 0, " cannot read ", util::one_line(e.what()),
                            ": every rank reads the shard files of a sharded checkpoint, so on several nodes the "
                            "checkpoint folder must be one they share"));
  }
  const size_t eol = bytes.find('\n');
  DTRAIN_CHECK(bytes.substr(0, eol) == header, "checkpoint shard ", path,
               " is not the one its main file names (another save's, or replaced): restore the folder's files "
               "of that save together");
  torch::serialize::InputArchive a;
  try {
    const std::string payload = unframe(bytes);
    a.load_from(payload.data(), payload.size(), device ? c10::optional<at::Device>(*device) : c10::nullopt);
  } catch (const std::exception& e) {
    throw Error(detail::cat("checkpoint shard ", path, " is unusable: ", util::one_line(e.what())));
  }
  SavedShard s;
  s.file = path;
  const std::vector<std::string> names = util::split(read_string(a, "names", path));
  for (size_t i = 0; i < names.size(); ++i)
    s.rows.emplace(names[i], read_tensor(a, "shard_" + std::to_string(i), path));
  torch::serialize::InputArchive opt;
  if (a.try_read("optimizer", opt)) {
    s.opt_names = util::split(read_string(a, "optimizer_params", path));
    s.opt_state = read_optimizer_state(opt);
    s.optimizer = std::move(opt);
  }
  return s;
}

// The saved world's shard files, read on first use.
class SavedShards {
 public:
  SavedShards(std::vector<std::pair<std::string, std::string>> files, std::optional<at::Device> device)
      : files_(std::move(files)), device_(device), cache_(files_.size()) {}
  int64_t world() const { return static_cast<int64_t>(files_.size()); }
  SavedShard& at(int64_t r) {
    auto& slot = cache_[static_cast<size_t>(r)];
    if (!slot) slot = std::make_unique<SavedShard>(read_shard(files_[r].first, files_[r].second, device_));
    return *slot;
  }

 private:
  std::vector<std::pair<std::string, std::string>> files_;  // path, header line
  std::optional<at::Device> device_;
  std::vector<std::unique_ptr<SavedShard>> cache_;
};

// This rank's target rows of a parameter: its own under fully_shard, all of them otherwise.
struct Target {
  std::string name;
  std::vector<int64_t> shape;  // whole, in rows (row_shape)
  int64_t lo = 0, hi = 0;
};

// Rows [t.lo, t.hi) of the parameter t.name, from the saved ranks that held them; `of` picks the
// tensor out of a saved rank's shard (its rows, or a state tensor of their shape). No rows: an empty
// tensor of `options` (no file is read for it).
at::Tensor assemble(SavedShards& saved, const Target& t, const at::TensorOptions& options,
                    const std::function<at::Tensor(SavedShard&)>& of) {
  std::vector<at::Tensor> parts;
  const int64_t n = saved.world(), rows = t.shape[0];
  for (int64_t k = 0; k < n; ++k) {
    const auto [klo, khi] = rows_of(rows, k, n);
    const int64_t a = std::max(t.lo, klo), b = std::min(t.hi, khi);
    if (a >= b) continue;
    at::Tensor part = of(saved.at(k));
    DTRAIN_CHECK(part.dim() >= 1 && part.size(0) == khi - klo, "checkpoint shard ", saved.at(k).file, " holds ",
                 part.dim() ? part.size(0) : 0, " rows of '", t.name, "', not the ", khi - klo, " of its layout");
    parts.push_back(part.narrow(0, a - klo, b - a));
  }
  if (parts.empty()) {
    std::vector<int64_t> shape = t.shape;
    shape[0] = 0;
    return at::empty(shape, options);
  }
  return parts.size() == 1 ? parts[0] : at::cat(parts);
}

Target target_of(const std::string& name, const at::Tensor& param, const Layouts& layouts) {
  Target t;
  t.name = name;
  auto it = layouts.find(param.unsafeGetTensorImpl());
  if (it == layouts.end()) {
    t.shape = row_shape(param.sizes().vec());
    t.hi = t.shape[0];
  } else {
    t.shape = row_shape(it->second.full_shape);
    const fsdp::ShardLayout& l = it->second;
    std::tie(t.lo, t.hi) = rows_of(t.shape[0], l.group.rank(), l.group.size());
  }
  return t;
}

// The optimizer's state on another world (Note [Sharded checkpoints]): saved rank 0's archive gives
// the param groups (learning rates as a scheduler left them) and the kinds of state; each sharded
// parameter's state tensors are then replaced by this rank's rows, assembled from the saved ranks.
// Planned first (everything read), applied once every rank has its plan.
struct OptimizerPlan {
  torch::serialize::InputArchive* whole = nullptr;     // loaded as it is
  std::vector<std::pair<size_t, std::string>> states;  // then: optimizer parameter -> its new state's archive
};

OptimizerPlan plan_resliced(const torch::optim::Optimizer& opt, SavedShards& saved,
                            const std::map<std::string, Target>& targets, const std::set<std::string>& sharded) {
  SavedShard& zero = saved.at(0);
  DTRAIN_CHECK(zero.optimizer, "checkpoint shard ", zero.file,
               " holds no optimizer state: it was saved without one; leave TrainingState::optimizer null");
  const std::vector<at::Tensor> params = optimizer_params(opt);
  DTRAIN_CHECK(zero.opt_names.size() == params.size(), "checkpoint shard ", zero.file, " holds the state of ",
               zero.opt_names.size(), " optimizer parameters, but the optimizer has ", params.size(),
               ": build the optimizer on the same parameters, in the same order");
  OptimizerPlan plan;
  plan.whole = &*zero.optimizer;
  for (size_t q = 0; q < params.size(); ++q) {
    const std::string& name = zero.opt_names[q];
    if (!sharded.count(name) || zero.opt_state[q].empty()) continue;
    const Target& t = targets.at(name);
    const at::Tensor& rows0 = zero.rows.at(name);
    torch::serialize::OutputArchive out;
    for (const auto& [key, value] : zero.opt_state[q]) {
      if (!value.isTensor() || value.toTensor().sizes() != rows0.sizes()) {
        out.write(key, value);  // the same on every rank (a step count)
        continue;
      }
      const at::Tensor rows = assemble(saved, t, value.toTensor().options(), [&, q = q, key = key](SavedShard& s) {
        DTRAIN_CHECK(q < s.opt_state.size() && s.opt_state[q].count(key), "checkpoint shard ", s.file,
                     " lacks the optimizer state '", key, "' of '", name, "' that rank 0's holds");
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
  opt.load(*plan.whole);
  const std::vector<at::Tensor> params = optimizer_params(opt);
  for (const auto& [q, bytes] : plan.states) {
    auto st = opt.state().find(compat::optimizer_state_key(params[q]));
    DTRAIN_ASSERT(st != opt.state().end(), "no optimizer state after loading saved rank 0's");
    torch::serialize::InputArchive in;
    in.load_from(bytes.data(), bytes.size());
    st->second->serialize(in);
  }
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

bool holds_shards(const torch::nn::Module* model) { return model && !fsdp::shard_layouts(*model).empty(); }

std::vector<std::pair<std::string, std::string>> whole_manifest(const torch::nn::Module& model) {
  const Layouts layouts = fsdp::shard_layouts(model);
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
  const Layouts layouts = fsdp::shard_layouts(*st.model);
  check_world_group(*st.model, layouts);
  torch::serialize::OutputArchive a;
  a.write("version", c10::IValue(static_cast<int64_t>(kCheckpointFormatVersion)));
  a.write("step", c10::IValue(st.step));
  a.write("rank", c10::IValue(static_cast<int64_t>(rank)));
  a.write("world_size", c10::IValue(static_cast<int64_t>(world)));
  std::vector<std::string> names;
  for (const auto& kv : st.model->named_parameters()) {
    auto it = layouts.find(kv.value().unsafeGetTensorImpl());
    if (it == layouts.end()) continue;
    // A copy: the shard is a view of its unit's flat storage, which serializing the view would write whole.
    a.write("shard_" + std::to_string(names.size()), it->second.shard.detach().clone(), /*is_buffer=*/true);
    names.push_back(kv.key());
  }
  a.write("names", c10::IValue(lines(names)));
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
  const std::string framed = frame(os.str(), 1);
  const std::string path = shard_path(main_path, rank, world);
  write_atomic(path, framed);
  return framed.substr(0, framed.find('\n'));
}

void encode_sharded_model(torch::serialize::OutputArchive& a, const TrainingState& st,
                          const std::vector<std::string>& shard_headers) {
  const Layouts layouts = fsdp::shard_layouts(*st.model);
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
  a.write("shards", c10::IValue(lines(shard_headers)));
}

bool is_sharded_archive(torch::serialize::InputArchive& a) {
  c10::IValue v;
  return a.try_read("shards", v);
}

void load_sharded_model(torch::serialize::InputArchive& a, TrainingState& st, const std::string& main_path,
                        std::optional<at::Device> device) {
  std::vector<std::pair<at::Tensor, at::Tensor>> copies;  // destination, source
  std::optional<SavedShards> saved;
  OptimizerPlan plan;
  // 1. Everything read and assembled; nothing changes until every rank has all of its part.
  on_every_rank([&] {
    const std::vector<std::string> headers = util::split(read_string(a, "shards", main_path));
    const int world = static_cast<int>(headers.size());
    DTRAIN_CHECK(world >= 1, "checkpoint ", main_path, " names no shard files");
    std::vector<std::pair<std::string, std::string>> files;
    for (int r = 0; r < world; ++r) files.emplace_back(shard_path(main_path, r, world), headers[r]);
    saved.emplace(std::move(files), device);
    const Layouts layouts = fsdp::shard_layouts(*st.model);
    check_world_group(*st.model, layouts);
    std::set<std::string> sharded;  // the parameters the saved world held in shards
    for (const auto& kv : saved->at(0).rows) sharded.insert(kv.first);
    std::map<std::string, Target> targets;
    for (const auto& kv : st.model->named_parameters()) {
      Target t = target_of(kv.key(), kv.value(), layouts);
      if (sharded.count(kv.key())) {
        at::Tensor rows = assemble(*saved, t, kv.value().options(), [&](SavedShard& s) {
          auto it = s.rows.find(kv.key());
          DTRAIN_CHECK(it != s.rows.end(), "checkpoint shard ", s.file, " lacks the rows of '", kv.key(),
                       "' that rank 0's holds");
          return it->second;
        });
        copies.emplace_back(kv.value(), rows.reshape(kv.value().sizes()));
      }
      targets.emplace(kv.key(), std::move(t));
    }
    torch::serialize::InputArchive rep;
    DTRAIN_CHECK(a.try_read("model_replicated", rep), "checkpoint ", main_path, " lacks model_replicated");
    const std::vector<std::string> rep_names = util::split(read_string(rep, "names", main_path));
    std::map<std::string, at::Tensor> replicated;
    for (size_t i = 0; i < rep_names.size(); ++i)
      replicated.emplace(rep_names[i], read_tensor(rep, "t" + std::to_string(i), main_path));
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
    if (world == world_size_or_one() && !layouts.empty()) {  // the exact resume: this rank's own state, as saved
      SavedShard& mine = saved->at(is_initialized() ? rank() : 0);
      DTRAIN_CHECK(mine.optimizer, "checkpoint shard ", mine.file,
                   " holds no optimizer state: it was saved without one; leave TrainingState::optimizer null");
      plan.whole = &*mine.optimizer;
    } else {
      plan = plan_resliced(*st.optimizer, *saved, targets, sharded);
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
