// ShardSpec (dtrain/shard_spec.h), the registry of published specs (comm/shard_specs.h), and the
// whole state put together from any sharding.
//
// Note [Published shard specs]
// Each layer that shards a parameter publishes its ShardSpec here, keyed by the parameter's
// TensorImpl (parameters keep their identity: both layers replace their data with set_data), and
// readers (dcp's chunks, full_state_dict, CheckpointManager) read only the spec, never the layer:
// fsdp/ and tp/ do not know each other, and a reader needs no code per combination.
//   - parallelize_module publishes its cut when it keeps this rank's part (from the whole shape it
//     holds then; later the parameter may have fully_shard's shape, so no reader derives the full
//     shape from sizes()).
//   - fully_shard keeps the spec it found (TP's, or none: the parameter was whole) as the unit's
//     base, and publishes the base with its own cut of dim 0 added, outermost first as FSDP2 builds
//     its spec on a TP DTensor.
//   - The published spec describes the data as it is now. While a unit is gathered (unshard: its
//     forward until its backward, or unshard() until reshard()), its parameters hold TP's local
//     tensors, so the unit publishes its base again (withdraws the spec if none) and publishes the
//     composed spec at reshard. A reader at any moment then sees sizes() == local_sizes().
// The registry holds a weak reference to each TensorImpl: a freed tensor's address cannot be
// reused by another tensor, which would inherit its spec, while the entry exists (the weak
// reference keeps the TensorImpl's memory, not its data), and entries whose tensor died are dropped
// at every publish.
#include "comm/shard_specs.h"

#include <algorithm>
#include <iterator>
#include <mutex>
#include <sstream>
#include <unordered_map>

#include <ATen/ATen.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/nn/module.h>

#include "dtrain/errors.h"

