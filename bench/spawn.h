// The benchmark drivers' process helpers (no LibTorch): start an N-rank job the way torchrun does
// (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR=127.0.0.1, MASTER_PORT = a free port,
// OMP_NUM_THREADS=MKL_NUM_THREADS=1 in every rank's environment), wait for it, and parse the
// `key=value` lines the workers print.
#pragma once

#include <chrono>
#include <cstddef>
#include <string>
#include <utility>
#include <vector>

namespace bench {

using Clock = std::chrono::steady_clock;
inline double secs_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// Runs argv (argv[0]: a path) as `world` ranks; returns rank 0's output (stdout and stderr). Throws
// with every rank's output when a rank fails or the job exceeds timeout_s (the others are killed).
// `who` prefixes the error messages; env: extra variables set after those (an empty value unsets).
std::string run_job(const std::vector<std::string>& argv, int world, double timeout_s, const std::string& who,
                    const std::vector<std::pair<std::string, std::string>>& env = {});

int free_port();             // a free TCP port on 127.0.0.1
std::string load_average();  // "/proc/loadavg"'s first three fields
std::string self_exe();      // this binary's path
double median(std::vector<double> v);
double parse_value(const std::string& out, const std::string& key);         // `key=` value, or nan
std::string parse_line(const std::string& out, const std::string& prefix);  // the line from prefix, or ""

// One thread's memcpy bandwidth (bytes/s) between two buffers of `bytes`: the median of `runs`.
double memcpy_bandwidth(size_t bytes, int runs = 7);
// The floor of any cross-process synchronization on this host: one process hands a cache line of
// shared memory to another (a ping-pong on one atomic word between this process and a forked
// child, each spinning); returns the one-way time in seconds in the fastest of `runs` batches of
// `round_trips` (a floor: on a busy machine the slower batches include time descheduled).
double cache_line_handoff(int round_trips = 1000, int runs = 200);
std::string human_bytes(size_t b);  // "4 KB", "64 MB", "512 B"
// The suffix of a RESULT key measured on `world` ranks: "" on 2 ranks (the keys' default), else
// "_<world>" (mlp_vs_python_4).
std::string world_suffix(int world);

// The driver of a transfer benchmark taking --reps and --max_bytes (and --world, the ranks, where
// any_world; else 2): parses them, prints the load, runs `self --worker --reps R --max_bytes B` as
// that many ranks and prints rank 0's output.
int transfer_driver(const char* name, const char* about, int argc, char** argv, int default_reps,
                    size_t default_max_bytes, bool any_world = false);

// A benchmark binary's main(): `prog --worker ARGS` is one rank of the job and runs worker(ARGS);
// anything else is the driver and runs driver(argv). An exception ends the process with exit code 1
// and one line on stderr: the driver's message as it is (run_job's already names the benchmark), a
// worker's as "<name> worker: error: <message>".
int main_of(const char* name, int argc, char** argv, int (*worker)(int, char**), int (*driver)(int, char**));

}  // namespace bench
