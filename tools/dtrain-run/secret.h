// The job secret (Note [Store handshake] in src/store/server.cpp): what closes the rendezvous
// store, and with it the job, to every process that was not given it.
//
// Where it comes from, first match:
//   1. --rdzv_conf secret_file=PATH: the file's one line. The file must be a regular file of this
//      user that no one else may read or write (mode 0600 or stricter); otherwise a usage error.
//   2. DTRAIN_JOB_SECRET in the launcher's environment.
//   3. A one-node job: a fresh random secret, made here.
// A job of several nodes given none runs open, as torchrun's does (TorchX and Kubeflow start
// launchers that share none), and its launchers say so in one line (open_store_warning()).
// The launcher hands the secret to its workers in DTRAIN_JOB_SECRET, never on a command line.
//
//   dtrain-run --nnodes 2 --node_rank 0 --master_addr node0 --rdzv_conf secret_file=$HOME/.job ./train
#pragma once

#include <string>

#include "options.h"

namespace dtrain::run {

// Sets o.secret by the rules above, after the node count is known. Throws UsageError.
void resolve_job_secret(LaunchOptions& o);

// The line a launcher of an open job prints, naming the store and the remedy.
std::string open_store_warning(const LaunchOptions& o);

}  // namespace dtrain::run
