// ShardSpec: how a tensor is cut over process groups. One description for every layer that shards
// a parameter (parallelize_module, fully_shard, both) and everything that reads shards (dcp's
// chunks, full_state_dict, CheckpointManager), as a DTensor's spec is in PyTorch.
//
//   auto mesh = dtrain::init_device_mesh({2, 2}, {"dp", "tp"});
//   dtrain::parallelize_module(*mlp, mesh["tp"], {{"w1", dtrain::ColwiseParallel()}});
//   dtrain::fully_shard(mlp, dtrain::FullyShardOptions().mesh(mesh["dp"]));
//   std::optional<dtrain::ShardSpec> s = dtrain::shard_spec_of(mlp->w1->weight);
//   // w1.weight [16, 8]: cut on dim 0 over tp (rows 8 t .. 8 t + 8), then on dim 0 of that part
//   // over dp (4 of those 8 rows): s->offsets() == {8 t + 4 d, 0}, s->local_sizes() == {4, 8}.
//   auto whole = dtrain::full_state_dict(*mlp);   // collective: every tensor whole, on every rank
//
// A ShardSpec is the full shape and a list of cuts, outermost first. Each cut splits the tensor
// that the cuts before it left on this rank along one dimension into group.size() parts as
// torch.chunk cuts (ceil(size / n) each, the last ones shorter or empty: PyTorch's uneven Shard),
// and this rank keeps part group.rank(). Tensor parallelism inside fully_shard is two cuts, TP's
// (dim 0 or 1 over the tp group) and then fully_shard's (dim 0 of TP's part over the dp group), as
// FSDP2 builds its spec on a TP DTensor. Whatever the cuts, this rank holds one box of the full
// tensor (offsets(), local_sizes()). A 0-dim tensor is cut as the one element of shape [1], as
// fully_shard shards it.
//
// The spec published for a parameter (shard_spec_of) describes its data as it is now: while a
// fully_shard unit is gathered (between its forward and backward, or after unshard()), its
// parameters are whole over its group, and their spec is TP's alone (or none).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

#include "dtrain/process_group.h"

namespace torch::nn {
class Module;
}

namespace dtrain {

// One cut: `dim` of a tensor whose length along it is `size`, this rank keeping [offset, offset + length).
struct ShardCut {
  int64_t dim = 0;
  int64_t size = 0;    // the length along dim before this cut (the part the cuts before left)
  int64_t offset = 0;  // this rank's part, within [0, size)
  int64_t length = 0;
  Group group;  // the parts are its ranks', in group-rank order
};

class ShardSpec {
 public:
  ShardSpec() = default;
  explicit ShardSpec(std::vector<int64_t> full_shape) : full_shape_(std::move(full_shape)) {}

  // This spec with one more cut: `dim` of this rank's box (local_sizes()) in torch.chunk's parts
  // over `group`, this rank keeping group.rank()'s; or the part given (offset, length).
  ShardSpec cut(int64_t dim, const Group& group) const;
  ShardSpec cut(int64_t dim, int64_t offset, int64_t length, const Group& group) const;

  const std::vector<int64_t>& full_shape() const { return full_shape_; }
  const std::vector<ShardCut>& cuts() const { return cuts_; }  // outermost first
  bool is_sharded() const { return !cuts_.empty(); }
  // This rank's box in the full tensor: where it starts along each dimension, and its sizes (the
  // shape of the local tensor). A cut 0-dim tensor has a box of one dimension.
  std::vector<int64_t> offsets() const;
  std::vector<int64_t> local_sizes() const;
  bool holds_nothing() const;     // some cut left this rank an empty part
  std::string to_string() const;  // "[16, 8] dim 0: 8+8 of 16 over 'tp', dim 0: 4+4 of 8 over 'dp'"

  // torch.chunk's part `index` of `size` in `parts`: {offset, length}; past the end {size, 0}.
  static std::pair<int64_t, int64_t> chunk(int64_t size, int64_t parts, int64_t index);

 private:
  std::vector<int64_t> full_shape_;
  std::vector<ShardCut> cuts_;
};

// The spec published for `tensor` (a parameter that parallelize_module or fully_shard sharded),
// or none: the tensor is whole on every rank that holds it.
std::optional<ShardSpec> shard_spec_of(const at::Tensor& tensor);
// The sharded parameters of `module` and their specs, by name as named_parameters() gives them.
std::vector<std::pair<std::string, ShardSpec>> shard_specs(const torch::nn::Module& module);

// Collective over the groups of the module's specs: every parameter and buffer of `module`, whole,
// by name as named_parameters() then named_buffers() give them, on every rank, in the dtype of
// its shards (a copy). Each sharded parameter is put together by undoing its cuts innermost first,
// an all-gather along the cut's dimension over its group (each part padded to the ceil chunk,
// trimmed after). Works for fully_shard, parallelize_module and both; every rank of their groups
// calls it. A unit gathered right now contributes its parameters as gathered (its param dtype).
std::vector<std::pair<std::string, at::Tensor>> full_state_dict(torch::nn::Module& module);

}  // namespace dtrain
