// A small transformer language model trained with 2-D parallelism: tensor parallelism inside each
// "tp" group of a device mesh (attention heads and MLPs split column-then-row, the embedding split
// by vocabulary, the head by class, the loss computed on the sharded logits), DDP over "dp".
//
//   dtrain-run --standalone --nproc_per_node 4 ./build/bin/tp_train --tp 2 --steps 30
//
// The task is synthetic: each token's target is the next token of the vocabulary (t + 1 mod V), so
// the loss falls within a few dozen steps. Every rank of a dp row draws the same batch (seeded by
// step and dp coordinate); the dp rows draw different ones. The last line is
//   RESULT steps=N first_loss=L0 final_loss=L params_agree=1
// where params_agree says the dp replicas ended with identical shards.
#include <torch/nn/modules/container/modulelist.h>
#include <torch/optim/adam.h>

#include <CLI/CLI.hpp>
#include <cstdio>

#include "dtrain/ddp.h"
#include "dtrain/device_mesh.h"
#include "dtrain/tensor_parallel.h"
#include "tp_models.h"

namespace {

constexpr int64_t kVocab = 32, kDim = 32, kHeads = 4, kLayers = 2, kBatch = 8, kSeq = 16;

struct TinyLMImpl : torch::nn::Module {
  TinyLMImpl() {
    emb = register_module("emb", dtrain::ParallelEmbedding(kVocab, kDim));
    blocks = register_module("blocks", torch::nn::ModuleList());
    for (int64_t i = 0; i < kLayers; ++i) blocks->push_back(tp_models::Block(kDim, kHeads));
    head = register_module("head", dtrain::ParallelLinear(torch::nn::LinearOptions(kDim, kVocab).bias(false)));
  }
  at::Tensor forward(const at::Tensor& tokens) {  // [B, T] -> logits [B, T, V / tp]
    at::Tensor h = emb(tokens);
    for (auto& block : *blocks) h = block->as<tp_models::BlockImpl>()->forward(h);
    return head(h);
  }
  dtrain::ParallelEmbedding emb{nullptr};
  torch::nn::ModuleList blocks{nullptr};
  dtrain::ParallelLinear head{nullptr};
};
TORCH_MODULE(TinyLM);

// Whether every rank of `group` holds the same bits in every parameter (a checksum each).
bool params_agree(torch::nn::Module& m, const dtrain::Group& group) {
  double sum = 0;
  for (const auto& p : m.parameters())
    sum += (p.to(at::kDouble) * at::arange(p.numel(), at::kDouble).view(p.sizes())).sum().item<double>();
  const auto all = dtrain::all_gather_values(std::vector<double>{sum}, group);
  for (const auto& v : all)
    if (v[0] != all[0][0]) return false;
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"A small transformer trained with tensor parallelism inside data parallelism"};
  int64_t tp_size = 2;
  int steps = 30;
  app.add_option("--tp", tp_size, "ranks per tensor-parallel group (the world must be a multiple)");
  app.add_option("--steps", steps, "training steps");
  CLI11_PARSE(app, argc, argv);
  try {
    dtrain::init_process_group();
    // doc:begin tp_train
    auto mesh = dtrain::init_device_mesh({dtrain::world_size() / tp_size, tp_size}, {"dp", "tp"});
    torch::manual_seed(0);  // every rank builds the same model; parallelize_module takes tp rank 0's
    TinyLM model;
    dtrain::ParallelizePlan plan = tp_models::block_plan("blocks.*.");
    plan.push_back({"emb", dtrain::RowwiseParallel().input_layouts(dtrain::Replicate())});
    plan.push_back({"head", dtrain::ColwiseParallel()});
    dtrain::parallelize_module(*model, mesh["tp"], plan);
    dtrain::DistributedDataParallel ddp(model, dtrain::DDPOptions().process_group(mesh.get_group("dp")));
    // doc:end tp_train
    torch::optim::Adam opt(model->parameters(), torch::optim::AdamOptions(1e-2));
    const dtrain::Group tp = mesh.get_group("tp");
    double first = 0, last = 0;
    for (int step = 0; step < steps; ++step) {
      auto gen = at::make_generator<at::CPUGeneratorImpl>(1000 * step + mesh.get_local_rank("dp"));
      at::Tensor tokens = at::randint(kVocab, {kBatch, kSeq}, gen, at::kLong);
      at::Tensor target = (tokens + 1).remainder(kVocab);
      opt.zero_grad();
      at::Tensor logits = ddp(tokens);  // [B, T, V / tp]
      at::Tensor loss = dtrain::parallel_cross_entropy(logits.reshape({-1, logits.size(-1)}), target.reshape(-1), tp);
      loss.backward();
      opt.step();
      // The mean over dp rows, for the report.
      const double mean = dtrain::all_reduce_values(std::vector<double>{loss.item<double>()}, dtrain::ReduceOp::SUM,
                                                    mesh.get_group("dp"))[0] /
                          static_cast<double>(mesh.size("dp"));
      if (step == 0) first = mean;
      last = mean;
      if (dtrain::rank() == 0 && step % 10 == 0) std::printf("step %d loss %.4f\n", step, mean);
    }
    const bool agree = params_agree(*model, mesh.get_group("dp"));
    if (dtrain::rank() == 0)
      std::printf("RESULT steps=%d first_loss=%.4f final_loss=%.4f params_agree=%d\n", steps, first, last,
                  agree ? 1 : 0);
    dtrain::destroy_process_group();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tp_train: error: %s\n", e.what());
    return 1;
  }
  return 0;
}
