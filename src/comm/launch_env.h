// Reads how this process was launched: dtrain-run / torchrun (RANK, WORLD_SIZE, LOCAL_RANK, ...),
// OpenMPI's mpirun (OMPI_COMM_WORLD_*), MPICH/Intel MPI (PMI_RANK, PMI_SIZE) or Slurm's srun
// (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID). Torch-free, so it is unit-tested on its own.
//
// Every malformed value is a dtrain::Error with one line naming the variable, its value and the remedy.
// The variables are read through common/env.h (their table and validation); this file adds what
// spans several of them: which launcher's set wins, and that the rank is below the world size.
#pragma once

#include <cstdint>
#include <string>

#include "common/env.h"

namespace dtrain::comm {

using EnvLookup = env::Lookup;  // env::process(), or a map in unit tests

struct LaunchEnv {
  int rank = -1;  // -1: not found in the environment
  int world_size = -1;
  int local_rank = -1;  // -1: unknown (derived from host names at rendezvous)
  int local_world_size = -1;
  std::string launcher;                   // "dtrain-run", "torchrun", "mpirun", "mpich", "srun", "env" or ""
  bool dtrain_agent_store = false;        // dtrain-run hosts the store at MASTER_ADDR:MASTER_PORT
  bool torchelastic_agent_store = false;  // torchrun hosts a c10d TCPStore there
  int restart_count = 0;
};

// Parses the launch variables; explicit_rank / explicit_world (>= 0) override them.
// Checks 0 <= rank < world_size.
LaunchEnv read_launch_env(const EnvLookup& from, int explicit_rank = -1, int explicit_world = -1);

struct Endpoint {
  std::string host;
  uint16_t port = 0;
  std::string note;  // what was derived from Slurm's variables, for rank 0 to say ("" when nothing was)
};
// MASTER_ADDR and MASTER_PORT (env://). Ranks started by srun (`under_srun`) that lack either get it
// from Slurm's job (Note [Rendezvous under Slurm] in common/slurm.h).
Endpoint master_from_env(const EnvLookup& from, bool under_srun = false);
// "tcp://host:port", "tcp://[v6addr]:port".
Endpoint parse_tcp_url(const std::string& url);

}  // namespace dtrain::comm
