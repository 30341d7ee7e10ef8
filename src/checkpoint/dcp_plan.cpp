// The plan of dcp::save: what each rank holds, who writes what, and the metadata that follows.
#include "checkpoint/dcp_plan.h"

#include <algorithm>
#include <set>
#include <sstream>

#include "checkpoint/dtypes.h"
#include "dtrain/errors.h"

namespace dtrain::dcp::detail {

namespace {

std::string shape_text(const Shape& s) {
  std::string out;
  for (int64_t d : s) out += (out.empty() ? "" : ",") + std::to_string(d);
  return out;
}

Shape parse_shape(const std::string& s) {
  Shape out;
  std::istringstream in(s);
  std::string part;
  while (std::getline(in, part, ',')) out.push_back(std::stoll(part));
  return out;
}

std::string path_text(const Path& p) {
  std::string out;
  for (const PathElem& e : p) out += (out.empty() ? "" : "\x1f") + (e.is_int ? "i" + std::to_string(e.i) : "s" + e.s);
  return out;
}

Path parse_path(const std::string& s) {
  Path out;
  std::istringstream in(s);
  std::string part;
  while (std::getline(in, part, '\x1f')) {
    PathElem e;
    e.is_int = !part.empty() && part[0] == 'i';
    if (e.is_int)
      e.i = std::stoll(part.substr(1));
    else
      e.s = part.substr(1);
    out.push_back(e);
  }
  return out;
}

std::string whole_text(const PlanItem& p) {
  return p.is_tensor ? p.dtype + " [" + shape_text(p.global) + "]" : "a value";
}

}  // namespace

std::vector<PlanItem> plan_of(const StateDict& sd) {
  std::vector<PlanItem> plan;
  std::set<std::pair<std::string, std::optional<Shape>>> seen;
  for (size_t k = 0; k < sd.size(); ++k) {
    const Entry& e = sd[k];
    PlanItem p;
    p.fqn = e.key();
    DTRAIN_CHECK(p.fqn.find_first_of("\t\n\x1f") == std::string::npos, "dcp::save: the key '", p.fqn,
                 "' holds a tab, a newline or \\x1f: rename it");
    for (const auto& elem : e.path) {
      PathElem pe;
      pe.is_int = std::holds_alternative<int64_t>(elem);
      if (pe.is_int)
        pe.i = std::get<int64_t>(elem);
      else
        pe.s = std::get<std::string>(elem);
      p.path.push_back(pe);
    }
    p.is_tensor = e.is_tensor();
    if (p.is_tensor) {
      p.dtype = ckpt::torch_dtype_name(e.tensor.scalar_type());
      p.sizes = e.tensor.sizes().vec();
      p.global = e.global_shape.empty() ? p.sizes : e.global_shape;
      p.offsets = e.global_shape.empty() ? Shape(p.sizes.size(), 0) : e.offsets;
      DTRAIN_CHECK(p.offsets.size() == p.global.size() && p.global.size() == p.sizes.size(),
                   "dcp::save: the chunk of '", p.fqn, "' has ", p.sizes.size(), " dimensions, its offsets ",
                   p.offsets.size(), " and its whole shape ", p.global.size(), ": give one of each per dimension");
      for (size_t d = 0; d < p.sizes.size(); ++d)
        DTRAIN_CHECK(p.offsets[d] >= 0 && p.offsets[d] + p.sizes[d] <= p.global[d], "dcp::save: the chunk of '", p.fqn,
                     "' at offset ", p.offsets[d], " of size ", p.sizes[d], " in dimension ", d,
                     " does not fit its whole shape [", shape_text(p.global), "]");
      p.bytes = static_cast<int64_t>(e.tensor.numel() * e.tensor.element_size());
    }
    DTRAIN_CHECK(seen.insert(p.id()).second, "dcp::save: the key '", p.fqn, "' is in the state dict twice");
    p.entry = static_cast<int>(k);
    plan.push_back(std::move(p));
  }
  return plan;
}

std::string encode_plan(const std::vector<PlanItem>& plan) {
  std::string out;
  for (const PlanItem& p : plan)
    out += std::string(p.is_tensor ? "T" : "V") + "\t" + p.fqn + "\t" + p.dtype + "\t" + shape_text(p.global) + "\t" +
           shape_text(p.offsets) + "\t" + shape_text(p.sizes) + "\t" + std::to_string(p.bytes) + "\t" +
           path_text(p.path) + "\n";
  return out;
}

std::vector<PlanItem> decode_plan(const std::string& text) {
  std::vector<PlanItem> plan;
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    std::vector<std::string> f;
    std::istringstream fields(line);
    std::string x;
    while (std::getline(fields, x, '\t')) f.push_back(x);
    f.resize(8);
    PlanItem p;
    p.is_tensor = f[0] == "T";
    p.fqn = f[1];
    p.dtype = f[2];
    p.global = parse_shape(f[3]);
    p.offsets = parse_shape(f[4]);
    p.sizes = parse_shape(f[5]);
    p.bytes = f[6].empty() ? 0 : std::stoll(f[6]);
    p.path = parse_path(f[7]);
    plan.push_back(std::move(p));
  }
  return plan;
}

