// dcp::get_state_dict and set_state_dict (dtrain/dcp.h): a model and its optimizer under PyTorch's
// keys, so that a Python model and optimizer of the same architecture load them by name.
//
// PyTorch's get_state_dict names an optimizer's state by parameter name ("optim.state.fc.weight.
// exp_avg"), not by index, and its param_groups' "params" by the parameters' names too. Its groups
// carry every option Python's optimizer has; those LibTorch's lacks are written with the values that
// make Python compute what LibTorch does (maximize False, foreach and fused None, ...), and a loaded
// checkpoint that asks for anything else is refused.
#include <algorithm>
#include <cmath>
#include <map>
#include <unordered_map>

#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include "compat/optim_compat.h"
#include "dtrain/dcp.h"
#include "dtrain/errors.h"
#include "dtrain/shard_spec.h"
#include "dtrain/zero.h"

namespace dtrain::dcp {

namespace {

// Where a tensor of a parameter's shape sits in the whole: whole, or the box of it this rank holds
// (the parameter's ShardSpec, whatever sharded it: fully_shard's rows, a tensor-parallel part along
// dim 0 or 1, or fully_shard's rows of a tensor-parallel part), a DTensor's chunk.
struct Placement {
  std::vector<int64_t> whole;  // empty: whole
  std::vector<int64_t> offsets;
  bool empty = false;  // this rank holds nothing of it (the last ranks of a short parameter)
};

struct ModelNames {
  std::unordered_map<const c10::TensorImpl*, std::string> name;
  std::unordered_map<const c10::TensorImpl*, Placement> place;
};

Entry entry_at(Path path, const at::Tensor& t, const Placement& p) {
  if (p.whole.empty()) return Entry::whole(std::move(path), t);
  return Entry::chunk(std::move(path), t, p.whole, p.offsets);
}

// The model's names and placements; with `sd`, its entries too.
ModelNames add_model(StateDict* sd, torch::nn::Module& model) {
  ModelNames names;
  for (const auto& kv : model.named_parameters()) {
    const at::Tensor& p = kv.value();
    const auto* impl = p.unsafeGetTensorImpl();
    names.name[impl] = kv.key();
    Placement place;
    // A 0-dim parameter cut as one element stays whole here, as before: DCP has no chunk of a 0-dim tensor.
    if (auto spec = shard_spec_of(p); spec && spec->is_sharded() && !spec->full_shape().empty()) {
      place.whole = spec->full_shape();
      place.offsets = spec->offsets();
      place.empty = spec->holds_nothing() || p.numel() == 0;
    }
    names.place[impl] = place;
    if (sd && !place.empty) sd->push_back(entry_at({"model", kv.key()}, p.detach(), place));
  }
  if (sd)
    for (const auto& kv : model.named_buffers()) sd->push_back(Entry::whole({"model", kv.key()}, kv.value().detach()));
  return names;
}

template <class Value>
void add_value(StateDict& sd, size_t group, const char* name, Value v) {
  sd.push_back(Entry::of_value({"optim", "param_groups", static_cast<int64_t>(group), name}, c10::IValue(v)));
}

// Python's Adam and AdamW groups: LibTorch's options, and Python's others at what LibTorch computes.
template <class Options>
void add_adam_group(StateDict& sd, size_t g, const Options& o, bool decoupled) {
  add_value(sd, g, "lr", o.lr());
  add_value(sd, g, "betas", std::make_tuple(std::get<0>(o.betas()), std::get<1>(o.betas())));
  add_value(sd, g, "eps", o.eps());
  add_value(sd, g, "weight_decay", o.weight_decay());
  add_value(sd, g, "amsgrad", o.amsgrad());
  add_value(sd, g, "maximize", false);
  add_value(sd, g, "foreach", c10::IValue());
  add_value(sd, g, "capturable", false);
  add_value(sd, g, "differentiable", false);
  add_value(sd, g, "fused", c10::IValue());
  add_value(sd, g, "decoupled_weight_decay", decoupled);
}

void add_sgd_group(StateDict& sd, size_t g, const torch::optim::SGDOptions& o) {
  add_value(sd, g, "lr", o.lr());
  add_value(sd, g, "momentum", o.momentum());
  add_value(sd, g, "dampening", o.dampening());
  add_value(sd, g, "weight_decay", o.weight_decay());
  add_value(sd, g, "nesterov", o.nesterov());
  add_value(sd, g, "maximize", false);
  add_value(sd, g, "foreach", c10::IValue());
  add_value(sd, g, "differentiable", false);
  add_value(sd, g, "fused", c10::IValue());
}

// An Adam or AdamW state, made (zero, step 0: what the first step would make) when absent.
template <class State>
State& adam_state(torch::optim::Optimizer& opt, const at::Tensor& p, bool amsgrad) {
  auto& states = opt.state();
  const auto key = compat::optimizer_state_key(p);
  auto it = states.find(key);
  if (it == states.end()) {
    auto s = std::make_unique<State>();
    s->step(0);
    s->exp_avg(at::zeros_like(p, at::MemoryFormat::Preserve));
    s->exp_avg_sq(at::zeros_like(p, at::MemoryFormat::Preserve));
    if (amsgrad) s->max_exp_avg_sq(at::zeros_like(p, at::MemoryFormat::Preserve));
    it = states.insert({key, std::move(s)}).first;
  }
  return static_cast<State&>(*it->second);
}

// A fully_shard unit gathered right now holds whole parameters (over its group) while their
// optimizer state keeps the shards' shape: no placement describes both.
void check_gathered(const std::string& name, const at::Tensor& p, const at::Tensor& state) {
  DTRAIN_CHECK(state.sizes() == p.sizes(), "dcp::get_state_dict: parameter '", name, "' is ", p.sizes(),
               " but its optimizer state is ", state.sizes(),
               ": its fully_shard unit is gathered right now (between forward and backward, or after unshard()); "
               "save between steps");
}

template <class State>
void add_adam_state(StateDict& sd, const std::string& name, const at::Tensor& p, const Placement& place, State& s) {
  check_gathered(name, p, s.exp_avg());
  const Path base{"optim", "state", name};
  auto path = [&](const char* k) {
    Path p = base;
    p.emplace_back(std::string(k));
    return p;
  };
  // Python keeps the step as a 0-dim float tensor; the same on every rank that holds the parameter.
  sd.push_back(Entry::whole(path("step"), at::full({}, static_cast<double>(s.step()), at::kFloat)));
  sd.push_back(entry_at(path("exp_avg"), s.exp_avg(), place));
  sd.push_back(entry_at(path("exp_avg_sq"), s.exp_avg_sq(), place));
  if (s.max_exp_avg_sq().defined()) sd.push_back(entry_at(path("max_exp_avg_sq"), s.max_exp_avg_sq(), place));
}

// The optimizer whose state tensors live here: a ZeroRedundancyOptimizer's wrapped one.
torch::optim::Optimizer& holder_of(torch::optim::Optimizer& opt) {
  if (auto* z = dynamic_cast<ZeroRedundancyOptimizer*>(&opt)) return z->local_optimizer();
  return opt;
}

void add_optimizer(StateDict& sd, torch::optim::Optimizer& opt, const ModelNames& names) {
  torch::optim::Optimizer& holder = holder_of(opt);
  auto name_of = [&](const at::Tensor& p) {
    auto it = names.name.find(p.unsafeGetTensorImpl());
    DTRAIN_CHECK(it != names.name.end(), "dcp::get_state_dict: the optimizer holds a parameter of shape ", p.sizes(),
                 " that is not the model's: build the optimizer on model->parameters()");
    return it->second;
  };
  for (auto& group : holder.param_groups()) {
    for (const at::Tensor& p : group.params()) {
      const Placement& place = names.place.at(p.unsafeGetTensorImpl());
      if (place.empty) continue;
      if (auto* o = dynamic_cast<torch::optim::AdamOptions*>(&group.options()))
        add_adam_state(sd, name_of(p), p, place, adam_state<torch::optim::AdamParamState>(holder, p, o->amsgrad()));
      else if (auto* w = dynamic_cast<torch::optim::AdamWOptions*>(&group.options()))
        add_adam_state(sd, name_of(p), p, place, adam_state<torch::optim::AdamWParamState>(holder, p, w->amsgrad()));
      else if (dynamic_cast<torch::optim::SGDOptions*>(&group.options()))
        if (auto it = holder.state().find(compat::optimizer_state_key(p)); it != holder.state().end())
          if (auto& buf = static_cast<torch::optim::SGDParamState&>(*it->second).momentum_buffer(); buf.defined())
            sd.push_back(entry_at({"optim", "state", name_of(p), "momentum_buffer"}, buf, place));
    }
  }
  for (size_t g = 0; g < opt.param_groups().size(); ++g) {
    auto& group = opt.param_groups()[g];
    c10::List<std::string> params;
    for (const at::Tensor& p : group.params()) params.push_back(name_of(p));
    add_value(sd, g, "params", params);
    if (auto* o = dynamic_cast<torch::optim::AdamOptions*>(&group.options()))
      add_adam_group(sd, g, *o, false);
    else if (auto* w = dynamic_cast<torch::optim::AdamWOptions*>(&group.options()))
      add_adam_group(sd, g, *w, true);
    else if (auto* s = dynamic_cast<torch::optim::SGDOptions*>(&group.options()))
      add_sgd_group(sd, g, *s);
    else
      throw Error(
          "dcp::get_state_dict: the optimizer is neither Adam, AdamW nor SGD (or a ZeroRedundancyOptimizer "
          "over one of them), whose state PyTorch's keys describe");
  }
}

// ---- set_state_dict --------------------------------------------------------------------------------

class Loaded {
 public:
  explicit Loaded(const StateDict& sd) {
    for (const Entry& e : sd) by_key_[e.key()] = &e;
  }
  const Entry* find(const std::string& key) const {
    auto it = by_key_.find(key);
    return it == by_key_.end() ? nullptr : it->second;
  }
  const c10::IValue& value(size_t g, const char* name) const {
    const std::string key = "optim.param_groups." + std::to_string(g) + "." + name;
    const Entry* e = find(key);
    DTRAIN_CHECK(e && !e->is_tensor(), "dcp::set_state_dict: the state dict has no value '", key, "'");
    return e->value;
  }
  double number(size_t g, const char* name) const {
    const c10::IValue& v = value(g, name);
    DTRAIN_CHECK(v.isDouble() || v.isInt(), "dcp::set_state_dict: optim.param_groups.", g, ".", name,
                 " is not a number");
    return v.isDouble() ? v.toDouble() : static_cast<double>(v.toInt());
  }
  bool flag(size_t g, const char* name) const {
    const c10::IValue& v = value(g, name);
    DTRAIN_CHECK(v.isBool(), "dcp::set_state_dict: optim.param_groups.", g, ".", name, " is not a bool");
    return v.toBool();
  }
  // An option LibTorch's optimizer lacks must be what it computes anyway.
  void require_false(size_t g, const char* name) const {
    const Entry* e = find("optim.param_groups." + std::to_string(g) + "." + name);
    DTRAIN_CHECK(!e || e->value.isNone() || (e->value.isBool() && !e->value.toBool()),
                 "dcp::set_state_dict: the checkpoint's optimizer has ", name, "=True in param group ", g,
                 ", which LibTorch's optimizer does not do: save it with ", name, "=False");
  }

