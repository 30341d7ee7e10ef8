// Pipeline layouts: one pipeline over a group, or stages x replicas over the world (2D parallelism).
#include "pipeline/layout.h"

namespace dtrain::pipeline {

namespace {

void link_neighbours(Layout& l) {
  const auto& ranks = l.pipeline.ranks();
  const int p = l.stages, s = l.stage;
  const bool ring = l.virtual_stages > 1;
  if (s > 0 || ring) l.prev = ranks[(s + p - 1) % p];
  if (s + 1 < p || ring) l.next = ranks[(s + 1) % p];
}

Layout make_groups(const Group& group, int replicas) {
  Layout l;
  DTRAIN_CHECK(replicas >= 1, "PipelineOptions: replicas must be >= 1, got ", replicas);
  if (replicas == 1) {
    DTRAIN_CHECK(group.is_member(), "Pipeline: rank ", rank(),
                 " is not a member of the pipeline's group: "
                 "construct the pipeline only on its ranks");
    l.pipeline = group;
    l.agreement = group;
    l.stages = group.size();
    l.stage = group.rank();
    return l;
  }
  DTRAIN_CHECK(group.is_default(), "PipelineOptions: replicas > 1 lays out the whole world; leave process_group unset");
  const int world = world_size();
  DTRAIN_CHECK(world % replicas == 0, "PipelineOptions: replicas=", replicas, " does not divide the world of ", world,
               " ranks: use a divisor (stages = world / replicas)");
  l.replicas = replicas;
  l.stages = world / replicas;
  l.stage = rank() % l.stages;
  l.replica = rank() / l.stages;
  // Every rank creates every group, in the same order (new_group's contract).
  for (int r = 0; r < replicas; ++r) {
    std::vector<int> ranks;
    for (int s = 0; s < l.stages; ++s) ranks.push_back(r * l.stages + s);
    Group g = new_group(ranks);
    if (r == l.replica) l.pipeline = g;
  }
  for (int s = 0; s < l.stages; ++s) {
    std::vector<int> ranks;
    for (int r = 0; r < replicas; ++r) ranks.push_back(r * l.stages + s);
    Group g = new_group(ranks);
    if (s == l.stage) l.stage_group = g;
  }
  l.agreement = Group();
  return l;
}

}  // namespace

Layout make_layout(const Group& group, int replicas, int virtual_stages) {
  DTRAIN_CHECK(virtual_stages >= 1, "PipelineOptions: virtual_stages must be >= 1, got ", virtual_stages);
  Layout l = make_groups(group, replicas);
  l.virtual_stages = virtual_stages;
  link_neighbours(l);
  return l;
}

}  // namespace dtrain::pipeline
