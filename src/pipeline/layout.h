// Which ranks form this rank's pipeline, which hold the same stage, and who agrees at step end.
#pragma once

#include "dtrain/process_group.h"

namespace dtrain::pipeline {

struct Layout {
  int stages = 1, stage = 0, replicas = 1, replica = 0;
  Group pipeline;     // the ranks of this rank's pipeline, stage order = group rank order
  Group stage_group;  // the ranks holding this stage (replicas > 1); the default group otherwise
  Group agreement;    // the ranks that agree on failure at step end: the pipeline, or all of them
};

// replicas == 1: the pipeline is `group`. replicas > 1: the world as stages x replicas with
// rank = replica * stages + stage; every rank of the world must call this (new_group inside).
Layout make_layout(const Group& group, int replicas);

}  // namespace dtrain::pipeline
