// train_llm's world: torchtitan's ParallelDims (parallel_dims.py), the degrees of the world mesh read
// from the configuration, and the configuration's checks that span keys. Every check fails in one
// line naming the keys and their values (dtrain::Error), before any rank joins the job.
#pragma once

#include <cstdint>
#include <string>

#include "dtrain/pipeline.h"
#include "llm/job_config.h"
#include "llm/llama.h"

namespace llm {

// The degrees of the world mesh, outer to inner.
struct ParallelDims {
  int64_t pp = 1, dp_replicate = 1, dp_shard = 1, cp = 1, tp = 1;
  int64_t dp() const { return dp_replicate * dp_shard; }
};

// The degrees from the configuration, refused unless their product is the world.
ParallelDims parallel_dims(const JobConfig::Parallelism& p, int64_t world);
// The pipeline's schedule by its name (dtrain::to_string's; torchtitan's for GPipe and 1F1B).
dtrain::Schedule pipeline_schedule(const std::string& name);
// The checks that span keys or that the model's own validate() does not make.
void validate(const JobConfig& cfg);
// The model's arguments from the configuration, checked (llama::ModelArgs::validate).
llama::ModelArgs model_args(const JobConfig& cfg);

}  // namespace llm
