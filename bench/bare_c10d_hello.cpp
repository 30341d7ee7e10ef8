// Reference for the startup benchmark: two ranks built on LibTorch's c10d alone (TCPStore +
// ProcessGroupGloo), no dtrain. Rank 0 hosts the TCPStore. Prints when it passed its first barrier
// and its peak memory, as hello_distributed --report_times does.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

static long peak_rss_kb() {
  std::ifstream f("/proc/self/status");
  for (std::string line; std::getline(f, line);)
    if (line.rfind("VmHWM:", 0) == 0) return std::stol(line.substr(6));
  return -1;
}

int main() {
  const int rank = std::atoi(std::getenv("RANK"));
  const int world = std::atoi(std::getenv("WORLD_SIZE"));
  c10d::TCPStoreOptions opts;
  opts.port = static_cast<uint16_t>(std::atoi(std::getenv("MASTER_PORT")));
  opts.isServer = rank == 0;
  opts.numWorkers = world;
  opts.waitWorkers = false;
  auto store = c10::make_intrusive<c10d::TCPStore>(std::getenv("MASTER_ADDR"), opts);
  auto pg_opts = c10d::ProcessGroupGloo::Options::create();
  pg_opts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
  auto pg = c10::make_intrusive<c10d::ProcessGroupGloo>(c10::make_intrusive<c10d::PrefixStore>("pg", store), rank,
                                                        world, pg_opts);
  pg->barrier()->wait();
  auto now =
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::system_clock::now().time_since_epoch()).count();
  std::printf("first_barrier_unix_ns=%lld\n", static_cast<long long>(now));
  std::printf("peak_rss_kb=%ld\n", peak_rss_kb());
  return 0;
}
