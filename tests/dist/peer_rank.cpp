// One rank of a job shared with Python ranks (tests/dist/peer_rank.py is the Python side; both run
// the same sequence, call for call): all_reduce, broadcast, all_gather, barrier, send/recv around a
// ring, two subgroups, and this rank's DistributedSampler indices, which the test compares with Python's. Prints
// one line per check and "peer_rank: ALL OK" at the end; any mismatch exits 1.
//   peer_rank --ddp CASE   a DistributedDataParallel that dtrain must refuse in one line (exit 1), beside
//                          Python's (peer_rank.py --ddp CASE), which must then fail promptly:
//                          hook (a communication hook), deeper (one layer more than Python's),
//                          wider (a layer of another shape), dtypes (parameters of two dtypes and the
//                          bucket rebuild), zero_join (a ZeroRedundancyOptimizer listed in a Join),
//                          trained (three steps, beside peer_rank.py --hostile_rebuild: a rank 0
//                          whose bucket rebuild is no partition of the parameters), join (one step
//                          under Join, beside peer_rank.py --hostile_join: a rank 0 that offers a
//                          rank outside the group as the source of the final model)
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <string>

#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>

#include "dtrain/comm_hooks.h"
#include "dtrain/ddp.h"
#include "dtrain/join.h"
#include "dtrain/process_group.h"
#include "dtrain/sampler.h"
#include "dtrain/zero.h"

namespace {

int failures = 0;

void check(bool ok, const std::string& what) {
  std::printf("%s %s\n", ok ? "ok" : "FAILED", what.c_str());
  if (!ok) ++failures;
}

at::TensorOptions f64() { return at::TensorOptions().dtype(at::kDouble); }

// A float32 and a float64 Linear side by side (peer_rank.py's TwoDtypes).
struct TwoDtypesImpl : torch::nn::Module {
  torch::nn::Linear f{nullptr}, d{nullptr};
  TwoDtypesImpl() {
    f = register_module("f", torch::nn::Linear(4, 2));
    d = register_module("d", torch::nn::Linear(4, 2));
    d->to(at::kDouble);
  }
  at::Tensor forward(const at::Tensor& x) { return f(x).sum() + d(x.to(at::kDouble)).sum().to(at::kFloat); }
};
TORCH_MODULE(TwoDtypes);

// The refusals (see the header): each throws its one line before its first call Python's DDP could
// pair with another.
void refused_ddp(const std::string& kind) {
  if (kind == "hook") {
    // DDP pairs with Python's; a communication hook cannot (Python's hooks send other calls).
    dtrain::DistributedDataParallel ddp(torch::nn::Linear(4, 2));
    ddp.register_comm_hook(dtrain::Group(), dtrain::allreduce_hook);
  } else if (kind == "deeper") {
    dtrain::DistributedDataParallel ddp(torch::nn::Sequential(torch::nn::Linear(4, 2), torch::nn::Linear(2, 2)));
  } else if (kind == "wider") {
    dtrain::DistributedDataParallel ddp(torch::nn::Linear(4, 3));
  } else if (kind == "dtypes") {
    TwoDtypes model;
    dtrain::DistributedDataParallel ddp(model);
    for (int step = 0; step < 3; ++step) ddp(at::ones({2, 4})).backward();  // the rebuild refuses
  } else if (kind == "zero_join") {
    dtrain::DistributedDataParallel ddp(torch::nn::Linear(4, 2));
    dtrain::ZeroRedundancyOptimizer zero(ddp.parameters(),
                                         dtrain::optimizer_factory<torch::optim::SGD>(torch::optim::SGDOptions(0.1)));
    dtrain::Join join({&ddp, &zero});
    ddp(at::ones({2, 4})).sum().backward();  // DDP's rounds pair with Python's Join and DDP
    zero.step();                             // ZeRO's first round of its own: refused
  } else if (kind == "trained") {
    // Beside peer_rank.py --hostile_rebuild: its bucket rebuild is refused.
    dtrain::DistributedDataParallel ddp(torch::nn::Linear(4, 2));
    for (int step = 0; step < 3; ++step) ddp(at::ones({2, 4})).sum().backward();
  } else if (kind == "join") {
    // Beside peer_rank.py --hostile_join: one step under Join (rank 0 runs three), then the model's
    // source at the Join's end, which rank 0 offers outside the group: refused.
    dtrain::DistributedDataParallel ddp(torch::nn::Linear(4, 2));
    dtrain::Join join({&ddp});
    ddp(at::ones({2, 4})).sum().backward();
    join.join();
  } else {
    throw std::runtime_error("--ddp takes hook, deeper, wider, dtypes, zero_join, trained or join, got '" + kind + "'");
  }
  throw std::runtime_error("--ddp " + kind + ": dtrain accepted what it must refuse");
}

}  // namespace