namespace dtrain {

std::pair<int64_t, int64_t> ShardSpec::chunk(int64_t size, int64_t parts, int64_t index) {
  const int64_t each = parts > 0 ? (size + parts - 1) / parts : size;
  const int64_t start = std::min(size, index * each);
  return {start, std::min(size, start + each) - start};
}

namespace {
// The sizes a cut applies to: this rank's box, a 0-dim tensor's being its one element ([1]).
std::vector<int64_t> cuttable(std::vector<int64_t> local) { return local.empty() ? std::vector<int64_t>{1} : local; }
}  // namespace

ShardSpec ShardSpec::cut(int64_t dim, const Group& group) const {
  const std::vector<int64_t> local = cuttable(local_sizes());
  const int64_t size = dim >= 0 && dim < static_cast<int64_t>(local.size()) ? local[static_cast<size_t>(dim)] : 0;
  const auto [offset, length] = chunk(size, group.size(), group.rank());
  return cut(dim, offset, length, group);
}

ShardSpec ShardSpec::cut(int64_t dim, int64_t offset, int64_t length, const Group& group) const {
  const std::vector<int64_t> local = cuttable(local_sizes());
  DTRAIN_CHECK(dim >= 0 && dim < static_cast<int64_t>(local.size()), "ShardSpec: cannot cut dim ", dim,
               " of a tensor of local shape ", at::IntArrayRef(local), ": pass a dimension in [0, ", local.size(), ")");
  const int64_t size = local[static_cast<size_t>(dim)];
  DTRAIN_CHECK(offset >= 0 && length >= 0 && offset + length <= size, "ShardSpec: the part [", offset, ", ",
               offset + length, ") of dim ", dim, " lies outside its length ", size, ": pass a part within it");
  ShardSpec out = *this;
  out.cuts_.push_back(ShardCut{dim, size, offset, length, group});
  return out;
}

std::vector<int64_t> ShardSpec::local_sizes() const {
  std::vector<int64_t> sizes = full_shape_;
  if (sizes.empty() && !cuts_.empty()) sizes = {1};
  for (const ShardCut& c : cuts_) sizes[static_cast<size_t>(c.dim)] = c.length;
  return sizes;
}

std::vector<int64_t> ShardSpec::offsets() const {
  std::vector<int64_t> at(std::max<size_t>(full_shape_.size(), cuts_.empty() ? 0 : 1), 0);
  for (const ShardCut& c : cuts_) at[static_cast<size_t>(c.dim)] += c.offset;  // each cut within the last one's part
  return at;
}

bool ShardSpec::holds_nothing() const {
  return std::any_of(cuts_.begin(), cuts_.end(), [](const ShardCut& c) { return c.length == 0; });
}

std::string ShardSpec::to_string() const {
  std::ostringstream s;
  s << at::IntArrayRef(full_shape_);
  for (size_t i = 0; i < cuts_.size(); ++i) {
    const ShardCut& c = cuts_[i];
    s << (i ? ", " : " ") << "dim " << c.dim << ": [" << c.offset << ", " << c.offset + c.length << ") of " << c.size
      << " over '" << c.group.name() << "'";
  }
  return s.str();
}

namespace {

struct PublishedSpec {
  c10::weak_intrusive_ptr<c10::TensorImpl> tensor;
  ShardSpec spec;
};

struct SpecRegistry {
  std::mutex mu;
  std::unordered_map<const c10::TensorImpl*, PublishedSpec> by_tensor;
  size_t live_at_sweep = 0;  // entries after the last sweep of dead ones
};

SpecRegistry& spec_registry() {
  static SpecRegistry r;
  return r;
}

// A 16-bit float tensor as its bytes: a gather moves bits without arithmetic, and Gloo in LibTorch
// 1.13 has no bfloat16 (nor int16) collectives.
at::Tensor gathered_as(const at::Tensor& t) { return t.element_size() == 2 ? t.view(at::kByte) : t; }

// Undoes one cut: every member's part along c.dim, padded to the ceil chunk (the parts of
// torch.chunk differ in length at the end), all-gathered over the cut's group, trimmed.
at::Tensor undo_cut(const at::Tensor& part, const ShardCut& c) {
  const int64_t n = c.group.size(), chunk = (c.size + n - 1) / n;
  const at::Tensor moved = part.movedim(c.dim, 0);
  std::vector<int64_t> shape = moved.sizes().vec();
  shape[0] = chunk;
  at::Tensor padded = at::zeros(shape, part.options());
  padded.narrow(0, 0, c.length).copy_(moved);
  shape[0] = n * chunk;
  at::Tensor all = at::empty(shape, part.options());
  // Every member of the group has the same sizes but along dim (they share the outer cuts), so all
  // skip an empty gather alike.
  if (all.numel() > 0) {
    at::Tensor out = gathered_as(all);
    all_gather_into_tensor(out, gathered_as(padded), c.group);
  }
  return all.narrow(0, 0, c.size).movedim(0, c.dim).contiguous();
}

at::Tensor whole_of(const at::Tensor& local, const ShardSpec& spec) {
  at::Tensor t = local.detach();
  if (t.dim() == 0) t = t.reshape({1});
  for (auto c = spec.cuts().rbegin(); c != spec.cuts().rend(); ++c) t = undo_cut(t, *c);
  return t.reshape(spec.full_shape());
}

}  // namespace

std::optional<ShardSpec> shard_spec_of(const at::Tensor& tensor) {
  if (!tensor.defined()) return std::nullopt;
  SpecRegistry& r = spec_registry();
  std::lock_guard<std::mutex> lock(r.mu);
  auto it = r.by_tensor.find(tensor.unsafeGetTensorImpl());
  if (it == r.by_tensor.end() || it->second.tensor.expired()) return std::nullopt;
  return it->second.spec;
}

std::vector<std::pair<std::string, ShardSpec>> shard_specs(const torch::nn::Module& module) {
  std::vector<std::pair<std::string, ShardSpec>> out;
  for (const auto& kv : module.named_parameters())
    if (auto spec = shard_spec_of(kv.value()); spec && spec->is_sharded()) out.emplace_back(kv.key(), *spec);
  return out;
}

std::vector<std::pair<std::string, at::Tensor>> full_state_dict(torch::nn::Module& module) {
  torch::NoGradGuard no_grad;
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& kv : module.named_parameters()) {
    const auto spec = shard_spec_of(kv.value());
    out.emplace_back(kv.key(), spec && spec->is_sharded() ? whole_of(kv.value(), *spec) : kv.value().detach().clone());
  }
  for (const auto& kv : module.named_buffers()) out.emplace_back(kv.key(), kv.value().detach().clone());
  return out;
}

namespace comm {

void publish_shard_spec(const at::Tensor& param, std::optional<ShardSpec> spec) {
  SpecRegistry& r = spec_registry();
  std::lock_guard<std::mutex> lock(r.mu);
  // fully_shard publishes twice a step per parameter: sweep only once the map has doubled, so a
  // publish costs O(1) amortized.
  if (r.by_tensor.size() >= std::max<size_t>(64, 2 * r.live_at_sweep)) {
    for (auto it = r.by_tensor.begin(); it != r.by_tensor.end();)
      it = it->second.tensor.expired() ? r.by_tensor.erase(it) : std::next(it);
    r.live_at_sweep = r.by_tensor.size();
  }
  if (!spec) {
    r.by_tensor.erase(param.unsafeGetTensorImpl());
    return;
  }
  r.by_tensor.insert_or_assign(
      param.unsafeGetTensorImpl(),
      PublishedSpec{c10::weak_intrusive_ptr<c10::TensorImpl>(param.getIntrusivePtr()), std::move(*spec)});
}

}  // namespace comm
}  // namespace dtrain
