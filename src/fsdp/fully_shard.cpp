// fully_shard: making units, the registry that finds them from their modules, the Sequential
// element wrapper, the sharded state dict and gradient clipping over any parameters' cuts (see
// dtrain/fsdp.h).
#include <algorithm>
#include <cmath>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/grad_mode.h>

#include "comm/param_claims.h"
#include "comm/model_sync.h"
#include "common/malloc_threshold.h"
#include "common/util.h"
#include "dtrain/detail/element_wrapper.h"
#include "dtrain/errors.h"
#include "dtrain/fsdp.h"
#include "fsdp/root.h"
#include "fsdp/unit.h"

namespace dtrain::detail::fsdp {
namespace {

struct Entry {
  std::weak_ptr<torch::nn::Module> module;
  std::shared_ptr<Unit> unit;
};

// Units by module, and which unit holds each parameter (by tensor), for the whole process.
struct Registry {
  std::mutex mu;
  std::unordered_map<const torch::nn::Module*, Entry> units;
  std::unordered_map<const c10::TensorImpl*, std::string> holder;  // parameter -> its unit's label

  void drop_dead() {  // units whose module is gone
    for (auto it = units.begin(); it != units.end();) {
      if (it->second.module.expired()) {
        for (auto& p : it->second.unit->params()) holder.erase(p.param.unsafeGetTensorImpl());
        it = units.erase(it);
      } else {
        ++it;
      }
    }
  }
};

Registry& registry() {
  static Registry r;
  return r;
}

std::string describe(const torch::nn::Module& m) { return "'" + m.name() + "'"; }

// The parameters `module` shards: those of its own and of its submodules that are not units, nor ignored;
// names as module->named_parameters() gives them.
std::vector<std::pair<std::string, at::Tensor>> parameters_to_shard(const std::shared_ptr<torch::nn::Module>& module,
                                                                    const std::vector<at::Tensor>& ignored) {
  std::unordered_set<const c10::TensorImpl*> skip;
  for (const at::Tensor& t : ignored) skip.insert(t.unsafeGetTensorImpl());
  auto& reg = registry();
  std::vector<std::string> unit_prefixes;
  for (const auto& item : module->named_modules("", /*include_self=*/false))
    if (reg.units.count(item.value().get())) unit_prefixes.push_back(item.key() + ".");
  auto below_a_unit = [&](const std::string& name) {
    for (const auto& pre : unit_prefixes)
      if (name.rfind(pre, 0) == 0) return true;
    return false;
  };
  std::vector<std::pair<std::string, at::Tensor>> out;
  std::unordered_map<const c10::TensorImpl*, std::string> seen;
  for (const auto& kv : module->named_parameters(/*recurse=*/true)) {
    const at::Tensor& t = kv.value();
    const std::string& name = kv.key();
    if (below_a_unit(name) || skip.count(t.unsafeGetTensorImpl())) continue;
    auto held = reg.holder.find(t.unsafeGetTensorImpl());
    DTRAIN_CHECK(held == reg.holder.end(), "fully_shard(", describe(*module), "): parameter '", name,
                 "' is the same tensor as one that unit '", held->second,
                 "' already shards (tied weights across units): make both users part of one unit (call "
                 "fully_shard on a module that contains both), or untie them");
    auto [it, fresh] = seen.emplace(t.unsafeGetTensorImpl(), name);
    DTRAIN_CHECK(fresh, "fully_shard(", describe(*module), "): parameters '", it->second, "' and '", name,
                 "' are the same tensor (tied weights): fully_shard shards each tensor once; register it "
                 "under one name only");
    DTRAIN_CHECK(at::isFloatingType(t.scalar_type()), "fully_shard(", describe(*module), "): parameter '", name,
                 "' is ", t.scalar_type(), ": only floating-point parameters can be sharded (make it a buffer)");
    // A gradient means backward ran on the whole parameter, and an optimizer may have stepped on it:
    // its state then has the whole shape, which no shard matches (torch fails later, far from here).
    DTRAIN_CHECK(!t.grad().defined(), "fully_shard(", describe(*module), "): parameter '", name,
                 "' already has a gradient: shard the model before its first backward and build the optimizer "
                 "after fully_shard (one that stepped holds state of the whole shape); if none stepped, clear "
                 "the gradients first (optimizer.zero_grad() with set_to_none)");
    if (!out.empty()) {
      const at::Tensor& first = out.front().second;
      DTRAIN_CHECK(first.scalar_type() == t.scalar_type() && first.device() == t.device(), "fully_shard(",
                   describe(*module), "): parameter '", name, "' is ", t.scalar_type(), " on ", t.device(), " but '",
                   out.front().first, "' is ", first.scalar_type(), " on ", first.device(),
                   ": one unit's parameters share a dtype and device (module->to(...) first, or make them "
                   "separate units)");
    }
    out.emplace_back(name, t);
  }
  return out;
}

}  // namespace

std::shared_ptr<Unit> find_unit(const torch::nn::Module* module) {
  auto& reg = registry();
  std::lock_guard<std::mutex> lock(reg.mu);
  auto it = reg.units.find(module);
  if (it == reg.units.end() || it->second.module.expired()) return nullptr;
  return it->second.unit;
}

namespace {

// The group a unit shards over: the mesh's, when one is given (a 2-D mesh's inner dimension, its
// outer one replicating: replicate_group()), else process_group.
FullyShardOptions resolve_group(const torch::nn::Module& module, FullyShardOptions options) {
  const DeviceMesh& mesh = options.mesh();
  if (mesh.ndim() == 0) return options;
  DTRAIN_CHECK(mesh.ndim() <= 2, "fully_shard(", describe(module), "): mesh has ", mesh.ndim(), " dimensions (",
               util::join(mesh.dim_names(), ", "),
               "); it shards over a 1-D mesh or a 2-D (replicate, shard) one: pass the data-parallel dimensions' "
               "sub-mesh, as mesh[{\"",
               mesh.dim_names().rbegin()[1], "\", \"", mesh.dim_names().back(), "\"}]");
  const Group group = mesh.get_group(mesh.dim_names().back());
  DTRAIN_CHECK(options.process_group().name() == Group().name() || options.process_group().name() == group.name(),
               "fully_shard(", describe(module), "): both mesh (group '", group.name(), "') and process_group ('",
               options.process_group().name(), "') are set: set one of the two");
  options.process_group(group);
  return options;
}

// reshard_after_forward(n) as FSDP2's _get_post_forward_mesh_info: n must divide the shard group's
// size N; n = N is true and n = 1 false (FSDP2 warns that 1 means no resharding); otherwise the
// options say true and `post_forward` is the size of the groups the unit keeps its part over.
FullyShardOptions resolve_reshard(const torch::nn::Module& module, FullyShardOptions options, int64_t& post_forward) {
  post_forward = 0;
  const auto& given = options.reshard_after_forward();
  if (!given || !given->is_int()) return options;
  const int64_t n = given->group_size(), size = options.process_group().size();
  DTRAIN_CHECK(n >= 1 && n <= size && size % n == 0, "fully_shard(", describe(module), "): reshard_after_forward(", n,
               ") must divide the shard group's size ", size, " (1 <= n <= ", size,
               "): pass a divisor of it (n ranks keep the parameters between forward and backward), or true / false");
  options.reshard_after_forward(n > 1);
  if (n > 1 && n < size) post_forward = n;
  return options;
}

// Note [Post-forward groups]: the groups of n ranks consecutive within `group` ({0, 1}, {2, 3} of
// 4 for n = 2), as FSDP2's mesh.view(-1, n); made once per group and n (a split is collective over
// `group`, whose ranks make the same units in the same order, so all find it made or not alike).
Group post_forward_group(const Group& group, int64_t n) {
  static std::mutex mu;
  static std::map<std::pair<std::string, int64_t>, Group> made;
  std::lock_guard<std::mutex> lock(mu);
  const auto key = std::make_pair(group.name(), n);
  auto it = made.find(key);
  if (it != made.end()) return it->second;
  const int r = group.rank();
  Group g = split_group(static_cast<int>(r / n), r, group);
  made.emplace(key, g);
  return g;
}

}  // namespace

std::shared_ptr<Unit> make_unit(const std::shared_ptr<torch::nn::Module>& module, const FullyShardOptions& given) {
  DTRAIN_CHECK(module, "fully_shard: the module is null: pass a constructed model");
  DTRAIN_CHECK(is_initialized(), "fully_shard needs a process group: call dtrain::init_process_group() first");
  int64_t post_forward = 0;
  const FullyShardOptions options = resolve_reshard(*module, resolve_group(*module, given), post_forward);
  const Group& group = options.process_group();
  DTRAIN_CHECK(group.is_member(), "fully_shard(", describe(*module), "): rank ", rank(),
               " is not a member of the given process_group: shard the model only on the group's ranks");
  auto& reg = registry();
  std::vector<std::pair<std::string, at::Tensor>> named;
  {
    std::lock_guard<std::mutex> lock(reg.mu);
    reg.drop_dead();
    auto it = reg.units.find(module.get());
    DTRAIN_CHECK(it == reg.units.end(), "fully_shard(", describe(*module),
                 "): this module is already a unit (fully_shard was called on it before): call fully_shard once "
                 "per module");
    for (const auto& m : module->modules(/*include_self=*/false)) {
      auto u = reg.units.find(m.get());
      DTRAIN_CHECK(u == reg.units.end() || !u->second.unit->root, "fully_shard(", describe(*module), "): unit '",
                   u->second.unit->label(),
                   "' below it has already run a forward as its own root: apply fully_shard bottom-up, the root "
                   "last, before the first forward");
    }
    named = parameters_to_shard(module, options.ignored_params());
  }
  std::vector<std::string> names;
  std::vector<at::Tensor> params;
  for (const auto& [n, t] : named) {
    names.push_back(n);
    params.push_back(t);
  }
  const std::optional<Group> replicas = replicate_group(options);
  std::vector<Group> agree{group};
  if (replicas) agree.push_back(*replicas);  // HSDP: the replicas must hold the same model too
  for (const Group& g : agree) {
    comm::verify_same_model(names, params, g, detail::cat("fsdp/", g.name(), "/", g.next_object_index(), "/model/"),
                            detail::cat("fully_shard(", describe(*module), ")"));
  }
  comm::claim_parameters(names, params, detail::cat("fully_shard unit ", describe(*module)),
                         "a model is either fully_shard'ed or wrapped by DistributedDataParallel, not both: "
                         "build the DDP-free model and call fully_shard on it");
  // Before the whole parameters are freed (Note [Sharding and glibc's mmap threshold]).
  if (!params.empty() && params.front().device().is_cpu()) settle_malloc_for_sharding();
  at::Tensor flat;
  auto sharded = shard_parameters(std::move(named), group, replicas, flat);
  auto unit = std::make_shared<Unit>(module, std::move(sharded), std::move(flat), options);
  if (post_forward > 0) unit->set_post_forward_group(post_forward_group(group, post_forward));
  std::lock_guard<std::mutex> lock(reg.mu);
  for (auto& p : unit->params()) reg.holder[p.param.unsafeGetTensorImpl()] = unit->label();
  reg.units[module.get()] = Entry{module, unit};
  return unit;
}

namespace {

// The units of `module` and below, in module order.
std::vector<std::shared_ptr<Unit>> units_under(const torch::nn::Module& module) {
  std::vector<std::shared_ptr<Unit>> out;
  for (const auto& m : module.modules(/*include_self=*/true))
    if (auto u = find_unit(m.get())) out.push_back(u);
  return out;
}

// A torch::nn::Sequential element run as a unit (fully_shard(AnyModule&)): the unit is made of the
// module the Sequential's tree holds, and `inner` (that module, or a wrapper put in its place, which
// then runs inside the unit) runs in the unit's forward (Note [Elements wrapped in place]).
class ShardedElementImpl : public torch::nn::Module, public ElementWrapper {
 public:
  ShardedElementImpl(torch::nn::AnyModule inner, std::shared_ptr<Unit> unit)
      : inner_(std::move(inner)), unit_(std::move(unit)) {}
  at::Tensor forward(at::Tensor x) {
    ForwardScope scope(unit_);
    at::Tensor out = inner_.forward(std::move(x));
    scope.finish({out});
    return out;
  }
  std::shared_ptr<torch::nn::Module> wrapped() const override { return inner_.ptr(); }

