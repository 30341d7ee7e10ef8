// Sharded checkpoints, the load side: the saved shard files' layouts, the pieces a rank reads, and
// the files themselves (see saved_shards.h).
#include "checkpoint/saved_shards.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <sstream>

#include "checkpoint/file_io.h"
#include "checkpoint/sharded.h"
#include "common/util.h"
#include "dtrain/errors.h"
#include "dtrain/process_group.h"
#include "optim/state_device.h"

namespace dtrain::ckpt {

std::pair<int64_t, int64_t> rows_of(int64_t rows, int64_t g, int64_t n) {
  const int64_t chunk = (rows + n - 1) / n;
  const int64_t lo = std::min(rows, g * chunk);
  return {lo, std::min(rows, lo + chunk)};
}

std::string encode_layout(const FileLayout& layout) {
  std::ostringstream s;
  for (size_t i = 0; i < layout.size();) {
    size_t j = i;
    while (j < layout.size() && layout[j] == layout[i]) ++j;
    s << (i ? " " : "") << layout[i].rank << "/" << layout[i].size;
    if (layout[i].dim != 0) s << "@" << layout[i].dim;
    s << "*" << j - i;
    i = j;
  }
  return s.str();
}

FileLayout decode_layout(const std::string& text, const std::string& file) {
  FileLayout out;
  std::istringstream in(text);
  for (std::string run; in >> run;) {
    ShardGroup g;
    long long count = 0;
    char slash = 0, star = 0;
    std::istringstream r(run);
    bool ok = static_cast<bool>(r >> g.rank >> slash >> g.size) && slash == '/';
    if (ok && r.peek() == '@') ok = static_cast<bool>(r.get() && r >> g.dim) && g.dim >= 0;
    ok = ok && static_cast<bool>(r >> star >> count) && r.peek() == EOF && star == '*' && g.size >= 1 && g.rank >= 0 &&
         g.rank < g.size && count >= 1;
    DTRAIN_CHECK(ok, "checkpoint ", file, " records the shard layout '", text,
                 "', which is not \"<group rank>/<group size>[@<dim>]*<parameters> ...\": it was damaged or "
                 "written by another program");
    out.insert(out.end(), static_cast<size_t>(count), g);
  }
  return out;
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

namespace {

// The optimizer's archive (LibTorch's format: param_groups/<i>/params/<j> name each parameter's entry
// in "state" by a key of the saving process).
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

// The framed file at `path`, whose header line must be `header`, parsed.
// Its tensors are read onto the CPU (optim/state_device.h).
void load_shard_archive(const std::string& path, const std::string& header, torch::serialize::InputArchive& a) {
  std::string bytes;
  try {
    bytes = util::read_file(path, "checkpoint shard");
  } catch (const std::exception& e) {
    throw Error(detail::cat("rank ", is_initialized() ? rank() : 0, " cannot read ", util::one_line(e.what()),
                            ": every rank reads the shard files of a sharded checkpoint, so on several nodes the "
                            "checkpoint folder must be one they share"));
  }
  DTRAIN_CHECK(bytes.substr(0, bytes.find('\n')) == header, "checkpoint shard ", path,
               " is not the one its main file names (another save's, or replaced): restore the folder's files "
               "of that save together");
  try {
    const std::string payload = unframe(bytes);
    a = optim_state::parse_on_cpu(payload);
  } catch (const std::exception& e) {
    throw Error(detail::cat("checkpoint shard ", path, " is unusable: ", util::one_line(e.what())));
  }
}

}  // namespace

SavedShards::SavedShards(torch::serialize::InputArchive& main, const std::string& main_path) {
  const std::vector<std::string> headers = util::split(read_string(main, "shards", main_path));
  const int64_t world = static_cast<int64_t>(headers.size());
  DTRAIN_CHECK(world >= 1, "checkpoint ", main_path, " names no shard files");
  c10::IValue probe;
  const bool recorded = main.try_read("shard_layouts", probe);
  std::vector<std::string> layouts;
  if (recorded) {
    layouts = util::split(read_string(main, "shard_layouts", main_path));
    names_ = util::split(read_string(main, "shard_names", main_path));
    DTRAIN_CHECK(layouts.size() == headers.size(), "checkpoint ", main_path, " records the layouts of ", layouts.size(),
                 " shard files but names ", headers.size(), ": it was damaged or written by another program");
  }
  for (int64_t r = 0; r < world; ++r) {
    File f;
    f.path = shard_path(main_path, static_cast<int>(r), static_cast<int>(world));
    f.header = headers[static_cast<size_t>(r)];
    f.recorded = recorded;
    if (recorded) {
      f.layout = decode_layout(layouts[static_cast<size_t>(r)], main_path);
      DTRAIN_CHECK(f.layout.size() == names_.size(), "checkpoint ", main_path, " records the layout of ",
                   f.layout.size(), " parameters for ", f.path, " but shards ", names_.size(),
                   ": it was damaged or written by another program");
    }
    files_.push_back(std::move(f));
  }
  cache_.resize(files_.size());
  if (recorded) return;
  at(0);  // the names
  for (int64_t r = 0; r < world; ++r) files_[static_cast<size_t>(r)].layout.assign(names_.size(), ShardGroup{r, world});
}

SavedShard SavedShards::read(const File& f) {
  torch::serialize::InputArchive a;
  load_shard_archive(f.path, f.header, a);
  SavedShard s;
  s.file = f.path;
  const std::vector<std::string> names = util::split(read_string(a, "names", f.path));
  if (names_.empty()) names_ = names;  // file 0 of a save that did not record them
  DTRAIN_CHECK(names == names_, "checkpoint shard ", f.path, " holds the rows of ", names.size(),
               " parameters, not of the ", names_.size(),
               " its main file names: restore the folder's files of that save together");
  if (f.recorded) {
    const std::string layout = read_string(a, "layout", f.path);
    DTRAIN_CHECK(layout == encode_layout(f.layout), "checkpoint shard ", f.path, " records the layout '", layout,
                 "', its main file '", encode_layout(f.layout), "': restore the folder's files of that save together");
  }
  for (size_t i = 0; i < names.size(); ++i)
    s.rows.emplace(names[i], read_tensor(a, "shard_" + std::to_string(i), f.path));
  torch::serialize::InputArchive opt;
  if (a.try_read("optimizer", opt)) {
    s.opt_names = util::split(read_string(a, "optimizer_params", f.path));
    s.opt_state = read_optimizer_state(opt);
    s.optimizer = std::move(opt);
  }
  return s;
}

SavedShard& SavedShards::at(int64_t k) {
  auto& slot = cache_[static_cast<size_t>(k)];
  if (!slot) slot = std::make_unique<SavedShard>(read(files_[static_cast<size_t>(k)]));
  return *slot;
}

SavedShard& SavedShards::any_read() {
  for (auto& slot : cache_)
    if (slot) return *slot;
  return at(0);
}

std::vector<Piece> plan_pieces(const SavedShards& saved, size_t p, const Target& t, int64_t own) {
  if (t.lo >= t.hi) return {};
  const int64_t rows = t.shape[static_cast<size_t>(t.group.dim)];
  for (int64_t k = 0; k < saved.count(); ++k)
    DTRAIN_CHECK(saved.group(k, p).dim == t.group.dim, "the shard files of the checkpoint hold '", t.name,
                 "' sharded along different dimensions: it was damaged or written by another program");
  auto piece = [&](int64_t k, int64_t lo, int64_t hi) {
    const ShardGroup& g = saved.group(k, p);
    const auto [klo, khi] = rows_of(rows, g.rank, g.size);
    return Piece{k, lo, hi, klo, khi};
  };
  // The exact resume reads its own file: bit for bit what it saved.
  if (own < saved.count() && saved.group(own, p) == t.group) return {piece(own, t.lo, t.hi)};
  for (int64_t k = 0; k < saved.count(); ++k)
    if (saved.group(k, p) == t.group) return {piece(k, t.lo, t.hi)};
  std::vector<Piece> out;
  for (int64_t row = t.lo; row < t.hi;) {
    int64_t best = -1, reach = row;
    for (int64_t k = 0; k < saved.count(); ++k) {
      const ShardGroup& g = saved.group(k, p);
      const auto [klo, khi] = rows_of(rows, g.rank, g.size);
      if (klo <= row && khi > reach) {
        best = k;
        reach = khi;
      }
    }
    DTRAIN_CHECK(best >= 0, "no shard file of the checkpoint holds row ", row, " of '", t.name,
                 "' (their recorded layouts leave it out): it was damaged or written by another program");
    out.push_back(piece(best, row, std::min(t.hi, reach)));
    row = out.back().hi;
  }
  return out;
}

at::Tensor assemble(SavedShards& saved, const Target& t, const std::vector<Piece>& pieces,
                    const at::TensorOptions& options, const std::function<at::Tensor(SavedShard&)>& of) {
  std::vector<at::Tensor> parts;
  for (const Piece& pc : pieces) {
    SavedShard& s = saved.at(pc.file);
    at::Tensor part = of(s);
    const int64_t held = pc.file_hi - pc.file_lo, dim = t.group.dim;
    DTRAIN_CHECK(part.dim() > dim && part.size(dim) == held, "checkpoint shard ", s.file, " holds ",
                 part.dim() > dim ? part.size(dim) : 0, " rows of '", t.name, "' along dim ", dim, ", not the ", held,
                 " of its layout");
    parts.push_back(part.narrow(dim, pc.lo - pc.file_lo, pc.hi - pc.lo));
  }
  if (parts.empty()) {
    std::vector<int64_t> shape = t.shape;
    shape[static_cast<size_t>(t.group.dim)] = 0;
    return at::empty(shape, options);
  }
  return parts.size() == 1 ? parts[0] : at::cat(parts, t.group.dim);
}

}  // namespace dtrain::ckpt
