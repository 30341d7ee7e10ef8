// See spawn.h.
#include "spawn.h"

#include <CLI/CLI.hpp>

#include "cli_checks.h"

#include "common/util.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <sched.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <new>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <thread>

namespace bench {

int free_port() {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  socklen_t len = sizeof(addr);
  if (fd < 0 || bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0)
    throw std::runtime_error(std::string("bench: cannot find a free port: ") + std::strerror(errno));
  close(fd);
  return ntohs(addr.sin_port);
}

std::string world_suffix(int world) { return world == 2 ? "" : "_" + std::to_string(world); }

std::string load_average() {
  std::string s = dtrain::util::read_file("/proc/loadavg");
  std::istringstream in(s);
  std::string a, b, c;
  in >> a >> b >> c;
  return a + " " + b + " " + c;
}

// Runs argv on `world` ranks (env vars as torchrun sets them); returns rank 0's output. Throws with
// every rank's output when a rank fails or the job exceeds timeout_s.
std::string run_job(const std::vector<std::string>& argv, int world, double timeout_s, const std::string& who,
                    const std::vector<std::pair<std::string, std::string>>& env) {
  const int port = free_port();
  std::vector<pid_t> pids;
  std::vector<std::string> logs;
  for (int r = 0; r < world; ++r) {
    char tmpl[] = "/tmp/bench_job_XXXXXX";
    int fd = mkstemp(tmpl);
    if (fd < 0) throw std::runtime_error(who + ": mkstemp: " + std::strerror(errno));
    logs.push_back(tmpl);
    pid_t pid = fork();
    if (pid == 0) {
      dup2(fd, 1);
      dup2(fd, 2);
      close(fd);
      setpgid(0, 0);
      setenv("RANK", std::to_string(r).c_str(), 1);
      setenv("LOCAL_RANK", std::to_string(r).c_str(), 1);
      setenv("WORLD_SIZE", std::to_string(world).c_str(), 1);
      setenv("LOCAL_WORLD_SIZE", std::to_string(world).c_str(), 1);
      setenv("MASTER_ADDR", "127.0.0.1", 1);
      setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
      setenv("OMP_NUM_THREADS", "1", 1);
      setenv("MKL_NUM_THREADS", "1", 1);
      for (const auto& [k, v] : env) {
        if (v.empty())
          unsetenv(k.c_str());
        else
          setenv(k.c_str(), v.c_str(), 1);
      }
      std::vector<char*> args;
      for (const auto& s : argv) args.push_back(const_cast<char*>(s.c_str()));
      args.push_back(nullptr);
      execv(args[0], args.data());
      std::fprintf(stderr, "%s: exec %s: %s\n", who.c_str(), args[0], std::strerror(errno));
      _exit(127);
    }
    close(fd);
    if (pid < 0) throw std::runtime_error(who + ": fork: " + std::strerror(errno));
    pids.push_back(pid);
  }
  const auto t0 = Clock::now();
  std::vector<int> status(world, 0);
  std::vector<bool> done(world, false);
  bool failed = false, timed_out = false;
  for (int left = world; left > 0;) {
    for (int r = 0; r < world; ++r) {
      if (done[r]) continue;
      if (waitpid(pids[r], &status[r], WNOHANG) == pids[r]) {
        done[r] = true;
        --left;
        if (!(WIFEXITED(status[r]) && WEXITSTATUS(status[r]) == 0)) failed = true;
      }
    }
    if (left == 0) break;
    if (!timed_out && secs_since(t0) > timeout_s) timed_out = true;
    if (failed || timed_out)
      for (int r = 0; r < world; ++r)
        if (!done[r]) kill(-pids[r], SIGKILL);
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  std::vector<std::string> outs;
  for (auto& l : logs) {
    outs.push_back(dtrain::util::read_file(l, "rank log"));
    unlink(l.c_str());
  }
  if (failed || timed_out) {
    std::ostringstream msg;
    msg << who + ": job failed" << (timed_out ? " (timed out)" : "") << ":";
    for (const auto& s : argv) msg << " " << s;
    for (int r = 0; r < world; ++r) msg << "\n--- rank " << r << " (status " << status[r] << ") ---\n" << outs[r];
    throw std::runtime_error(msg.str());
  }
  return outs[0];
}

// The value of `key=` in out (first occurrence), or nan.
double parse_value(const std::string& out, const std::string& key) {
  auto pos = out.find(key + "=");
  if (pos == std::string::npos) return std::nan("");
  return std::atof(out.c_str() + pos + key.size() + 1);
}
std::string parse_line(const std::string& out, const std::string& prefix) {
  auto pos = out.find(prefix);
  if (pos == std::string::npos) return "";
  return out.substr(pos, out.find('\n', pos) - pos);
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

std::string self_exe() {
  char buf[4096];
  ssize_t n = readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  if (n <= 0) throw std::runtime_error("bench: cannot read /proc/self/exe");
  return std::string(buf, static_cast<size_t>(n));
}

int main_of(const char* name, int argc, char** argv, int (*worker)(int, char**), int (*driver)(int, char**)) {
  const bool is_worker = argc > 1 && std::string(argv[1]) == "--worker";
  try {
    return is_worker ? worker(argc - 1, argv + 1) : driver(argc, argv);
  } catch (const std::exception& e) {
    if (is_worker)
      std::fprintf(stderr, "%s worker: error: %s\n", name, e.what());
    else
      std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
}

double memcpy_bandwidth(size_t bytes, int runs) {
  std::vector<char> a(bytes, 1), b(bytes, 2);
  std::memcpy(b.data(), a.data(), bytes);  // fault the pages in first
  std::vector<double> rates;
  for (int r = 0; r < runs; ++r) {
    auto t0 = Clock::now();
    std::memcpy(b.data(), a.data(), bytes);
    rates.push_back(bytes / secs_since(t0));
  }
  return median(rates);
}

namespace {
inline void handoff_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}
}  // namespace

double cache_line_handoff(int round_trips, int runs) {
  void* mem = mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (mem == MAP_FAILED) throw std::runtime_error(std::string("bench: mmap failed: ") + std::strerror(errno));
  auto* word = new (mem) std::atomic<uint32_t>(0);
  const uint32_t last = 2u * static_cast<uint32_t>(round_trips) * static_cast<uint32_t>(runs);
  std::fflush(nullptr);  // the child must not flush this process's buffered output again
  // Parent on one CPU, child on another (a fork inherits this process's mask, which may be one CPU):
  // a ping-pong on one core would measure context switches.
  cpu_set_t saved;
  const bool pinned = std::thread::hardware_concurrency() >= 2 && sched_getaffinity(0, sizeof(saved), &saved) == 0;
  auto pin = [](int cpu) {
    cpu_set_t one;
    CPU_ZERO(&one);
    CPU_SET(cpu, &one);
    sched_setaffinity(0, sizeof(one), &one);
  };
  const pid_t child = fork();
  if (child < 0) throw std::runtime_error(std::string("bench: fork failed: ") + std::strerror(errno));
  if (child == 0) {  // answers every odd value with the next even one; only atomics until _exit
    if (pinned) pin(1);
    for (uint32_t v = 1; v < last; v += 2) {
      while (word->load(std::memory_order_acquire) != v) handoff_relax();
      word->store(v + 1, std::memory_order_release);
    }
    _exit(0);
  }
  if (pinned) pin(0);
  std::vector<double> one_way;
  uint32_t v = 0;
  for (int r = 0; r < runs; ++r) {
    auto t0 = Clock::now();
    for (int i = 0; i < round_trips; ++i, v += 2) {
      word->store(v + 1, std::memory_order_release);
      while (word->load(std::memory_order_acquire) != v + 2) handoff_relax();
    }
    one_way.push_back(secs_since(t0) / (2.0 * round_trips));
  }
  int status = 0;
  waitpid(child, &status, 0);
  if (pinned) sched_setaffinity(0, sizeof(saved), &saved);
  munmap(mem, 4096);
  return *std::min_element(one_way.begin(), one_way.end());
}

std::string human_bytes(size_t b) {
  char buf[32];
  if (b >= (size_t{1} << 20))
    std::snprintf(buf, sizeof(buf), "%zu MB", b >> 20);
  else if (b >= 1024)
    std::snprintf(buf, sizeof(buf), "%zu KB", b >> 10);
  else
    std::snprintf(buf, sizeof(buf), "%zu B", b);
  return buf;
}

int transfer_driver(const char* name, const char* about, int argc, char** argv, int default_reps,
                    size_t default_max_bytes, bool any_world) {
  CLI::App app{std::string(name) + ": " + about};
  int reps = default_reps, world = 2;
  size_t max_bytes = default_max_bytes;
  app.add_option("--reps", reps, "rounds per size (median reported; default " + std::to_string(default_reps) + ")")
      ->check(dtrain_cli::positive());
  app.add_option("--max_bytes", max_bytes, "largest size (default " + std::to_string(default_max_bytes) + ")");
  if (any_world)
    app.add_option("--world", world, "ranks on this host (default 2; keys get a _<world> suffix otherwise)")
        ->check(CLI::Range(2, 64));
  CLI11_PARSE(app, argc, argv);
  std::printf("load average at start: %s (%u cores)\n", load_average().c_str(), std::thread::hardware_concurrency());
  std::fflush(stdout);
  const std::string out =
      run_job({self_exe(), "--worker", "--reps", std::to_string(reps), "--max_bytes", std::to_string(max_bytes)}, world,
              1800, name);
  std::fputs(out.c_str(), stdout);
  return 0;
}

}  // namespace bench
