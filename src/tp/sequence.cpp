// SequenceParallel, PrepareModuleInput and PrepareModuleOutput (include/dtrain/tensor_parallel.h),
// and the redistribution between layouts they rest on.
//
// Note [Sequence parallelism without hooks]
// PyTorch applies these three styles with forward hooks and DTensor parameters; LibTorch modules
// have neither forward hooks nor a virtual forward. What each style needs, done otherwise:
//   SequenceParallel: the module's forward is right as it is on a sequence part (it acts on each
//     position alone); what changes is its parameters' gradient, which on each rank holds only that
//     rank's positions. A tensor hook on each parameter (it runs before the gradient accumulates,
//     so DDP, optimizers and clipping see the sum) all-reduces it over the group: PyTorch's Partial
//     -> Replicate of the DTensor gradient. The parameters stay whole (no ShardSpec).
//   PrepareModuleInput/Output: a table from module to style (held weakly, keyed by address) that
//     parallelize_module fills and the module's forward reads through prepare_input/prepare_output.
//     A module that never calls them ignores its style, as a PyTorch module whose forward is called
//     around its hooks would; the header's contract says so.
//   redistribute: a local tensor's gradient is what the loss counts once on every rank; so
//     Shard -> Replicate backward keeps this rank's part of the whole gradient (not a
//     reduce-scatter, which would count it group-size times), as DTensor's to_local then
//     redistribute backward does. A Partial gradient (a ColwiseParallel's input's) is summed where
//     it arises, by that layer's enter_region.
#include <ATen/ATen.h>

#include <mutex>
#include <unordered_map>
#include <unordered_set>

#include "common/util.h"
#include "tp/applied.h"
#include "tp/regions.h"

namespace dtrain {
namespace {

// Parameters that have the gradient hook: a second one would sum the sum again.
std::mutex sp_mu;
std::unordered_map<const c10::TensorImpl*, c10::weak_intrusive_ptr<c10::TensorImpl>>& sp_hooked() {
  static std::unordered_map<const c10::TensorImpl*, c10::weak_intrusive_ptr<c10::TensorImpl>> r;
  return r;
}

// Claims `param` for the hook; false when it has one already.
bool sp_claim(const at::Tensor& param) {
  std::lock_guard<std::mutex> lock(sp_mu);
  auto& r = sp_hooked();
  auto it = r.find(param.unsafeGetTensorImpl());
  if (it != r.end() && !it->second.expired()) return false;  // an expired one was another tensor
  r.insert_or_assign(param.unsafeGetTensorImpl(), c10::weak_intrusive_ptr<c10::TensorImpl>(param.getIntrusivePtr()));
  return true;
}

struct SpPrepared {
  std::string name;  // as the plan named it, for errors
  std::weak_ptr<const torch::nn::Module> module;
  std::optional<PrepareModuleInput> input;
  std::optional<PrepareModuleOutput> output;
  Group group;
};

std::mutex sp_prepared_mu;
std::unordered_map<const torch::nn::Module*, SpPrepared>& sp_prepared() {
  static std::unordered_map<const torch::nn::Module*, SpPrepared> r;
  return r;
}

// The entry of `self`, if any (an entry whose module died belongs to another at the same address).
std::optional<SpPrepared> sp_lookup(const torch::nn::Module& self) {
  std::lock_guard<std::mutex> lock(sp_prepared_mu);
  auto& r = sp_prepared();
  auto it = r.find(&self);
  if (it == r.end()) return std::nullopt;
  if (it->second.module.lock().get() != &self) {
    r.erase(it);
    return std::nullopt;
  }
  return it->second;
}

std::vector<at::Tensor> sp_apply(const char* what, const std::string& module_name, std::vector<at::Tensor> tensors,
                                 const Layouts& from, const Layouts& to, const Group& group) {
  DTRAIN_CHECK(tensors.size() == from.size(), what, ": module '", module_name, "' was given ", tensors.size(),
               " tensors but its layouts name ", from.size(),
               ": pass one tensor per layout (nullopt for one to leave alone)");
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (!from[i] || !to[i] || !tensors[i].defined()) continue;
    tensors[i] = redistribute(tensors[i], *from[i], *to[i], group);
  }
  return tensors;
}

void sp_check_layouts(const std::string& name, const char* style, const Layouts& from, const Layouts& to) {
  DTRAIN_CHECK(from.size() == to.size(), "parallelize_module: '", name, "': ", style, " has ", from.size(),
               " layouts and ", to.size(), " desired layouts: give one desired layout (or nullopt) per layout");
  for (size_t i = 0; i < from.size(); ++i)
    DTRAIN_CHECK(from[i] || !to[i], "parallelize_module: '", name, "': ", style, " desires ", to_string(*to[i]),
                 " for tensor ", i, " whose layout is nullopt: name its layout too");
}

}  // namespace