 private:
  std::map<std::string, const Entry*> by_key_;
};

template <class Options>
void set_adam_group(Options& o, const Loaded& l, size_t g) {
  o.lr(l.number(g, "lr"));
  const c10::IValue& b = l.value(g, "betas");
  DTRAIN_CHECK(b.isTuple() && b.toTuple()->elements().size() == 2, "dcp::set_state_dict: optim.param_groups.", g,
               ".betas is not a pair");
  o.betas(std::make_tuple(b.toTuple()->elements()[0].toDouble(), b.toTuple()->elements()[1].toDouble()));
  o.eps(l.number(g, "eps"));
  o.weight_decay(l.number(g, "weight_decay"));
  o.amsgrad(l.flag(g, "amsgrad"));
  l.require_false(g, "maximize");
  l.require_false(g, "capturable");
}

void set_steps(torch::optim::Optimizer& holder, const Loaded& l, const ModelNames& names) {
  for (auto& group : holder.param_groups()) {
    for (const at::Tensor& p : group.params()) {
      auto it = holder.state().find(compat::optimizer_state_key(p));
      if (it == holder.state().end()) continue;
      const Entry* step = l.find("optim.state." + names.name.at(p.unsafeGetTensorImpl()) + ".step");
      if (!step) continue;
      const auto n = static_cast<int64_t>(std::llround(step->tensor.item<double>()));
      if (auto* a = dynamic_cast<torch::optim::AdamParamState*>(it->second.get())) a->step(n);
      if (auto* w = dynamic_cast<torch::optim::AdamWParamState*>(it->second.get())) w->step(n);
    }
  }
}

}  // namespace

StateDict get_state_dict(torch::nn::Module& model, torch::optim::Optimizer* optimizer) {
  StateDict sd;
  const ModelNames names = add_model(&sd, model);
  if (optimizer) add_optimizer(sd, *optimizer, names);
  return sd;
}

void set_state_dict(torch::nn::Module& model, torch::optim::Optimizer* optimizer, const StateDict& state_dict) {
  if (!optimizer) return;  // the model's tensors were loaded in place
  const ModelNames names = add_model(nullptr, model);
  const Loaded l(state_dict);
  for (size_t g = 0; g < optimizer->param_groups().size(); ++g) {
    auto& options = optimizer->param_groups()[g].options();
    if (auto* o = dynamic_cast<torch::optim::AdamOptions*>(&options)) {
      set_adam_group(*o, l, g);
    } else if (auto* w = dynamic_cast<torch::optim::AdamWOptions*>(&options)) {
      set_adam_group(*w, l, g);
    } else if (auto* s = dynamic_cast<torch::optim::SGDOptions*>(&options)) {
      s->lr(l.number(g, "lr"));
      s->momentum(l.number(g, "momentum"));
      s->dampening(l.number(g, "dampening"));
      s->weight_decay(l.number(g, "weight_decay"));
      s->nesterov(l.flag(g, "nesterov"));
      l.require_false(g, "maximize");
    }
  }
  torch::optim::Optimizer& holder = holder_of(*optimizer);
  if (&holder != optimizer)  // a ZeroRedundancyOptimizer's wrapped optimizer follows its groups
    for (size_t g = 0; g < holder.param_groups().size() && g < optimizer->param_groups().size(); ++g)
      holder.param_groups()[g].set_options(optimizer->param_groups()[g].options().clone());
  set_steps(holder, l, names);
}

}  // namespace dtrain::dcp
