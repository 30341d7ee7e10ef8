// The per-worker environment and command line: torchrun's contract.
//
// Each worker gets (global rank = node_rank * nproc_per_node + local_rank):
//   RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK and NODE_RANK (= node_rank),
//   GROUP_WORLD_SIZE (= nnodes), ROLE_RANK (= RANK), ROLE_WORLD_SIZE (= WORLD_SIZE),
//   ROLE_NAME (= --role, default "default"), MASTER_ADDR, MASTER_PORT, TORCHELASTIC_RUN_ID and DTRAIN_RUN_ID,
//   TORCHELASTIC_RESTART_COUNT and DTRAIN_RESTART_COUNT (= attempt), TORCHELASTIC_MAX_RESTARTS and
//   DTRAIN_MAX_RESTARTS, DTRAIN_AGENT_STORE=1 (the launcher hosts the store at
//   MASTER_ADDR:MASTER_PORT: workers connect as clients, rank 0 must NOT serve its own), and
//   OMP_NUM_THREADS = max(1, cores / nproc_per_node) unless the launcher's environment sets it.
// In an srun step whose tasks share a host, LOCAL_RANK and LOCAL_WORLD_SIZE count the workers of all
// of them (LaunchOptions::local_rank_base / local_world_size, slurm_step.h), and the cores are split
// among them all.
// argv: the program, then --local_rank=N when --use_local_rank_arg, then the user's arguments.
#pragma once

#include "options.h"
#include "worker.h"

#include <cstdint>
#include <vector>

namespace dtrain::run {

std::vector<WorkerSpec> make_worker_specs(const LaunchOptions& o, uint16_t master_port, int attempt);

}  // namespace dtrain::run
