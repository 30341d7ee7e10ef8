// The per-worker environment and command line (see env.h for the contract).
#include "env.h"

#include <algorithm>
#include <map>

#include "common/env.h"

namespace dtrain::run {

std::vector<WorkerSpec> make_worker_specs(const LaunchOptions& o, uint16_t master_port, int attempt) {
  const int world = o.nnodes * o.nproc_per_node;
  // Launchers that share a host (several tasks of an srun step on one node) split it.
  const int local_world = o.local_world_size > 0 ? o.local_world_size : o.nproc_per_node;
  std::map<std::string, std::string> base = env::all_variables();
  if (!env::text("OMP_NUM_THREADS"))
    base["OMP_NUM_THREADS"] = std::to_string(std::max(1, online_cores() / local_world));
  base["WORLD_SIZE"] = std::to_string(world);
  base["LOCAL_WORLD_SIZE"] = std::to_string(local_world);
  base["GROUP_RANK"] = base["NODE_RANK"] = std::to_string(o.node_rank);
  base["GROUP_WORLD_SIZE"] = std::to_string(o.nnodes);
  base["ROLE_NAME"] = o.role;
  base["ROLE_WORLD_SIZE"] = std::to_string(world);
  base["MASTER_ADDR"] = o.master_addr;
  base["MASTER_PORT"] = std::to_string(master_port);
  base["TORCHELASTIC_RUN_ID"] = base["DTRAIN_RUN_ID"] = o.run_id;
  base["TORCHELASTIC_RESTART_COUNT"] = base["DTRAIN_RESTART_COUNT"] = std::to_string(attempt);
  base["TORCHELASTIC_MAX_RESTARTS"] = base["DTRAIN_MAX_RESTARTS"] = std::to_string(o.max_restarts);
  base["DTRAIN_AGENT_STORE"] = "1";
  // The job secret, or none: an open job's workers must not inherit a stale one the launcher ignored.
  if (o.secret.empty())
    base.erase("DTRAIN_JOB_SECRET");
  else
    base["DTRAIN_JOB_SECRET"] = o.secret;

  std::vector<WorkerSpec> specs;
  for (int local = 0; local < o.nproc_per_node; ++local) {
    WorkerSpec s;
    s.local_rank = o.local_rank_base + local;
    s.rank = o.node_rank * o.nproc_per_node + local;
    auto env = base;
    env["RANK"] = env["ROLE_RANK"] = std::to_string(s.rank);
    env["LOCAL_RANK"] = std::to_string(s.local_rank);
    if (o.ft) {  // each replica is a world of its own (Note [Replica relaunch])
      const int k = o.ft_replica_ranks;
      // Numbered across the nodes (node_rank * nproc_per_node / K + the local replica): every node's
      // replicas meet in node 0's quorum, where an id is one replica (Note [Replicas on several nodes]).
      env["DTRAIN_FT_REPLICA_ID"] = std::to_string(s.rank / k);
      env["RANK"] = env["ROLE_RANK"] = env["LOCAL_RANK"] = std::to_string(s.rank % k);
      env["WORLD_SIZE"] = env["LOCAL_WORLD_SIZE"] = env["ROLE_WORLD_SIZE"] = std::to_string(k);
    }
    // Only rank 0's progress becomes the terminal's bar (output.h); "0" also overrides an inherited value.
    env["DTRAIN_PROGRESS_TTY"] = o.progress_bar && s.rank == 0 ? "1" : "0";
    for (const auto& kv : env) s.env.push_back(kv.first + "=" + kv.second);
    s.program_path = o.program_path;
    s.argv.push_back(o.program);
    if (o.use_local_rank_arg) s.argv.push_back("--local_rank=" + std::to_string(s.local_rank));
    s.argv.insert(s.argv.end(), o.program_args.begin(), o.program_args.end());
    specs.push_back(std::move(s));
  }
  return specs;
}

}  // namespace dtrain::run