at::Tensor redistribute(const at::Tensor& local, const Layout& from, const Layout& to, const Group& group) {
  using K = Layout::Kind;
  if (from.kind == K::kReplicate && to.kind == K::kReplicate) return local;
  if (from.kind == K::kShard && to.kind == K::kShard) {
    const int64_t n = local.dim();
    if ((from.dim + n) % n == (to.dim + n) % n) return local;
    return tp::part_dim(tp::gather_dim(local, from.dim, group), to.dim, group);
  }
  if (from.kind == K::kShard) return tp::gather_dim(local, from.dim, group);
  return tp::part_dim(local, to.dim, group);
}

namespace tp {

void apply_sequence_parallel(const std::string& name, torch::nn::Module& module, const Group& group) {
  for (const auto& item : module.named_parameters()) {
    at::Tensor param = item.value();
    const std::string pname = name.empty() ? item.key() : name + "." + item.key();
    const auto spec = shard_spec_of(param);
    DTRAIN_CHECK(!spec, "parallelize_module: '", pname, "' is sharded (", spec ? spec->to_string() : "",
                 "): SequenceParallel keeps a module's parameters whole; give the module one style");
    DTRAIN_CHECK(sp_claim(param), "parallelize_module: '", pname,
                 "' has SequenceParallel already: apply it once per module (its gradient would be summed twice)");
    {
      // Replicated from group rank 0 (dtrain's src_data_rank=0; PyTorch assumes the ones init).
      at::NoGradGuard no_grad;
      at::Tensor whole = param.detach().clone(at::MemoryFormat::Contiguous);
      broadcast(whole, group.ranks()[0], group);
      param.set_data(whole);
    }
    if (!param.requires_grad()) continue;
    param.register_hook([group](const at::Tensor& grad) {
      at::NoGradGuard no_grad;
      at::Tensor sum = grad.clone(at::MemoryFormat::Contiguous);
      all_reduce(sum, ReduceOp::SUM, group);
      return sum;
    });
  }
}

void record_prepare(const std::string& name, const std::shared_ptr<torch::nn::Module>& module,
                    const ParallelStyle& style, const Group& group) {
  std::lock_guard<std::mutex> lock(sp_prepared_mu);
  auto& r = sp_prepared();
  auto it = r.find(module.get());
  if (it == r.end() || it->second.module.lock() != module)
    it = r.insert_or_assign(module.get(), SpPrepared{name, module, std::nullopt, std::nullopt, group}).first;
  SpPrepared& e = it->second;
  DTRAIN_CHECK(e.group.name() == group.name(), "parallelize_module: '", name, "' was prepared over group '",
               e.group.name(), "' already: prepare a module over one group");
  if (const auto* in = std::get_if<PrepareModuleInput>(&style)) {
    sp_check_layouts(name, "PrepareModuleInput", in->input_layouts(), in->desired_input_layouts());
    DTRAIN_CHECK(!e.input, "parallelize_module: '", name, "' has a PrepareModuleInput already: give it one");
    e.input = *in;
  } else {
    const auto& out = std::get<PrepareModuleOutput>(style);
    sp_check_layouts(name, "PrepareModuleOutput", out.output_layouts(), out.desired_output_layouts());
    DTRAIN_CHECK(!e.output, "parallelize_module: '", name, "' has a PrepareModuleOutput already: give it one");
    e.output = out;
  }
}

}  // namespace tp

std::vector<at::Tensor> prepare_input(const torch::nn::Module& self, std::vector<at::Tensor> inputs) {
  const auto e = sp_lookup(self);
  if (!e || !e->input) return inputs;
  return sp_apply("prepare_input", e->name, std::move(inputs), e->input->input_layouts(),
                  e->input->desired_input_layouts(), e->group);
}

at::Tensor prepare_input(const torch::nn::Module& self, const at::Tensor& input) {
  return prepare_input(self, std::vector<at::Tensor>{input})[0];
}

std::vector<at::Tensor> prepare_output(const torch::nn::Module& self, std::vector<at::Tensor> outputs) {
  const auto e = sp_lookup(self);
  if (!e || !e->output) return outputs;
  return sp_apply("prepare_output", e->name, std::move(outputs), e->output->output_layouts(),
                  e->output->desired_output_layouts(), e->group);
}

at::Tensor prepare_output(const torch::nn::Module& self, const at::Tensor& output) {
  return prepare_output(self, std::vector<at::Tensor>{output})[0];
}

}  // namespace dtrain
