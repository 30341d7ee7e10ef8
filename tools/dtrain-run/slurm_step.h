// dtrain-run started by srun: one launcher per task.
//
// Note [dtrain-run in a Slurm step]: `srun -n N dtrain-run --nproc_per_node K ./train` starts N
// launchers that know nothing of each other; left alone, each would run a K-rank job of its own and
// report success. Inside a step of several tasks each launcher is therefore one node of one job:
// node rank SLURM_PROCID, nnodes = the step's tasks (SLURM_STEP_NUM_TASKS), node 0's store on the
// first host of SLURM_STEP_NODELIST at 15000 + the last four digits of SLURM_JOB_ID
// (Note [Rendezvous under Slurm] in common/slurm.h; --master_addr / --master_port, then MASTER_ADDR /
// MASTER_PORT, win).
// The usual layout is one task per host (srun --ntasks-per-node=1); tasks that share a host split its
// local ranks: LOCAL_RANK = SLURM_LOCALID * K + i and LOCAL_WORLD_SIZE = (tasks on the host) * K, so
// `--device cuda` never puts two workers on one GPU. Flags that contradict the step (--standalone,
// another --nnodes or --node_rank) are usage errors: the job is never split silently.
// A step of one task, a batch script and salloc's shell are not steps of several tasks: dtrain-run
// runs there as anywhere else.
#pragma once

#include <string>

#include "common/env.h"
#include "options.h"

namespace dtrain::run {

// Which of the flags a Slurm step decides were given on the command line.
struct GivenFlags {
  bool nnodes = false;
  bool node_rank = false;
  bool standalone = false;
  bool master_addr = false;
  bool master_port = false;
};

// Makes `o` one node of the step's job when `from` describes an srun step of several tasks; sets
// o.slurm_note to the line node 0 prints. Throws UsageError on a contradicting flag or a malformed
// Slurm variable. Outside such a step it changes nothing.
void apply_slurm_step(LaunchOptions& o, const GivenFlags& given, const env::Lookup& from);

}  // namespace dtrain::run
