// dtrain-run as one node of an srun step (see slurm_step.h).
#include "slurm_step.h"

#include <exception>

#include "common/slurm.h"

namespace dtrain::run {

void apply_slurm_step(LaunchOptions& o, const GivenFlags& given, const env::Lookup& from) {
  const std::string remedy =
      "run dtrain-run under srun as it sets them, or outside Slurm with --nnodes, "
      "--node_rank and --master_addr";
  std::optional<slurm::Step> step;
  try {
    step = slurm::step(from, remedy);
  } catch (const std::exception& e) {
    throw UsageError(e.what());
  }
  if (!step || step->ntasks <= 1) return;
  const std::string n = std::to_string(step->ntasks);
  if (given.standalone)
    throw UsageError("--standalone in an srun step of " + n + " tasks would start " + n +
                     " separate one-node jobs: drop --standalone (each task's dtrain-run then joins as one node "
                     "of the job), or srun one task");
  if (given.nnodes && o.nnodes != step->ntasks)
    throw UsageError("--nnodes " + std::to_string(o.nnodes) + " disagrees with this srun step's " + n +
                     " tasks (SLURM_STEP_NUM_TASKS): each task's dtrain-run is one node; drop --nnodes, or srun " +
                     std::to_string(o.nnodes) + " tasks");
  if (given.node_rank && o.node_rank != step->procid)
    throw UsageError("--node_rank " + std::to_string(o.node_rank) +
                     " disagrees with this task's SLURM_PROCID=" + std::to_string(step->procid) +
                     ": in an srun step each task's dtrain-run is node SLURM_PROCID; " + "drop --node_rank");
  o.nnodes = step->ntasks;
  o.node_rank = step->procid;
  o.local_rank_base = step->localid * o.nproc_per_node;
  o.local_world_size = step->tasks_on_node * o.nproc_per_node;

  // The flags stand in for MASTER_ADDR / MASTER_PORT, so the note names only what Slurm decided.
  const std::string flag_addr = o.master_addr, flag_port = std::to_string(o.master_port);
  env::Lookup with_flags = [&](const std::string& name) -> std::optional<std::string> {
    if (name == "MASTER_ADDR" && given.master_addr) return flag_addr;
    if (name == "MASTER_PORT" && given.master_port) return flag_port;
    return from(name);
  };
  std::optional<slurm::Master> m;
  try {
    m = slurm::master(with_flags, "pass --master_addr with the address of the first task's host");
  } catch (const std::exception& e) {
    throw UsageError(e.what());
  }
  if (!m)
    throw UsageError("this srun step of " + n +
                     " tasks names no SLURM_JOB_ID or node list to meet at: pass --master_addr and --master_port");
  o.master_addr = m->host;
  o.master_port = m->port;
  o.slurm_note = "srun step of " + n + " tasks: each task's dtrain-run is one node (node rank SLURM_PROCID), " +
                 "world " + std::to_string(o.nnodes * o.nproc_per_node) + "; " +
                 (m->note.empty() ? "rendezvous at " + m->host + ":" + std::to_string(m->port) : m->note);
}

}  // namespace dtrain::run
