// DeviceMesh: named dimensions over the world, one group per dimension (include/dtrain/device_mesh.h).
//
// Construction, on every rank:
//   1. Check the arguments (the product of the shape is the world size, the names are unique).
//   2. Agree: all-gather a description of the call ("mesh #k: shape [2, 2], dims [dp, tp]", k = the
//      world's object index) and compare, as the rendezvous check compares world sizes. Ranks that
//      build meshes in different orders, or different meshes, stop here with one line naming a
//      differing rank and both calls; no group has been built.
//   3. For each dimension in order, split the world: the color is this rank's position along the
//      other dimensions, so the ranks that differ only along this dimension meet in one group.
#include "dtrain/device_mesh.h"

#include <algorithm>
#include <map>
#include <numeric>
#include <set>

#include "common/util.h"
#include "dtrain/errors.h"

namespace dtrain {

struct DeviceMesh::Dim {
  std::string name;
  std::vector<int> root_dims;  // the mesh's own dimensions this one spans (one, or several flattened)
  int64_t size = 1;
  int64_t local_rank = 0;
  Group group;
};

struct DeviceMesh::State {
  std::vector<int64_t> shape, strides, coordinate;  // of the whole mesh; this rank's coordinate
  std::vector<std::string> names;
  int64_t index = 0;                                      // the world's object index (step 2)
  std::map<std::string, std::shared_ptr<Dim>> flattened;  // by name, built once
};

namespace {

std::string describe_list(const std::vector<std::string>& items) { return "[" + util::join(items, ", ") + "]"; }

std::vector<std::string> strings(const std::vector<int64_t>& v) {
  std::vector<std::string> out;
  for (int64_t x : v) out.push_back(std::to_string(x));
  return out;
}

// Step 2, also run by flatten(): every rank's `desc` must equal rank 0's.
void agree(const std::string& desc, const std::string& remedy) {
  const auto all = all_gather_bytes(desc);
  for (size_t r = 0; r < all.size(); ++r)
    DTRAIN_CHECK(all[r] == all[0], "rank ", rank(), ": device meshes differ across ranks: rank 0 builds ", all[0],
                 " but rank ", r, " builds ", all[r], ": ", remedy);
}

// The group of the ranks that differ from this one only along root_dims (step 3).
Group group_along(const DeviceMesh::State& s, const std::vector<int>& root_dims) {
  int64_t span = 1;
  for (int d : root_dims) span *= s.shape[d];
  if (span == world_size()) return Group();  // the whole world: the default group
  int64_t color = 0;
  for (size_t d = 0; d < s.shape.size(); ++d)
    if (std::find(root_dims.begin(), root_dims.end(), static_cast<int>(d)) == root_dims.end())
      color = color * s.shape[d] + s.coordinate[d];
  return split_group(static_cast<int>(color), rank());
}

std::shared_ptr<DeviceMesh::Dim> make_dim(const DeviceMesh::State& s, std::string name, std::vector<int> root_dims) {
  auto dim = std::make_shared<DeviceMesh::Dim>();
  dim->name = std::move(name);
  for (int d : root_dims) {
    dim->size *= s.shape[d];
    dim->local_rank = dim->local_rank * s.shape[d] + s.coordinate[d];
  }
  dim->root_dims = std::move(root_dims);
  dim->group = group_along(s, dim->root_dims);
  return dim;
}

}  // namespace

DeviceMesh init_device_mesh(std::vector<int64_t> shape, std::vector<std::string> names) {
  const int world = world_size();
  DTRAIN_CHECK(!shape.empty(), "init_device_mesh: the shape is empty: give one size per dimension, e.g. {", world, "}");
  if (names.empty())
    for (size_t d = 0; d < shape.size(); ++d) names.push_back("dim" + std::to_string(d));
  DTRAIN_CHECK(names.size() == shape.size(), "init_device_mesh: ", shape.size(), " dimensions but ", names.size(),
               " names ", describe_list(names), ": give one name per dimension");
  int64_t product = 1;
  for (int64_t n : shape) {
    DTRAIN_CHECK(n >= 1, "init_device_mesh: shape ", describe_list(strings(shape)), " has a size ", n,
                 ": every size must be >= 1");
    product *= n;
  }
  DTRAIN_CHECK(product == world, "init_device_mesh: shape ", describe_list(strings(shape)), " holds ", product,
               " ranks but the world has ", world, ": the product of the sizes must be the world size");
  for (size_t d = 0; d < names.size(); ++d) {
    DTRAIN_CHECK(!names[d].empty(), "init_device_mesh: dimension ", d, " has an empty name: name every dimension");
    DTRAIN_CHECK(std::count(names.begin(), names.end(), names[d]) == 1, "init_device_mesh: the name '", names[d],
                 "' is given twice in ", describe_list(names), ": names must be unique");
  }

  auto s = std::make_shared<DeviceMesh::State>();
  s->shape = shape;
  s->names = names;
  s->strides.assign(shape.size(), 1);
  for (int d = static_cast<int>(shape.size()) - 2; d >= 0; --d) s->strides[d] = s->strides[d + 1] * shape[d + 1];
  for (size_t d = 0; d < shape.size(); ++d) s->coordinate.push_back(rank() / s->strides[d] % shape[d]);
  s->index = Group().next_object_index();
  agree(detail::cat("mesh #", s->index, ": shape ", describe_list(strings(shape)), ", dims ", describe_list(names)),
        "every rank must call init_device_mesh with the same shape and names, in the same order");
  std::vector<std::shared_ptr<DeviceMesh::Dim>> dims;
  for (size_t d = 0; d < shape.size(); ++d) dims.push_back(make_dim(*s, names[d], {static_cast<int>(d)}));
  return DeviceMesh(std::move(s), std::move(dims));
}

const DeviceMesh::Dim& DeviceMesh::dim(const std::string& name) const {
  DTRAIN_CHECK(state_, "DeviceMesh: this mesh is empty: build one with init_device_mesh");
  for (const auto& d : dims_)
    if (d->name == name) return *d;
  throw Error(detail::cat("DeviceMesh: no dimension named '", name, "' in mesh with dims ", describe_list(dim_names()),
                          ": use one of those names"));
}

std::vector<int64_t> DeviceMesh::shape() const {
  std::vector<int64_t> out;
  for (const auto& d : dims_) out.push_back(d->size);
  return out;
}

std::vector<std::string> DeviceMesh::dim_names() const {
  std::vector<std::string> out;
  for (const auto& d : dims_) out.push_back(d->name);
  return out;
}

int64_t DeviceMesh::size() const {
  int64_t n = 1;
  for (const auto& d : dims_) n *= d->size;
  return n;
}

int64_t DeviceMesh::size(const std::string& name) const { return dim(name).size; }

DeviceMesh DeviceMesh::operator[](const std::string& name) const { return (*this)[std::vector<std::string>{name}]; }

DeviceMesh DeviceMesh::operator[](const std::vector<std::string>& names) const {
  std::vector<std::shared_ptr<Dim>> picked;
  int last = -1;
  for (const auto& name : names) {
    dim(name);  // throws for an unknown name
    int at = 0;
    while (dims_[at]->name != name) ++at;
    DTRAIN_CHECK(at > last, "DeviceMesh: dimensions ", describe_list(names), " are not in the mesh's order ",
                 describe_list(dim_names()), ": name them in that order, each once");
    last = at;
    picked.push_back(dims_[at]);
  }
  return DeviceMesh(state_, std::move(picked));
}

Group DeviceMesh::get_group(const std::string& name) const { return dim(name).group; }

Group DeviceMesh::get_group() const {
  DTRAIN_CHECK(dims_.size() == 1, "DeviceMesh::get_group(): the mesh has ", dims_.size(), " dimensions ",
               describe_list(dim_names()), ": name one, get_group(\"", dims_.empty() ? "" : dims_[0]->name, "\")");
  return dims_[0]->group;
}

std::vector<int64_t> DeviceMesh::get_coordinate() const {
  std::vector<int64_t> out;
  for (const auto& d : dims_) out.push_back(d->local_rank);
  return out;
}

int64_t DeviceMesh::get_local_rank(const std::string& name) const { return dim(name).local_rank; }

std::vector<int64_t> DeviceMesh::ranks() const {
  DTRAIN_CHECK(state_, "DeviceMesh: this mesh is empty: build one with init_device_mesh");
  std::vector<int> spanned;  // the mesh's own dimensions, row-major
  for (const auto& d : dims_) spanned.insert(spanned.end(), d->root_dims.begin(), d->root_dims.end());
  int64_t base = rank();
  for (int d : spanned) base -= state_->coordinate[d] * state_->strides[d];
  std::vector<int64_t> out{base};
  for (int d : spanned) {
    std::vector<int64_t> next;
    for (int64_t r : out)
      for (int64_t i = 0; i < state_->shape[d]; ++i) next.push_back(r + i * state_->strides[d]);
    out = std::move(next);
  }
  return out;
}

DeviceMesh DeviceMesh::flatten(const std::string& name) const {
  DTRAIN_CHECK(state_, "DeviceMesh: this mesh is empty: build one with init_device_mesh");
  const std::string flat = name.empty() ? util::join(dim_names(), "_") : name;
  std::vector<int> root_dims;
  for (const auto& d : dims_) root_dims.insert(root_dims.end(), d->root_dims.begin(), d->root_dims.end());
  std::vector<std::string> spanned;
  for (int d : root_dims) spanned.push_back(state_->names[d]);
  auto it = state_->flattened.find(flat);
  if (it != state_->flattened.end()) {
    DTRAIN_CHECK(it->second->root_dims == root_dims, "DeviceMesh::flatten: '", flat,
                 "' already names another flattening of this mesh: pick another name");
    return DeviceMesh(state_, {it->second});
  }
  DTRAIN_CHECK(std::find(state_->names.begin(), state_->names.end(), flat) == state_->names.end(),
               "DeviceMesh::flatten: '", flat, "' is already a dimension of the mesh: pick another name");
  agree(detail::cat("flatten of mesh #", state_->index, ": dims ", describe_list(spanned), " as '", flat, "'"),
        "every rank must flatten the same dimensions of the same mesh, in the same order");
  auto made = make_dim(*state_, flat, root_dims);
  state_->flattened[flat] = made;
  return DeviceMesh(state_, {made});
}

}  // namespace dtrain