 private:
  torch::nn::AnyModule inner_;
  std::shared_ptr<Unit> unit_;
};

}  // namespace

}  // namespace dtrain::detail::fsdp

// The user-facing functions (FSDPModule's methods, for any module type).
namespace dtrain::fsdp {

using detail::fsdp::describe;
using detail::fsdp::find_unit;
using detail::fsdp::units_under;

void unshard(const torch::nn::Module& module) {
  auto unit = find_unit(&module);
  DTRAIN_CHECK(unit, "unshard(", describe(module), "): the module is not a unit: call fully_shard on it first");
  unit->unshard();
  unit->watch_zero_grad();
}

void reshard(const torch::nn::Module& module) {
  auto unit = find_unit(&module);
  DTRAIN_CHECK(unit, "reshard(", describe(module), "): the module is not a unit: call fully_shard on it first");
  unit->reshard();
}

void set_requires_gradient_sync(const torch::nn::Module& module, bool requires_sync, bool recurse) {
  if (!recurse) {
    auto unit = find_unit(&module);
    DTRAIN_CHECK(unit, "set_requires_gradient_sync(", describe(module),
                 "): the module is not a unit: call fully_shard on it first");
    unit->set_requires_gradient_sync(requires_sync);
    return;
  }
  for (auto& u : units_under(module)) u->set_requires_gradient_sync(requires_sync);
}

int64_t received_bytes(const torch::nn::Module& module) {
  int64_t total = 0;
  for (auto& u : units_under(module)) total += u->received_bytes();
  return total;
}

int64_t gathered_bytes(const torch::nn::Module& module) {
  int64_t total = 0;
  for (auto& u : units_under(module)) total += u->gathered_bytes();
  return total;
}

int64_t prefetched_gathers(const torch::nn::Module& module) {
  int64_t total = 0;
  for (auto& u : units_under(module)) total += u->prefetched_gathers();
  return total;
}

std::vector<std::pair<std::string, at::Tensor>> sharded_state_dict(torch::nn::Module& module) {
  std::unordered_map<const c10::TensorImpl*, at::Tensor> shards;
  for (auto& u : units_under(module))
    for (auto& p : u->params()) shards[p.param.unsafeGetTensorImpl()] = p.shard;
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& kv : module.named_parameters()) {
    auto it = shards.find(kv.value().unsafeGetTensorImpl());
    out.emplace_back(kv.key(), it == shards.end() ? kv.value() : it->second);
  }
  return out;
}

}  // namespace dtrain::fsdp

