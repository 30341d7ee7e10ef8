// The C++ side of test_dcp.py: one model (three Linears, float64, deterministic weights and batches
// both languages compute alike) trained with Adam under DDP, DDP with a ZeroRedundancyOptimizer,
// fully_shard, tensor parallelism (tp: the first Linear Colwise, the second Rowwise over the
// world, its 13 hidden features in torch.chunk's uneven parts, every rank on the whole batch), or both
// (2d, on 4 ranks: those styles over mesh["tp"] of a {dp 2, tp 2} mesh, then fully_shard over
// mesh["dp"] of each Linear and the root, each dp row on its rows of the batch), or HSDP (hsdp, on
// 4 ranks: fully_shard of each Linear and the root over a {replicate 2, shard 2} mesh, each rank on
// its rows of the batch), saved
// with dtrain::dcp, or loaded from what Python's dcp.save wrote (dcp_interop.py is the Python side).
// Rank 0 writes what the test compares: the whole parameters when saved or loaded, and after
// training on.
//   dcp_interop save KINDS DIR OUT.json   per kind (ddp, zero, fsdp, tp, 2d, hsdp; comma-separated): train 3 steps,
//                                         save to DIR/<kind>, train 5 more
//   dcp_interop load KINDS DIR OUT.json   per kind: load DIR, train 5 steps
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adam.h>

#include <fstream>
#include <iomanip>
#include <iostream>
#include <limits>
#include <sstream>

#include "dtrain/checkpoint.h"
#include "dtrain/dcp.h"
#include "dtrain/ddp.h"
#include "dtrain/fsdp.h"
#include "dtrain/device_mesh.h"
#include "dtrain/process_group.h"
#include "dtrain/tensor_parallel.h"
#include "dtrain/zero.h"

namespace {

constexpr int kBatch = 12, kBefore = 3, kAfter = 5;

at::Tensor wave(int64_t n, double scale, double freq, double phase) {
  return at::arange(n, at::kDouble).mul(freq).add(phase).sin().mul(scale);
}

// Linear: torch::nn::Linear, or dtrain::ParallelLinear for tensor parallelism (the same parameters).
template <class Linear = torch::nn::Linear>
torch::nn::Sequential make_model(double phase) {
  torch::nn::Sequential m(Linear(8, 13), torch::nn::Tanh(), Linear(13, 5), torch::nn::Tanh(), Linear(5, 3));
  m->to(at::kDouble);
  torch::NoGradGuard no_grad;
  int k = 0;
  for (auto& p : m->parameters()) p.copy_(wave(p.numel(), 0.3, 0.7, 1.3 * k++ + phase).view(p.sizes()));
  return m;
}

std::string json_params(const std::vector<std::pair<std::string, at::Tensor>>& params) {
  std::ostringstream s;
  s << std::setprecision(std::numeric_limits<double>::max_digits10) << "{";
  bool first = true;
  for (const auto& [name, t] : params) {
    s << (first ? "" : ", ") << "\"" << name << "\": [";
    at::Tensor flat = t.reshape({-1}).contiguous();
    for (int64_t i = 0; i < flat.numel(); ++i) s << (i ? ", " : "") << flat[i].item<double>();
    s << "]";
    first = false;
  }
  return s.str() + "}";
}

struct Job {
  std::string kind;
  torch::nn::Sequential model;
  std::unique_ptr<dtrain::DistributedDataParallel<torch::nn::SequentialImpl>> ddp;
  std::optional<dtrain::FSDPModule<torch::nn::SequentialImpl>> fsdp;
  std::unique_ptr<torch::optim::Optimizer> opt;
  dtrain::DeviceMesh mesh;  // 2d's
  int step = 0;

