// Collecting the workers' flight records when a job fails or hangs, and printing the analysis that
// names the culprit (common/flight_analysis.h; the records: src/comm/flight_recorder.h).
//
// Steps, on the first failure of an attempt (a worker of this node failed, or another node did):
//   1. Each live worker that catches SIGUSR1 (libdtrain installs the handler in init_process_group;
//      /proc/<pid>/status says whether one is installed, so a program without dtrain is never
//      killed by it) gets SIGUSR1 and writes `dtrain_trace_rank_<rank>` into the attempt's flight
//      folder (DTRAIN_FLIGHT_DIR). Workers that failed on a collective wrote theirs already.
//   2. The launcher waits up to 3 s for the files, then stops the workers as before.
//   3. Several nodes: each node puts its workers' records into the store under
//      flight/<attempt>/<rank>; node 0 gathers the world's (up to 5 s) into its own folder.
//   4. The node that prints (node 0, or the only one) reads the folder and prints a few lines.
// `dtrain-run --analyze DIR` runs step 4 alone on a folder collected elsewhere.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

namespace dtrain::store {
class StoreClient;
}

namespace dtrain::run {

// Without --log_dir, the attempt's flight folder (with it: <run's log folder>/attempt_<k>/flight,
// made by the supervisor as its logs are): attempt_<k>/flight below a temporary folder made once per
// launcher under TMPDIR (mkdtemp). Created; throws on failure.
std::string make_temp_flight_dir(int attempt);
// At the launcher's exit: removes that temporary folder unless a worker wrote something into it (a
// record, which the analysis names, is kept). Every run without --log_dir made one, and they piled up.
void remove_temp_flight_dir();

// Step 1-2: (pid, rank) of the live workers; `pump` runs every 50 ms meanwhile (the output pipes).
void request_dumps(const std::string& dir, const std::vector<std::pair<pid_t, int>>& workers,
                   const std::function<void()>& pump);

// Step 3: this node's ranks' records into the store; node 0 fetches the world's into `dir`.
void share_dumps(dtrain::store::StoreClient& store, int attempt, const std::string& dir,
                 const std::vector<int>& local_ranks);
void gather_dumps(dtrain::store::StoreClient& store, int attempt, const std::string& dir, int world_size);

// Whether `dir` holds any rank's record.
bool has_records(const std::string& dir);

// Step 4: "flight records of N ranks in DIR:" and the analysis lines (empty when there are no
// records, or with only_findings when the analysis found nothing wrong).
std::vector<std::string> analysis_report(const std::string& dir, int world_size, bool only_findings);

// What the analysis of records from elsewhere may take (see Note [Bounded flight analysis]): far more
// than real records need (a rank's record of 2000 calls is analysed in milliseconds and a few MiB).
struct AnalysisLimits {
  int seconds = 30;
  uint64_t memory_mb = 2048;
};

// analysis_report in a child process within `limits`; SIGINT, SIGTERM or SIGHUP pending (blocked
// by the caller, or arriving) stop it and stay pending. Throws std::runtime_error naming the limit
// it passed ("... stopped at its time limit of 30 s ...") or why it failed.
//   auto lines = bounded_analysis_report("/tmp/run/attempt_0/flight", 4, true, AnalysisLimits{});
std::vector<std::string> bounded_analysis_report(const std::string& dir, int world_size, bool only_findings,
                                                 const AnalysisLimits& limits);

// `dtrain-run --analyze DIR [--world_size N] [--time_limit S] [--memory_limit_mb M]`: prints the
// report; returns the exit code (2 on bad usage).
int run_analyze(int argc, char** argv);
// `dtrain-run --analyze-child DIR WORLD ONLY_FINDINGS MEMORY_MB`: the child of
// bounded_analysis_report (its lines on stdout; exit 1 with the error line, 3 out of memory).
int run_analyze_child(int argc, char** argv);

}  // namespace dtrain::run
