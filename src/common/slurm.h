// What Slurm says about a job that dtrain needs for its rendezvous, when the user did not say it:
// where rank 0 runs (the first host of the step's node list), a port (derived from the job id), and
// the shape of an srun step (how many tasks, which one this is, how many share this host).
// Torch-free: libdtrain (ranks started by srun) and dtrain-run (one launcher per task) share it.
//
// Note [Rendezvous under Slurm]: srun tells every task its rank (SLURM_PROCID) but not where to meet.
// As PyTorch Lightning and submitit do, rank 0's host is the first host of SLURM_STEP_NODELIST (task 0
// runs there under every distribution srun offers but -m arbitrary), and the port is 15000 plus the
// last four digits of SLURM_JOB_ID, so that every task computes the same pair without talking, and two
// jobs sharing a node seldom collide. MASTER_ADDR / MASTER_PORT, when set, win; whatever was derived
// is said in one line (one per job, by rank 0 or node 0), so a collision is diagnosable.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "common/env.h"

namespace dtrain::slurm {

// The hosts of a Slurm host list, in Slurm's order: "node[01-03,07],gpu1" -> node01 node02 node03
// node07 gpu1; several brackets in one name multiply ("r[1-2]n[1-2]" -> r1n1 r1n2 r2n1 r2n2).
// A malformed list throws dtrain::Error naming `var`, the list, what is wrong and `remedy`.
std::vector<std::string> expand_hosts(const std::string& list, const std::string& var, const std::string& remedy);

// Slurm's per-node task counts: "2(x3),1" -> 2 2 2 1. Malformed: dtrain::Error as above.
std::vector<int> expand_counts(const std::string& counts, const std::string& var, const std::string& remedy);

// 15000 + the last four digits of the job id (PyTorch Lightning's rule): 15000..24999.
uint16_t port_from_job_id(int64_t job_id);

struct Master {
  std::string host;
  uint16_t port = 0;
  std::string note;  // which values came from Slurm and why ("" when MASTER_ADDR and MASTER_PORT were set)
};

// The rendezvous of a Slurm job: MASTER_ADDR and MASTER_PORT where set; the missing ones from
// SLURM_STEP_NODELIST (else SLURM_JOB_NODELIST) and SLURM_JOB_ID. nullopt outside a Slurm job (no
// SLURM_JOB_ID or no node list) when one of MASTER_ADDR / MASTER_PORT is missing.
std::optional<Master> master(const env::Lookup& from, const std::string& remedy);

// An srun step as one of its tasks sees it.
struct Step {
  int ntasks = 0;         // SLURM_STEP_NUM_TASKS
  int procid = 0;         // SLURM_PROCID: this task, 0..ntasks-1
  int localid = 0;        // SLURM_LOCALID: this task among the step's tasks on its host
  int tasks_on_node = 0;  // SLURM_STEP_TASKS_PER_NODE at SLURM_NODEID
};

// nullopt outside an srun step (a batch script or salloc's shell sets no SLURM_STEP_NUM_TASKS).
std::optional<Step> step(const env::Lookup& from, const std::string& remedy);

}  // namespace dtrain::slurm