// Note [Replicas cut unlike]: ranks that hold the same rows need not cut them alike. A model sharded
// over replica groups of different sizes (on 3 ranks: {0, 1} and {2}) has rank 2 hold a whole
// weight that ranks 0 and 1 hold in two chunks. DCP's metadata lists chunks that do not overlap, each
// stored once, so one cut is kept and the others' chunks are neither written nor listed: per key,
// starting from each distinct chunk in the order of the ranks, the chunks that do not overlap those
// already taken are added in that order, and the first start whose chunks cover the whole tensor
// wins. Every rank computes it from the same gathered plans, so all agree. Chunks that are equal or
// disjoint everywhere (one cut, or replicas cut alike) are left as they are.
namespace {

using Box = std::pair<Shape, Shape>;  // offsets, sizes

bool disjoint(const Box& a, const Box& b) {
  for (size_t d = 0; d < a.first.size() && d < b.first.size(); ++d)
    if (a.first[d] + a.second[d] <= b.first[d] || b.first[d] + b.second[d] <= a.first[d]) return true;
  return false;
}

int64_t volume(const Shape& sizes) {
  int64_t v = 1;
  for (int64_t s : sizes) v *= s;
  return v;
}

// The chunks of one key to keep, from its distinct chunks in rank order.
std::set<Box> cover(const std::string& key, const std::vector<Box>& boxes, const Shape& whole) {
  bool clean = true;
  for (size_t i = 0; i < boxes.size() && clean; ++i)
    for (size_t j = i + 1; j < boxes.size() && clean; ++j) clean = disjoint(boxes[i], boxes[j]);
  if (clean) return std::set<Box>(boxes.begin(), boxes.end());
  for (size_t start = 0; start < boxes.size(); ++start) {
    std::vector<Box> taken{boxes[start]};
    int64_t covered = volume(boxes[start].second);
    for (const Box& b : boxes)
      if (std::all_of(taken.begin(), taken.end(), [&](const Box& t) { return disjoint(t, b); })) {
        taken.push_back(b);
        covered += volume(b.second);
      }
    if (covered == volume(whole)) return std::set<Box>(taken.begin(), taken.end());
  }
  throw Error("dcp::save: the ranks' chunks of '" + key + "' overlap, and no set of them covers [" + shape_text(whole) +
              "] once: cut the tensor alike on the ranks that hold the same part of it");
}

}  // namespace

void drop_overlapping_chunks(std::vector<std::vector<PlanItem>>& plans) {
  std::map<std::string, std::vector<Box>> boxes;  // distinct, in rank order
  std::map<std::string, Shape> whole;
  for (const auto& plan : plans)
    for (const PlanItem& p : plan) {
      if (!p.is_tensor) continue;
      auto& b = boxes[p.fqn];
      const Box box{p.offsets, p.sizes};
      if (std::find(b.begin(), b.end(), box) == b.end()) b.push_back(box);
      whole.emplace(p.fqn, p.global);
    }
  std::map<std::string, std::set<Box>> kept;
  for (const auto& [key, b] : boxes) kept[key] = cover(key, b, whole[key]);
  for (auto& plan : plans)
    for (PlanItem& p : plan)
      if (p.is_tensor) p.dropped = !kept[p.fqn].count(Box{p.offsets, p.sizes});
}

