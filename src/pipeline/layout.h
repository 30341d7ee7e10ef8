// Which ranks form this rank's pipeline, which hold the same stage, and who agrees at step end.
#pragma once

#include "dtrain/process_group.h"

namespace dtrain::pipeline {

struct Layout {
  int stages = 1, stage = 0, replicas = 1, replica = 0;
  // Model chunks per rank: this rank holds the global stages stage + c * stages, c < virtual_stages.
  int virtual_stages = 1;
  // Global ranks this rank receives activations from and sends them to (-1: none). With virtual
  // stages the pipeline is a ring: the last rank feeds rank 0 the next chunk's input.
  int prev = -1, next = -1;
  Group pipeline;     // the ranks of this rank's pipeline, stage order = group rank order
  Group stage_group;  // the ranks holding this stage (replicas > 1); the default group otherwise
  Group agreement;    // the ranks that agree on failure at step end: the pipeline, or all of them
};

// replicas == 1: the pipeline is `group`. replicas > 1: the world as stages x replicas with
// rank = replica * stages + stage; every rank of the world must call this (new_group inside).
Layout make_layout(const Group& group, int replicas, int virtual_stages);

// The global stage of this rank's chunk c, and the chunk of one of its global stages.
inline int global_stage(const Layout& l, int chunk) { return chunk * l.stages + l.stage; }
inline int chunk_of(const Layout& l, int global) { return global / l.stages; }

}  // namespace dtrain::pipeline
