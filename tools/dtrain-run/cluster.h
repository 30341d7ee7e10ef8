// What cluster tools hand the launcher: torchrun's command line as TorchX, Kubeflow and SkyPilot write
// it, torchrun's PET_<FLAG> environment, and the variables a Kubeflow PyTorchJob gives its pods.
//
// Note [torchrun's command line]: dtrain-run takes torchrun's flags with torchrun's meanings, so that a
// command or manifest written for torchrun runs a dtrain program with `dtrain-run` put in its place:
//   - Every torchrun flag's default comes from PET_<DEST> (argparse's dest, upper case: PET_NNODES,
//     PET_NPROC_PER_NODE, PET_RDZV_ENDPOINT, ...) as torch/distributed/argparse_util.py's env() reads it;
//     a flag on the command line wins. The on/off flags (--standalone, --no_python, -m) count a
//     PET_ value as set when it is a non-zero integer, as check_env() does.
//   - --rdzv_backend static (torchrun's default) is dtrain-run's fixed form: --node_rank says who is
//     who, node 0 hosts the store at --master_addr:--master_port, or at --rdzv_endpoint HOST:PORT.
//   - --rdzv_backend c10d: node ranks come from the rendezvous. The store's host is --rdzv_endpoint
//     (HOST[:PORT], port 29400 unless given, "localhost" when empty), and the launcher on the machine
//     that can bind it hosts it (torchrun matches the machine's names instead; the bind is the same
//     test, and is what decides when two launchers share a machine); rdzv_conf is_host=1 or 0 says so
//     outright. Several nodes run as the elastic form with MIN = MAX when --nnodes is N (elastic.h):
//     node 0 is the host, the others take group ranks in the order they joined, stable for a round
//     and formed anew at every restart, as torchrun's c10d rendezvous does.
//   - --rdzv_conf: join_timeout (default 600 s with c10d) is --rdzv_timeout, last_call_timeout (30 s)
//     is --rdzv_last_call, timeout is static's name for join_timeout; close_timeout (30 s) bounds the
//     closing of a failed job's rendezvous and read_timeout (60 s) is the deadline of every rendezvous
//     store request (Note [Store deadlines and closing] in rendezvous.h), in both forms; is_host as
//     above; secret_file (secret.h). Seconds may have a fraction (torchrun takes whole seconds).
//   - --local_addr: the address this node is known by in the launchers' lines; node 0's is every
//     worker's MASTER_ADDR in the c10d form, with a store there (Note [Workers' store] in main.cpp).
//   - --redirects/--tee: a mask for every local rank, or torchrun's per-local-rank map (StdStreams).
//   - torchrun flags that dtrain-run does not take are refused with one line naming the flag and what
//     to do instead; -m/--module with the reason (dtrain-run starts programs, not Python modules).
//
// Note [Kubeflow PyTorchJob pods]: training-operator v1 gives each pod of a PyTorchJob with a Master
// replica MASTER_ADDR (the master pod's service), MASTER_PORT, WORLD_SIZE (the number of pods) and RANK
// (the pod's index, the master 0) — for a program started directly, one process per pod. torchrun
// reads none of them, so without flags each pod would run a job of its own. dtrain-run started in such
// a pod, with none of --nnodes, --node_rank, --master_addr, --master_port, --rdzv_endpoint,
// --rdzv_backend, --standalone (nor their PET_ variables) given, takes them as the nodes: --nnodes
// WORLD_SIZE --node_rank RANK --master_addr MASTER_ADDR --master_port MASTER_PORT, and node 0 prints
// one line saying so. A launcher that is itself a worker of a launcher (LOCAL_RANK or GROUP_RANK set)
// does not. Trainer v2's TrainJob sets PET_NNODES, PET_NPROC_PER_NODE, PET_NODE_RANK,
// PET_MASTER_ADDR and PET_MASTER_PORT instead, which the first rule reads.
#pragma once

#include <CLI/App.hpp>

#include <string>
#include <vector>

#include "common/env.h"
#include "options.h"

namespace dtrain::run {

// Refuses torchrun flags dtrain-run does not take (one line: the flag and what to use instead);
// nothing for other names. `name` is as given ("--start-method", "-m").
void refuse_torchrun_only_flag(const std::string& name);

// The PET_ variable of a launcher option (its first long name: "--nproc_per_node" gives
// PET_NPROC_PER_NODE), or "" when torchrun has none for it.
std::string pet_variable(const CLI::Option& opt);

// Arguments for the options not on the command line whose PET_ variable is set ("--nnodes=2"), and
// in `used` each as "PET_NNODES=2", for notes and errors.
std::vector<std::string> pet_defaults(const CLI::App& app, const std::vector<const CLI::Option*>& given,
                                      const env::Lookup& from, std::vector<std::string>* used);

// --nproc_per_node: a count, or auto (the GPUs, else the CPUs this process may run on), cpu, gpu.
int parse_nproc(const std::string& nproc);

// --redirects / --tee ("3", or per local rank "0:3,1:2"), as torchrun's Std.from_str reads them;
// `flag` names the option in the error line.
StdStreams parse_std_streams(const std::string& flag, const std::string& value);

// --rdzv_conf KEY=VALUE,... into `o` (the keys of Note [torchrun's command line]); an unknown key
// or a bad value is a usage error naming it.
void parse_rdzv_conf(const std::string& conf, LaunchOptions& o);

// HOST[:PORT] of --rdzv_endpoint ("[v6]:PORT" too) into host and port; an empty endpoint is
// localhost. Throws UsageError naming the endpoint.
void parse_endpoint(const std::string& endpoint, int default_port, std::string* host, int* port);

// Note [Kubeflow PyTorchJob pods]: sets nnodes, node_rank and the master from WORLD_SIZE, RANK,
// MASTER_ADDR and MASTER_PORT when they are all set and `free` (no flag placed the job); returns
// the line node 0 prints, or "".
std::string apply_pod_environment(LaunchOptions& o, bool free, const env::Lookup& from);

}  // namespace dtrain::run