std::vector<std::vector<size_t>> assign_writers(const std::vector<std::vector<PlanItem>>& plans) {
  // Every item's holders, in the order items first appear (rank order, then each rank's order).
  std::map<std::pair<std::string, std::optional<Shape>>, size_t> slot;
  std::vector<std::vector<std::pair<int, size_t>>> holders;
  std::map<std::string, std::pair<int, const PlanItem*>> first_of_key;
  for (size_t r = 0; r < plans.size(); ++r) {
    for (size_t k = 0; k < plans[r].size(); ++k) {
      const PlanItem& p = plans[r][k];
      if (p.dropped) continue;
      auto [it, fresh] = first_of_key.insert({p.fqn, {static_cast<int>(r), &p}});
      const PlanItem& q = *it->second.second;
      DTRAIN_CHECK(fresh || (p.is_tensor == q.is_tensor && p.dtype == q.dtype && p.global == q.global),
                   "dcp::save: ranks disagree on '", p.fqn, "': rank ", it->second.first, " has ", whole_text(q),
                   ", rank ", r, " ", whole_text(p), ": every rank must describe the same whole tensor");
      auto [s, added] = slot.insert({p.id(), holders.size()});
      if (added) holders.emplace_back();
      const auto& h = holders[s->second];
      if (!h.empty()) {
        const PlanItem& other = plans[static_cast<size_t>(h[0].first)][h[0].second];
        DTRAIN_CHECK(other.sizes == p.sizes, "dcp::save: ranks ", h[0].first, " and ", r, " hold chunks of '", p.fqn,
                     "' at offsets [", shape_text(p.offsets), "] of sizes [", shape_text(other.sizes), "] and [",
                     shape_text(p.sizes), "]: a chunk must be the same on every rank that holds it");
      }
      holders[s->second].push_back({static_cast<int>(r), k});
    }
  }
  std::vector<int64_t> load(plans.size(), 0);
  std::vector<std::vector<size_t>> writes(plans.size());
  for (const auto& h : holders) {
    auto best = h.front();
    for (const auto& c : h)
      if (load[static_cast<size_t>(c.first)] < load[static_cast<size_t>(best.first)]) best = c;
    load[static_cast<size_t>(best.first)] += plans[static_cast<size_t>(best.first)][best.second].bytes;
    writes[static_cast<size_t>(best.first)].push_back(best.second);
  }
  return writes;
}

Metadata metadata_of(const std::vector<std::vector<PlanItem>>& plans,
                     const std::vector<std::vector<std::pair<size_t, StorageInfo>>>& written) {
  Metadata m;
  std::set<std::pair<std::string, Shape>> chunks;
  for (const auto& plan : plans) {
    for (const PlanItem& p : plan) {
      if (p.dropped) continue;
      m.paths[p.fqn] = p.path;
      if (!p.is_tensor) {
        if (std::find(m.values.begin(), m.values.end(), p.fqn) == m.values.end()) m.values.push_back(p.fqn);
        continue;
      }
      TensorMeta& t = m.tensors[p.fqn];
      t.dtype = p.dtype;
      t.size = p.global;
      if (chunks.insert({p.fqn, p.offsets}).second) t.chunks.push_back({p.offsets, p.sizes});
    }
  }
  for (size_t r = 0; r < written.size(); ++r) {
    for (const auto& [k, info] : written[r]) {
      const PlanItem& p = plans[r][k];
      Item item;
      item.fqn = p.fqn;
      if (p.is_tensor) item.offsets = p.offsets;
      item.storage = info;
      m.items.push_back(item);
    }
  }
  return m;
}

}  // namespace dtrain::dcp::detail
