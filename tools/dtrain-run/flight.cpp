// Collecting flight records and printing their analysis (steps in flight.h).
#include "flight.h"

#include <dirent.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <algorithm>
#include <cstring>
#include <fstream>
#include <stdexcept>

#include "common/env.h"
#include "common/flight_analysis.h"
#include "common/util.h"
#include "store/store.h"

namespace dtrain::run {
namespace {

using Millis = std::chrono::milliseconds;

std::string dump_path(const std::string& dir, int rank) {
  return dir + "/" + flight::kDumpPrefix + std::to_string(rank);
}

// Whether the process has a handler for SIGUSR1 (SigCgt, a hex mask of signals 1..64, in /proc).
bool catches_sigusr1(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind("SigCgt:", 0) == 0) {
      const unsigned long long mask = std::strtoull(line.c_str() + 7, nullptr, 16);
      return (mask >> (SIGUSR1 - 1)) & 1;
    }
  return false;
}

// Whether the child has exited (it is left for the supervisor to reap).
bool exited(pid_t pid) {
  siginfo_t info{};
  return waitid(P_PID, static_cast<id_t>(pid), &info, WEXITED | WNOHANG | WNOWAIT) == 0 && info.si_pid == pid;
}

int64_t mtime_ns(const std::string& path) {
  struct stat sb {};
  if (stat(path.c_str(), &sb) != 0) return -1;
  return int64_t{sb.st_mtim.tv_sec} * 1000000000 + sb.st_mtim.tv_nsec;
}

void mkdirs(const std::string& path) {
  for (size_t pos = 1; pos <= path.size(); ++pos) {
    if (pos != path.size() && path[pos] != '/') continue;
    const std::string part = path.substr(0, pos);
    if (mkdir(part.c_str(), 0755) != 0 && errno != EEXIST)
      throw std::runtime_error("cannot create the flight-record folder '" + part + "': " + std::strerror(errno) +
                               " (choose another --log_dir)");
  }
}

}  // namespace

std::string& temp_flight_dir() {
  static std::string temp;  // one per launcher
  return temp;
}

std::string make_temp_flight_dir(int attempt) {
  std::string& temp = temp_flight_dir();
  if (temp.empty()) {
    std::string tmpl = env::text("TMPDIR").value_or("/tmp") + "/dtrain-run-flight-XXXXXX";
    if (!mkdtemp(tmpl.data()))
      throw std::runtime_error("cannot create a temporary folder " + tmpl + ": " + std::strerror(errno) +
                               " (set TMPDIR to a folder you can write, or give --log_dir)");
    temp = tmpl;
  }
  const std::string dir = temp + "/attempt_" + std::to_string(attempt) + "/flight";
  mkdirs(dir);
  return dir;
}

void remove_temp_flight_dir() {
  const std::string& temp = temp_flight_dir();
  if (temp.empty()) return;
  // rmdir removes empty folders only: a record, or anything else a worker left, keeps its folder.
  if (DIR* d = opendir(temp.c_str())) {
    while (dirent* e = readdir(d)) {
      const std::string name = e->d_name;
      if (name.rfind("attempt_", 0) != 0) continue;
      rmdir((temp + "/" + name + "/flight").c_str());
      rmdir((temp + "/" + name).c_str());
    }
    closedir(d);
  }
  rmdir(temp.c_str());
}

void request_dumps(const std::string& dir, const std::vector<std::pair<pid_t, int>>& workers,
                   const std::function<void()>& pump) {
  const int64_t asked = util::now_ns();
  std::vector<std::pair<std::string, int64_t>> expected;  // path, its mtime before the request
  std::vector<pid_t> pids;
  for (const auto& [pid, rank] : workers) {
    if (!catches_sigusr1(pid)) continue;
    expected.emplace_back(dump_path(dir, rank), mtime_ns(dump_path(dir, rank)));
    pids.push_back(pid);
    kill(pid, SIGUSR1);
  }
  while (util::now_ns() - asked < int64_t{3000000000}) {
    bool all = true;
    for (size_t i = 0; i < expected.size(); ++i)
      all &= mtime_ns(expected[i].first) > expected[i].second || exited(pids[i]);
    if (all) break;
    pump();
  }
}

void share_dumps(store::StoreClient& store, int attempt, const std::string& dir, const std::vector<int>& local_ranks) {
  for (int r : local_ranks) {
    std::string bytes;
    try {
      bytes = util::read_file(dump_path(dir, r), "flight record");
    } catch (const std::exception&) {
      continue;  // none: a rank stopped or killed leaves none, and the analysis says so
    }
    store.set("flight/" + std::to_string(attempt) + "/" + std::to_string(r), store::Bytes(bytes.begin(), bytes.end()));
  }
  store.add("flight/" + std::to_string(attempt) + "/shared", 1);
}

