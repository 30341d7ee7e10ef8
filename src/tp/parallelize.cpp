// parallelize_module: match the plan's names to submodules, then shard each one's parameters.
//
// Per plan entry, in order, on every rank of the group:
//   1. Find the submodules whose named_modules() name matches (a "*" stands for one name between
//      dots); an entry that matches nothing is an error, as is a module that is not a
//      ParallelLinear or ParallelEmbedding (with the remedy for torch::nn::Linear and Embedding).
//   2. Check the layouts this layer and style accept (any size: torch.chunk's parts, maybe unequal).
//   3. Broadcast each parameter whole from group rank 0 (PyTorch's src_data_rank=0), then keep this
//      rank's part through set_data, so the parameter keeps its identity, and publish its ShardSpec
//      (Note [Published shard specs]); a replicated bias is broadcast alone and has none.
//   SequenceParallel, PrepareModuleInput and PrepareModuleOutput apply to any module instead
//   (src/tp/sequence.cpp, Note [Sequence parallelism without hooks]).
#include <ATen/ATen.h>

#include <tuple>

#include "comm/shard_groups.h"
#include "comm/shard_specs.h"
#include "common/util.h"
#include "tp/applied.h"

namespace dtrain {

std::string to_string(const Layout& layout) {
  return layout.kind == Layout::Kind::kReplicate ? "Replicate()" : detail::cat("Shard(", layout.dim, ")");
}

namespace {

bool matches(const std::string& pattern, const std::string& name) {
  const auto p = util::split(pattern, '.'), n = util::split(name, '.');
  if (p.size() != n.size()) return false;
  for (size_t i = 0; i < p.size(); ++i)
    if (p[i] != "*" && p[i] != n[i]) return false;
  return true;
}

constexpr int64_t kWhole = -1;  // shard()'s dim for a replicated parameter

// Step 3 for one parameter: the whole tensor from group rank 0, then this rank's part along dim.
void shard(const std::string& name, at::Tensor& param, int64_t dim, const tp::Applied& a) {
  // A parameter sharded already (fully_shard first, or parallelize_module twice) would be cut as if
  // its part were the whole.
  const auto spec = shard_spec_of(param);
  DTRAIN_CHECK(!spec, "parallelize_module: '", name, "' is sharded already (", spec ? spec->to_string() : "",
               "): call parallelize_module once, before fully_shard");
  at::NoGradGuard no_grad;
  at::Tensor whole = param.detach().clone(at::MemoryFormat::Contiguous);
  broadcast(whole, a.group.ranks()[0], a.group);
  if (dim == kWhole) {
    param.set_data(whole);
    return;
  }
  param.set_data(whole.narrow(dim, a.start, a.length).clone(at::MemoryFormat::Contiguous));
  comm::publish_shard_spec(param, ShardSpec(whole.sizes().vec()).cut(dim, a.start, a.length, a.group));
  comm::add_shard_group(param, a.group);  // GradScaler's overflow flag spans the group
}

// This rank's part of `size` rows or columns, as torch.chunk cuts them.
void set_part(tp::Applied& a, int64_t size) {
  a.size = size;
  std::tie(a.start, a.length) = ShardSpec::chunk(size, a.group.size(), a.group.rank());
}

tp::Applied bind(const std::string& name, const ParallelStyle& style, const Group& group, bool embedding) {
  tp::Applied a;
  a.group = group;
  if (const auto* c = std::get_if<ColwiseParallel>(&style)) {
    a.input = c->input_layouts();
    a.output = c->output_layouts();
    DTRAIN_CHECK(a.output.kind == Layout::Kind::kReplicate || a.output.dim == -1, "parallelize_module: '", name,
                 "': ColwiseParallel output_layouts ", to_string(a.output),
                 " is not supported: Shard(-1) (the default) or Replicate()");
    DTRAIN_CHECK(!embedding || a.input.kind == Layout::Kind::kReplicate, "parallelize_module: '", name,
                 "': an Embedding's indices are whole on every rank: input_layouts must be Replicate()");
  } else {
    const auto& r = std::get<RowwiseParallel>(style);
    a.colwise = false;
    a.input = r.input_layouts();
    a.output = r.output_layouts();
    DTRAIN_CHECK(a.input.kind == Layout::Kind::kReplicate || embedding || a.input.dim == -1, "parallelize_module: '",
                 name, "': RowwiseParallel input_layouts ", to_string(a.input),
                 " is not supported for a Linear: Shard(-1) (the default) or Replicate()");
  }
  return a;
}

void apply_linear(const std::string& name, ParallelLinearImpl& m, const ParallelStyle& style, const Group& group) {
  tp::Applied a = bind(name, style, group, false);
  const int64_t dim = a.colwise ? 0 : 1;
  set_part(a, m.weight.size(dim));
  shard(name + ".weight", m.weight, dim, a);
  if (m.bias.defined()) shard(name + ".bias", m.bias, a.colwise ? 0 : kWhole, a);
  detail::TensorParallelAccess::applied(m) = std::make_shared<tp::Applied>(a);
}

void apply_embedding(const std::string& name, ParallelEmbeddingImpl& m, const ParallelStyle& style,
                     const Group& group) {
  const auto& o = m.options;
  DTRAIN_CHECK(!o.padding_idx() && !o.max_norm() && !o.sparse(), "parallelize_module: '", name,
               "': an Embedding with padding_idx, max_norm or sparse gradients cannot be sharded yet: drop them");
  tp::Applied a = bind(name, style, group, true);
  const int64_t dim = a.colwise ? 1 : 0;
  set_part(a, m.weight.size(dim));
  shard(name + ".weight", m.weight, dim, a);
  detail::TensorParallelAccess::applied(m) = std::make_shared<tp::Applied>(a);
}

std::string names_of(torch::nn::Module& module) {
  std::vector<std::string> names;
  for (const auto& item : module.named_modules("", /*include_self=*/false)) names.push_back("'" + item.key() + "'");
  return util::join(names, ", ");
}

}  // namespace

void parallelize_module(torch::nn::Module& module, const Group& group, const ParallelizePlan& plan) {
  DTRAIN_CHECK(group.is_member(), "parallelize_module: rank ", rank(), " is not a member of group '", group.name(),
               "': call it on the group's ranks only");
  for (const auto& [pattern, style] : plan) {
    int found = 0;
    for (const auto& item : module.named_modules("", /*include_self=*/false)) {
      if (!matches(pattern, item.key())) continue;
      ++found;
      const std::string& name = item.key();
      torch::nn::Module* m = item.value().get();
      if (std::holds_alternative<SequenceParallel>(style)) {
        tp::apply_sequence_parallel(name, *m, group);
      } else if (std::holds_alternative<PrepareModuleInput>(style) ||
                 std::holds_alternative<PrepareModuleOutput>(style)) {
        tp::record_prepare(name, item.value(), style, group);
      } else if (auto* linear = dynamic_cast<ParallelLinearImpl*>(m)) {
        apply_linear(name, *linear, style, group);
      } else if (auto* embedding = dynamic_cast<ParallelEmbeddingImpl*>(m)) {
        apply_embedding(name, *embedding, style, group);
      } else {
        const bool plain = dynamic_cast<torch::nn::LinearImpl*>(m) || dynamic_cast<torch::nn::EmbeddingImpl*>(m);
        throw Error(
            detail::cat("parallelize_module: '", name, "' is a ", m->name(), ", which ",
                        plain ? "LibTorch gives no hook to change the forward of: declare it as "
                                "dtrain::ParallelLinear or dtrain::ParallelEmbedding (the same options, "
                                "parameters and state dict)"
                              : "ColwiseParallel and RowwiseParallel do not support: use a dtrain::ParallelLinear or "
                                "dtrain::ParallelEmbedding"));
      }
    }
    DTRAIN_CHECK(found > 0, "parallelize_module: the plan's '", pattern, "' matches no submodule; the submodules are ",
                 names_of(module));
  }
}

void parallelize_module(torch::nn::Module& module, const DeviceMesh& mesh, const ParallelizePlan& plan) {
  DTRAIN_CHECK(mesh.ndim() == 1, "parallelize_module: the mesh has ", mesh.ndim(),
               " dimensions: pass the tensor-parallel one, e.g. mesh[\"tp\"]");
  parallelize_module(module, mesh.get_group(), plan);
}

}  // namespace dtrain