namespace dtrain {

// Note [Elements wrapped in place]
// A Sequential element replaced in place (checkpoint_wrapper(element), fully_shard(element)) stays
// registered in the Sequential as itself: the Sequential's forward calls the wrapper, but its module
// tree, and so its parameters' names and the root's search for units below it, hold the element. A
// unit made of the wrapper would be outside that tree, and the root would find the element's
// parameters claimed by a unit it does not hold. So fully_shard of an element makes the unit of the
// module the tree holds behind any such wrappers (detail::module_in_tree), and runs the element as it
// is, wrappers included, inside the unit's forward: an element checkpointed in place then recomputes
// inside its unit, whose pre-backward gather brings the parameters back first, as a
// CheckpointWrapper pushed into a Sequential and made a unit does, and its parameters keep the
// Sequential's names.
void fully_shard(torch::nn::AnyModule& element, const FullyShardOptions& options) {
  DTRAIN_CHECK(!element.is_empty(), "fully_shard: the Sequential element is empty");
  auto unit = detail::fsdp::make_unit(detail::module_in_tree(element.ptr()), options);
  element =
      torch::nn::AnyModule(std::make_shared<detail::fsdp::ShardedElementImpl>(std::move(element), std::move(unit)));
}

namespace {

// Note [Clipping over cuts]
// The total norm is that of the whole gradients, as torch.nn.utils.clip_grad_norm_ over DTensors
// computes it: the part of a gradient cut over groups G1..Gk (its ShardSpec) is a partial sum of
// |g|^p that the other parts, held by the ranks that differ along G1..Gk, complete, so its sum is
// all-reduced over each of them in turn (over tp, then over dp, covers the tp x dp parts); a part
// left whole along a group (a Replicate placement: fully_shard's RMSNorm weight across tp, a shard
// across HSDP's replicas) is the same on every rank of that group and is not reduced over it, so it
// counts once. The parameters are grouped by the set of groups their parts are cut over, one sum per
// set, and each group reduces, in one all-reduce, the sums of the sets that contain it.
// The members of a group must agree on which sums it reduces and in what order, and every rank
// must reduce over its groups in one order (blocking all-reduces over, say, tp then dp on one rank
// and dp then tp on another wait on each other). The groups themselves differ between ranks: rank 0
// and rank 2 of a {dp 2, tp 2} mesh each have their own tp group. What they share is the group's
// layout: a group is named by its ranks relative to its first, the same for every group of one mesh
// dimension ([0, 1] for tp, [0, 2] for dp), and distinct between dimensions. Sets and all-reduces are
// ordered by those names, so every rank of a model cut alike does the same all-reduces in the same
// order. A group of one rank reduces nothing and is left out.
// Pipeline stages are not cuts: the ranks of a pipeline group hold different parameters, each
// stage's cut alike over its own tp and dp groups (which lie inside one stage). So the stages' sets
// need not match, and no ShardSpec can say "this parameter lives on this stage alone"; the caller
// names the pipeline group (pp_group) and each rank's completed total is summed over it last.
using ClipGroupName = std::vector<int>;
using ClipGroupSet = std::vector<ClipGroupName>;  // sorted, unique

ClipGroupName clip_group_name(const Group& g) {
  ClipGroupName out;
  for (int r : g.ranks()) out.push_back(r - g.ranks().front());
  return out;
}

std::string clip_ranks_string(const std::vector<int>& ranks) {
  std::string out = "[";
  for (size_t i = 0; i < ranks.size(); ++i) out += (i ? ", " : "") + std::to_string(ranks[i]);
  return out + "]";
}

// The groups this rank's parameters are cut over, by name (Note [Clipping over cuts]).
class ClipGroups {
 public:
  // The set of groups `param`'s gradient is cut over: its spec's, or, without one, `fallback` (the
  // caller's group, where given).
  ClipGroupSet of(const at::Tensor& param, const std::optional<Group>& fallback) {
    ClipGroupSet set;
    if (const auto spec = shard_spec_of(param))
      for (const ShardCut& c : spec->cuts()) add(c.group, set);
    else if (fallback)
      add(*fallback, set);
    std::sort(set.begin(), set.end());
    set.erase(std::unique(set.begin(), set.end()), set.end());
    return set;
  }
  const std::map<ClipGroupName, Group>& by_name() const { return groups_; }

