// DeviceMesh: the job's ranks laid out as an n-dimensional array with named dimensions, and this
// rank's process group along each (PyTorch's torch.distributed.device_mesh.init_device_mesh).
//
//   // 4 ranks as 2 x 2: ranks {0,1} and {2,3} are "tp" groups, {0,2} and {1,3} "dp" groups.
//   dtrain::DeviceMesh mesh = dtrain::init_device_mesh({2, 2}, {"dp", "tp"});
//   dtrain::Group tp = mesh.get_group("tp");          // this rank's group along "tp"
//   dtrain::DeviceMesh tp_mesh = mesh["tp"];           // the 1-D sub-mesh through this rank
//   std::vector<int64_t> c = mesh.get_coordinate();    // rank 3: {1, 1}
//   dtrain::DeviceMesh all = mesh.flatten("dp_tp");    // one dimension over both ("dp_tp")
//
// Contract:
//   - Ranks are laid out row-major: global rank = sum of coordinate[i] * stride[i], the last
//     dimension fastest, as torch.arange(world).view(shape).
//   - init_device_mesh is collective over the world: every rank calls it, with the same shape and
//     names, in the same order relative to other meshes. Every rank first compares its call with
//     everyone's, so ranks that build meshes in another order fail with one line naming both calls,
//     instead of building mismatched groups. It then builds one group per dimension (split_group of
//     the world), in dimension order on every rank; a dimension spanning the whole world is the
//     default group. Indexing (mesh["tp"], mesh[{"dp","tp"}]) builds nothing.
//   - flatten() is collective over the world too (every rank, same order); it builds the group once
//     and a second call returns it.
//   - A DeviceMesh is a cheap handle: copies share the groups.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "dtrain/process_group.h"

namespace dtrain {

class DeviceMesh {
 public:
  DeviceMesh() = default;  // empty: use init_device_mesh

  int64_t ndim() const { return static_cast<int64_t>(dims_.size()); }
  std::vector<int64_t> shape() const;
  std::vector<std::string> dim_names() const;
  int64_t size() const;                         // the number of ranks in this (sub-)mesh
  int64_t size(const std::string& name) const;  // along one dimension

  // The sub-mesh through this rank along the named dimensions, given in the mesh's order.
  DeviceMesh operator[](const std::string& name) const;
  DeviceMesh operator[](const std::vector<std::string>& names) const;
  // mesh[{"dp", "tp"}] (without it, two C string literals would also make one std::string).
  DeviceMesh operator[](std::initializer_list<std::string> names) const {
    return (*this)[std::vector<std::string>(names)];
  }

  // This rank's group along a dimension; the name-less form is for a 1-D mesh.
  Group get_group(const std::string& name) const;
  Group get_group() const;
  // This rank's index along each dimension, and along one.
  std::vector<int64_t> get_coordinate() const;
  int64_t get_local_rank(const std::string& name) const;
  // The global ranks of this (sub-)mesh, shaped as shape().
  std::vector<int64_t> ranks() const;

  // One dimension named `name` (default: the names joined by "_") over all of this mesh's
  // dimensions, as PyTorch's mesh[("dp", "tp")]._flatten(). Collective over the world.
  DeviceMesh flatten(const std::string& name = "") const;

  struct Dim;    // a dimension: name, size, stride in global ranks, this rank's group and index
  struct State;  // the mesh the handle was cut from: its dimensions and flattened groups

 private:
  friend DeviceMesh init_device_mesh(std::vector<int64_t>, std::vector<std::string>);
  DeviceMesh(std::shared_ptr<State> state, std::vector<std::shared_ptr<Dim>> dims)
      : state_(std::move(state)), dims_(std::move(dims)) {}
  const Dim& dim(const std::string& name) const;
  std::shared_ptr<State> state_;
  std::vector<std::shared_ptr<Dim>> dims_;
};

// A mesh of `shape` over the world (the product of shape must be world_size()), with one unique,
// non-empty name per dimension (empty: "dim0", "dim1", ...). Collective over the world.
DeviceMesh init_device_mesh(std::vector<int64_t> shape, std::vector<std::string> dim_names = {});

}  // namespace dtrain