void gather_dumps(store::StoreClient& store, int attempt, const std::string& dir, int world_size) {
  const std::string prefix = "flight/" + std::to_string(attempt) + "/";
  const int64_t start = util::now_ns();
  for (int r = 0; r < world_size; ++r) {
    if (mtime_ns(dump_path(dir, r)) >= 0) continue;  // this node's own
    const int64_t left_ms = 5000 - (util::now_ns() - start) / 1000000;
    if (left_ms <= 0) break;
    try {
      store.wait({prefix + std::to_string(r)}, Millis(left_ms));
      store::Bytes b = store.get(prefix + std::to_string(r), Millis(1000));
      std::ofstream(dump_path(dir, r), std::ios::binary)
          .write(reinterpret_cast<const char*>(b.data()), static_cast<std::streamsize>(b.size()));
    } catch (const std::exception&) {
      // A node's rank left no record within the bound: the analysis names it.
    }
  }
}

bool has_records(const std::string& dir) {
  DIR* d = opendir(dir.c_str());
  if (!d) return false;
  bool found = false;
  while (dirent* e = readdir(d))
    if (std::string(e->d_name).rfind(flight::kDumpPrefix, 0) == 0) found = true;
  closedir(d);
  return found;
}

std::vector<std::string> analysis_report(const std::string& dir, int world_size, bool only_findings) {
  std::vector<std::string> problems;
  const auto dumps = flight::read_dumps(dir, &problems);
  std::vector<std::string> out;
  for (const auto& p : problems) out.push_back("cannot read a flight record: " + p);
  if (dumps.empty()) return out;
  auto lines = flight::analyze(dumps, world_size);
  if (only_findings && lines.size() == 1 && lines[0].rfind("no hang or mismatch", 0) == 0) return out;
  out.push_back("flight records of " + std::to_string(dumps.size()) +
                (world_size > 0 ? " of " + std::to_string(world_size) : "") + " ranks in " + dir + ":");
  for (auto& line : lines) out.push_back("  " + line);
  return out;
}

int run_analyze(int argc, char** argv) {
  std::string dir;
  int world = -1;
  AnalysisLimits limits;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--analyze" && i + 1 < argc)
      dir = argv[++i];
    else if (a.rfind("--analyze=", 0) == 0)
      dir = a.substr(10);
    else if (a == "--world_size" && i + 1 < argc && util::is_digits(argv[i + 1]))
      world = std::atoi(argv[++i]);
    else if (a == "--time_limit" && i + 1 < argc && util::is_digits(argv[i + 1]) && std::strlen(argv[i + 1]) < 7)
      limits.seconds = std::max(1, std::atoi(argv[++i]));
    else if (a == "--memory_limit_mb" && i + 1 < argc && util::is_digits(argv[i + 1]) && std::strlen(argv[i + 1]) < 8)
      limits.memory_mb = std::max<uint64_t>(16, std::strtoull(argv[++i], nullptr, 10));
    else {
      std::fprintf(stderr,
                   "dtrain-run: --analyze: unexpected argument '%s': use dtrain-run --analyze DIR [--world_size N] "
                   "[--time_limit S] [--memory_limit_mb M]\n",
                   a.c_str());
      return 2;
    }
  }
  if (dir.empty()) {
    std::fprintf(stderr,
                 "dtrain-run: --analyze needs a folder: use dtrain-run --analyze DIR (the ranks' dtrain_trace_rank_<N> "
                 "files)\n");
    return 2;
  }
  // Ctrl-C stops the analysis as it stops a job's (see Note [Bounded flight analysis]): held pending
  // while the child runs, then taken with its default action.
  sigset_t stop;
  sigemptyset(&stop);
  for (int s : {SIGINT, SIGTERM, SIGHUP}) sigaddset(&stop, s);
  sigprocmask(SIG_BLOCK, &stop, nullptr);
  int code = 0;
  try {
    auto lines = bounded_analysis_report(dir, world, /*only_findings=*/false, limits);
    if (lines.empty()) {
      std::fprintf(
          stderr,
          "dtrain-run: no flight records (dtrain_trace_rank_<N>) in %s: pass the folder the ranks wrote them to\n",
          dir.c_str());
      code = 1;
    }
    for (const auto& l : lines) std::printf("%s\n", l.c_str());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dtrain-run: %s\n", e.what());
    code = 1;
  }
  std::fflush(stdout);
  sigprocmask(SIG_UNBLOCK, &stop, nullptr);  // a pending signal ends the launcher as it would have
  return code;
}

}  // namespace dtrain::run
