// bench_hsdp: one rank of the HSDP-against-flat-fully_shard job over a slow link between two "nodes".
// bench/hsdp_slow_link.py starts it: 4 ranks, two in each of two network namespaces joined by a veth
// pair shaped to 1 Gbit/s, and reports
//   RESULT hsdp_step_vs_fsdp_slow_link=R   (goal <= 0.6)
// and the bytes that crossed the link per step in each mode.
//
//   bench_hsdp --worker --mode hsdp|flat [--layers 12 --width 2048 --batch 16 --steps 3] [--link DEV]
//
// The model: --layers x (Linear width-width, Tanh), about 50 M float32 parameters at the defaults,
// each Linear a unit, Adam. "flat" shards every parameter over the 4 ranks (fully_shard on the world);
// "hsdp" over a {replicate 2, shard 2} mesh, shard groups {0, 1} and {2, 3}: ranks 0 and 1 are one
// node, 2 and 3 the other, so a shard group's all-gathers and reduce-scatters stay inside its node and
// only the replicas' gradient all-reduce crosses. Each rank trains --batch rows of its own.
//
// Rank 0 prints, after one warm-up step, the mean step time over --steps steps between two barriers,
// and the bytes its node's end of the link (--link, a name in this rank's network namespace) sent and
// received meanwhile, from /sys/class/net/DEV/statistics (every byte between the nodes crosses it):
//   step_ms=... link_tx_per_step=... link_rx_per_step=... received_per_step=... params=...
#include <cstdio>
#include <fstream>
#include <stdexcept>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <CLI/CLI.hpp>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adam.h>

#include "dtrain/device_mesh.h"
#include "dtrain/fsdp.h"
#include "dtrain/process_group.h"
#include "spawn.h"

namespace {

using namespace bench;

// A counter of the link (tx_bytes or rx_bytes); 0 without a link.
int64_t hsdp_link_bytes(const std::string& dev, const char* counter) {
  if (dev.empty()) return 0;
  const std::string path = "/sys/class/net/" + dev + "/statistics/" + counter;
  std::ifstream in(path);
  int64_t v = -1;
  in >> v;
  if (!in || v < 0)
    throw std::runtime_error("cannot read " + path + ": pass --link the name of this namespace's end of the link");
  return v;
}

int hsdp_worker(int argc, char** argv) {
  CLI::App app{"bench_hsdp worker"};
  std::string mode = "hsdp", link;
  int layers = 12, steps = 3;
  int64_t width = 2048, batch = 16;
  app.add_option("--mode", mode)->check(CLI::IsMember({"hsdp", "flat"}));
  app.add_option("--layers", layers);
  app.add_option("--width", width);
  app.add_option("--batch", batch);
  app.add_option("--steps", steps);
  app.add_option("--link", link);
  CLI11_PARSE(app, argc, argv);
  at::set_num_threads(1);
  dtrain::init_process_group();
  if (mode == "hsdp" && dtrain::world_size() != 4)
    throw std::runtime_error("--mode hsdp needs 4 ranks (2 nodes x 2), got " + std::to_string(dtrain::world_size()));

  torch::manual_seed(0);
  torch::nn::Sequential net;
  for (int i = 0; i < layers; ++i) {
    net->push_back(torch::nn::Linear(width, width));
    net->push_back(torch::nn::Tanh());
  }
  int64_t params = 0;
  for (const auto& p : net->parameters()) params += p.numel();
  auto options = dtrain::FullyShardOptions();
  if (mode == "hsdp") options.mesh(dtrain::init_device_mesh({2, 2}, {"replicate", "shard"}));
  for (auto& layer : *net)
    if (!layer.ptr()->parameters().empty()) dtrain::fully_shard(layer, options);
  auto fsdp = dtrain::fully_shard(net.ptr(), options);
  torch::optim::Adam opt(net->parameters(), torch::optim::AdamOptions(1e-4));
  torch::manual_seed(1 + dtrain::rank());
  const at::Tensor x = at::randn({batch, width}), y = at::randn({batch, width});
  auto step = [&] {
    opt.zero_grad();
    (fsdp(x) - y).pow(2).mean().backward();
    opt.step();
  };
  step();  // warm-up: Adam's state, the units' buffers, the connections' first bytes
  dtrain::barrier();
  const int64_t tx0 = hsdp_link_bytes(link, "tx_bytes"), rx0 = hsdp_link_bytes(link, "rx_bytes");
  const int64_t received0 = fsdp.received_bytes();
  const auto t0 = Clock::now();
  for (int i = 0; i < steps; ++i) step();
  dtrain::barrier();
  const double seconds = secs_since(t0);
  const int64_t tx = hsdp_link_bytes(link, "tx_bytes") - tx0, rx = hsdp_link_bytes(link, "rx_bytes") - rx0;
  if (dtrain::rank() == 0)
    std::printf("step_ms=%.1f link_tx_per_step=%.0f link_rx_per_step=%.0f received_per_step=%.0f params=%lld\n",
                1e3 * seconds / steps, static_cast<double>(tx) / steps, static_cast<double>(rx) / steps,
                static_cast<double>(fsdp.received_bytes() - received0) / steps, static_cast<long long>(params));
  dtrain::destroy_process_group();
  return 0;
}

int hsdp_driver(int, char**) {
  throw std::runtime_error(
      "bench_hsdp: its ranks are started by bench/hsdp_slow_link.py (as root: it makes the two nodes' network "
      "namespaces); run python3 bench/hsdp_slow_link.py --build build");
}

}  // namespace

int main(int argc, char** argv) { return bench::main_of("bench_hsdp", argc, argv, hsdp_worker, hsdp_driver); }