int main(int argc, char** argv) {
  try {
    dtrain::init_process_group(dtrain::InitOptions().pytorch_peers(true));
    const int r = dtrain::rank(), n = dtrain::world_size();
    if (argc == 3 && std::strcmp(argv[1], "--ddp") == 0) refused_ddp(argv[2]);  // throws

    at::Tensor t = at::full({5}, r + 1.0, f64());
    dtrain::all_reduce(t);
    check(at::all(t == n * (n + 1) / 2.0).item<bool>(), "all_reduce SUM");

    at::Tensor b = at::arange(4, f64()) + 10.0 * r;
    dtrain::broadcast(b, n - 1);
    check(at::equal(b, at::arange(4, f64()) + 10.0 * (n - 1)), "broadcast from the last rank");

    std::vector<at::Tensor> parts;
    for (int i = 0; i < n; ++i) parts.push_back(at::empty({2}, f64()));
    dtrain::all_gather(parts, at::full({2}, static_cast<double>(r), f64()));
    bool gathered = true;
    for (int i = 0; i < n; ++i) gathered = gathered && at::all(parts[i] == i).item<bool>();
    check(gathered, "all_gather");

    dtrain::barrier();
    check(true, "barrier");

    // Ring: send to the next rank, receive from the previous one (tag 7 on both sides).
    at::Tensor out = at::full({3}, 100.0 + r, f64()), in = at::empty({3}, f64());
    dtrain::Work sent = dtrain::isend(out, (r + 1) % n, dtrain::Group(), 7);
    dtrain::recv(in, (r + n - 1) % n, dtrain::Group(), 7);
    sent.wait();
    check(at::all(in == 100.0 + (r + n - 1) % n).item<bool>(), "send/recv ring");

    dtrain::all_reduce(t, dtrain::ReduceOp::MAX);
    check(at::all(t == n * (n + 1) / 2.0).item<bool>(), "all_reduce MAX");

    // Subgroups: ranks 0 and 1 (one of each language in every layout) all-reduce while a third rank
    // does not; then a group of every rank, listed in reverse (new_group sorts them).
    dtrain::Group g1 = dtrain::new_group({0, 1});
    if (r < 2) {
      at::Tensor s = at::full({2}, r + 1.0, f64());
      dtrain::all_reduce(s, dtrain::ReduceOp::SUM, g1);
      check(at::all(s == 3).item<bool>(), "subgroup [0, 1] all_reduce");
    } else {
      check(!g1.is_member(), "subgroup [0, 1]: not a member");
    }
    std::vector<int> every;
    for (int i = n - 1; i >= 0; --i) every.push_back(i);
    dtrain::Group g2 = dtrain::new_group(every);
    at::Tensor s = at::full({2}, 10.0 * (r + 1), f64());
    dtrain::all_reduce(s, dtrain::ReduceOp::SUM, g2);
    check(at::all(s == 10.0 * n * (n + 1) / 2).item<bool>() && g2.rank() == r, "second subgroup all_reduce");

    dtrain::DistributedSampler sampler(101, dtrain::DistributedSamplerOptions().seed(7));
    sampler.set_epoch(3);
    std::string line = "sampler indices";
    for (int64_t i : sampler.indices()) line += " " + std::to_string(i);
    std::printf("%s\n", line.c_str());

    dtrain::destroy_process_group();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "peer_rank: error: %s\n", e.what());
    return 1;
  }
  if (failures) return 1;
  std::printf("peer_rank: ALL OK\n");
  std::printf("peer_rank: language C++\n");  // the test checks each position ran the side it asked for
  return 0;
}