 private:
  void add(const Group& g, ClipGroupSet& set) {
    if (g.size() < 2) return;
    ClipGroupName name = clip_group_name(g);
    auto [it, added] = groups_.emplace(name, g);
    DTRAIN_CHECK(added || it->second.ranks() == g.ranks(), "clip_grad_norm_: rank ", rank(),
                 "'s parameters are cut over groups of ranks ", clip_ranks_string(it->second.ranks()), " and ",
                 clip_ranks_string(g.ranks()), ", laid out alike: cut them over the dimensions of one DeviceMesh");
    set.push_back(std::move(name));
  }
  std::map<ClipGroupName, Group> groups_;
};

// Adds |grad|^p's sum (its max, for an infinite norm) into `acc`, a 1-element double tensor, with no
// synchronization with the gradient's device.
void clip_accumulate(at::Tensor& acc, const at::Tensor& grad, double norm_type) {
  if (grad.numel() == 0) return;
  const at::Tensor a = grad.detach().abs().to(at::kDouble);
  if (std::isinf(norm_type))
    acc = at::maximum(acc, a.max().reshape({1}).to(acc.device()));
  else
    acc += a.pow(norm_type).sum().reshape({1}).to(acc.device());
}

}  // namespace

double clip_grad_norm_(const std::vector<at::Tensor>& parameters, double max_norm, double norm_type,
                       const std::optional<Group>& group, const std::optional<Group>& pp_group) {
  DTRAIN_CHECK(max_norm >= 0, "clip_grad_norm_: max_norm must be >= 0, got ", max_norm);
  DTRAIN_CHECK(norm_type > 0, "clip_grad_norm_: norm_type must be > 0 (or infinity), got ", norm_type);
  torch::NoGradGuard no_grad;
  const bool inf = std::isinf(norm_type);
  const at::TensorOptions options = at::TensorOptions().dtype(at::kDouble).device(collective_device());
  // Every parameter's set counts, with a gradient or not, so that the sums each group reduces are
  // the same on all its members even where one rank's part of a gradient is undefined.
  ClipGroups groups;
  std::map<ClipGroupSet, at::Tensor> sums;
  std::vector<at::Tensor> grads;
  for (const at::Tensor& p : parameters) {
    at::Tensor& acc = sums[groups.of(p, group)];
    if (!acc.defined()) acc = at::zeros({1}, options);
    if (!p.grad().defined()) continue;
    grads.push_back(p.grad());
    clip_accumulate(acc, p.grad(), norm_type);
  }
  for (const auto& [name, g] : groups.by_name()) {  // one all-reduce per group, in name order
    std::vector<at::Tensor*> reduced;
    std::vector<at::Tensor> parts;
    for (auto& [set, acc] : sums)
      if (std::binary_search(set.begin(), set.end(), name)) {
        reduced.push_back(&acc);
        parts.push_back(acc);
      }
    at::Tensor batch = at::cat(parts).to(collective_device(g));
    all_reduce(batch, inf ? ReduceOp::MAX : ReduceOp::SUM, g);
    for (size_t i = 0; i < reduced.size(); ++i) *reduced[i] = batch.narrow(0, static_cast<int64_t>(i), 1);
  }
  std::vector<at::Tensor> all;
  for (const auto& kv : sums) all.push_back(kv.second.to(options.device()));
  const at::Tensor joined = all.empty() ? at::zeros({1}, options) : at::cat(all);
  at::Tensor reduced = (inf ? joined.max() : joined.sum()).reshape({1});
  if (pp_group && pp_group->size() > 1) {
    // The stages' parameters are disjoint: their totals add up (Note [Clipping over cuts]).
    reduced = reduced.to(collective_device(*pp_group));
    all_reduce(reduced, inf ? ReduceOp::MAX : ReduceOp::SUM, *pp_group);
  }
  double total = reduced.item<double>();
  if (!inf) total = std::pow(total, 1.0 / norm_type);
  const double coef = max_norm / (total + 1e-6);
  if (coef < 1)
    for (at::Tensor& g : grads) g.mul_(coef);
  return total;
}

}  // namespace dtrain