  Job(std::string k, double phase)
      : kind(std::move(k)),
        model(kind == "tp" || kind == "2d" ? make_model<dtrain::ParallelLinear>(phase) : make_model(phase)) {
    const torch::optim::AdamOptions adam(1e-2);
    if (kind == "2d") {
      mesh = dtrain::init_device_mesh({dtrain::world_size() / 2, 2}, {"dp", "tp"});
      dtrain::parallelize_module(*model, mesh["tp"],
                                 {{"0", dtrain::ColwiseParallel()}, {"2", dtrain::RowwiseParallel()}});
      const auto dp = dtrain::FullyShardOptions().mesh(mesh["dp"]);
      for (auto& layer : *model)
        if (!layer.ptr()->parameters().empty()) dtrain::fully_shard(layer, dp);
      fsdp = dtrain::fully_shard(model.ptr(), dp);
      opt = std::make_unique<torch::optim::Adam>(model->parameters(), adam);
      return;
    }
    if (kind == "hsdp") {
      mesh = dtrain::init_device_mesh({2, dtrain::world_size() / 2}, {"replicate", "shard"});
      const auto hsdp = dtrain::FullyShardOptions().mesh(mesh);
      for (auto& layer : *model)
        if (!layer.ptr()->parameters().empty()) dtrain::fully_shard(layer, hsdp);
      fsdp = dtrain::fully_shard(model.ptr(), hsdp);
      opt = std::make_unique<torch::optim::Adam>(model->parameters(), adam);
      return;
    }
    if (kind == "tp") {
      dtrain::parallelize_module(*model, dtrain::Group(),
                                 {{"0", dtrain::ColwiseParallel()}, {"2", dtrain::RowwiseParallel()}});
      opt = std::make_unique<torch::optim::Adam>(model->parameters(), adam);
      return;
    }
    if (kind == "fsdp") {
      for (auto& layer : *model)
        if (!layer.ptr()->parameters().empty()) dtrain::fully_shard(layer);
      fsdp = dtrain::fully_shard(model.ptr());
      opt = std::make_unique<torch::optim::Adam>(model->parameters(), adam);
      return;
    }
    ddp = std::make_unique<dtrain::DistributedDataParallel<torch::nn::SequentialImpl>>(model.ptr());
    if (kind == "zero")
      opt = std::make_unique<dtrain::ZeroRedundancyOptimizer>(model->parameters(),
                                                              dtrain::optimizer_factory<torch::optim::Adam>(adam));
    else
      opt = std::make_unique<torch::optim::Adam>(model->parameters(), adam);
  }
  // One step on this rank's rows of the step's global batch (the mean over all rows, as DDP's
  // average); under tensor parallelism every rank on the whole batch, under both every dp row on its rows.
  void train(int steps) {
    int n = kind == "tp" ? 1 : dtrain::world_size(), r = kind == "tp" ? 0 : dtrain::rank();
    if (kind == "2d") {
      n = static_cast<int>(mesh.size("dp"));
      r = static_cast<int>(mesh.get_local_rank("dp"));
    }
    for (int end = step + steps; step < end; ++step) {
      at::Tensor x = wave(kBatch * 8, 1.0, 0.1, 0.97 * step).view({kBatch, 8}).chunk(n)[r];
      at::Tensor y = wave(kBatch * 3, 1.0, 0.05, 0.31 * step + 1.5).view({kBatch, 3}).chunk(n)[r];
      opt->zero_grad();
      at::Tensor out = fsdp ? (*fsdp)(x) : ddp ? ddp->forward(x) : model->forward(x);
      (out - y).pow(2).mean().backward();
      opt->step();
    }
  }
  std::vector<std::pair<std::string, at::Tensor>> whole() {
    if (fsdp) return fsdp->full_state_dict();  // fsdp and hsdp, and 2d's TP parts too
    if (kind == "tp") return dtrain::tp::full_state_dict(*model);
    std::vector<std::pair<std::string, at::Tensor>> out;
    for (const auto& kv : model->named_parameters()) out.emplace_back(kv.key(), kv.value().detach().clone());
    return out;
  }
};

// One kind's run: its JSON object.
std::string run(const std::string& mode, const std::string& kind, const std::string& dir) {
  std::string at_checkpoint, after;
  if (mode == "save" || mode == "save_ckpt") {
    Job job(kind, 0.0);
    job.train(kBefore);
    // doc:begin dcp_save
    auto sd = dtrain::dcp::get_state_dict(*job.model, job.opt.get());
    dtrain::dcp::save(sd, dir);
    // doc:end dcp_save
    if (mode == "save_ckpt") {  // also through CheckpointManager: its DCP folder beside its main file
      dtrain::TrainingState st;
      st.model = job.model.ptr().get();
      st.optimizer = job.opt.get();
      st.step = kBefore;
      dtrain::CheckpointManager(dir + "_ckpt").save(st);
    }
    at_checkpoint = json_params(job.whole());
    job.train(kAfter);
    after = json_params(job.whole());
  } else {
    Job job(kind, 2.0);  // other weights than the saved ones: the load must replace them
    job.step = kBefore;
    // doc:begin dcp_load
    auto sd = dtrain::dcp::get_state_dict(*job.model, job.opt.get());
    dtrain::dcp::load(sd, dir);
    dtrain::dcp::set_state_dict(*job.model, job.opt.get(), sd);
    // doc:end dcp_load
    at_checkpoint = json_params(job.whole());
    job.train(kAfter);
    after = json_params(job.whole());
  }
  return "{\"at_checkpoint\": " + at_checkpoint + ", \"after\": " + after + "}";
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 5) {
    std::cerr << "usage: dcp_interop save|save_ckpt|load KIND[,KIND...] DIR OUT.json\n";
    return 2;
  }
  const std::string mode = argv[1], kinds = argv[2], dir = argv[3];
  try {
    dtrain::init_process_group();
    std::string json;
    std::istringstream list(kinds);
    for (std::string kind; std::getline(list, kind, ',');)
      json += (json.empty() ? "{" : ", ") + ("\"" + kind + "\": ") +
              run(mode, kind, mode == "load" ? dir : dir + "/" + kind);
    if (dtrain::rank() == 0) std::ofstream(argv[4]) << json << "}\n";
    dtrain::destroy_process_group();
  } catch (const std::exception& e) {
    std::cerr << "dcp_interop: error: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
