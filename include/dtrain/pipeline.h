// Pipeline parallelism across ranks: the tutorial's `Pipe(model, chunks=4)` (section 5.2) made real,
// with GPipe, 1F1B, interleaved 1F1B and zero-bubble (ZB-H1) schedules, and combinable with DDP
// (stages x replicas).
//
//   dtrain::init_process_group();                               // e.g. 2 ranks: 2 stages
//   torch::nn::Sequential model(Linear(128, 256), ReLU(), Linear(256, 256), ReLU(), Linear(256, 10));
//   dtrain::Pipeline pipe(model, dtrain::PipelineOptions().chunks(4).schedule(dtrain::Schedule::k1F1B));
//   torch::optim::SGD opt(pipe.parameters(), 0.1);             // this rank's stage only
//   for (...) {
//     opt.zero_grad();
//     auto r = pipe.step(x, y, [](const at::Tensor& out, const at::Tensor& t) {
//       return torch::nn::functional::cross_entropy(out, t); });  // x used on the first stage, y on the last
//     opt.step();                                               // on every stage
//     // r.loss: the batch's mean loss, on every rank
//   }
//
// Every rank builds the whole Sequential (with the same seed, or loads the same weights) and keeps only
// its stage's layers: stage i = rank i of the pipeline group. The split is `balance` (layers per
// stage) or, when empty, balance_by_size over the layers' parameter counts (as ModelParallelSequential).
// With virtual_stages(v) > 1 (Schedule::kInterleaved1F1B) the model is split into p * v stages and rank
// r holds v of them, the model chunks r, r + p, ..., r + (v-1)p: activations go from rank r to r + 1 and
// from the last rank back to rank 0 for the next chunk, and gradients the opposite way.
//
// What a caller may rely on:
// - step() is collective over the pipeline's ranks: every rank calls it with the same loss_fn; x is
//   read on the first stage and y on the last. The batch is split into `chunks` micro-batches along
//   dim 0, and each micro-batch's loss is weighted (by its size, with LossReduction::kMean) so that
//   the gradients accumulated in this rank's parameters equal the whole batch's; the caller's
//   optimizer then steps on every rank. With replicas > 1 they are also averaged over the replicas.
// - The schedules differ only in order and in the activations stored at once: GPipe all m, 1F1B at
//   most p per stage, interleaved 1F1B fewer bubbles (m a multiple of p), ZB-H1 the backward split
//   into input and weight gradients; the result is the same.
// - A stage that throws (forward, backward, weight gradient, loss) makes every rank throw, without
//   hanging, "rank R: pipeline step K failed: stage S (rank Q) failed in forward of micro-batch I:
//   <what>"; the pipeline stays usable after it. At the first step a stage whose forward rejects what
//   its predecessor sent fails with an error naming both stages and the shape.
// The protocol of a step and Note [pipeline failure]: src/pipeline/pipeline.cpp; the schedules' action
// orders: src/pipeline/schedule.cpp.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/nn/modules/container/sequential.h>

#include "dtrain/ddp.h"
#include "dtrain/detail/arg.h"
#include "dtrain/device_mesh.h"
#include "dtrain/process_group.h"

namespace dtrain {

enum class Schedule {
  kGPipe,            // all forwards, then all backwards (torch's Pipe, "fill-drain")
  k1F1B,             // one forward, one backward in steady state (PipeDream-Flush); activations bounded by stages
  kInterleaved1F1B,  // Megatron's: virtual_stages chunks per rank, the bubble divided by their number
  kZeroBubbleH1,     // ZB-H1: backward split into input gradient (B) and weight gradient (W), W fills the bubble
};
std::string to_string(Schedule s);

// How loss_fn reduces a micro-batch, so the pipeline can weight micro-batches to match one big batch.
enum class LossReduction {
  kMean,  // loss_fn returns the mean over the micro-batch: each is weighted by its size / batch size
  kSum,   // loss_fn returns a sum: micro-batch losses are added unweighted
};

struct PipelineOptions {
  // Micro-batches per step (>= 1). The batch must have at least `chunks` samples.
  DTRAIN_ARG(int64_t, chunks, 1)
  DTRAIN_ARG(Schedule, schedule, Schedule::kGPipe)
  // Model chunks per rank (kInterleaved1F1B only; >= 1): the model is split into stages * virtual_stages
  // stages, rank r holding stages r, r + stages, ... With the interleaved schedule, chunks must be a
  // multiple of the pipeline's ranks (as in Megatron).
  DTRAIN_ARG(int, virtual_stages, 1)
  // Layers per stage (stages * virtual_stages entries), summing to the Sequential's size. Empty: balanced
  // by parameter count.
  DTRAIN_ARG(std::vector<int64_t>, balance, {})
  // The ranks of the pipeline, in stage order (default: the world). Ignored with replicas > 1.
  DTRAIN_ARG(Group, process_group, Group())
  // Or a 1-D (sub-)mesh whose ranks are the pipeline's, as PyTorch's PipelineStage takes
  // group=mesh["pp"].get_group(): mesh["pp"]; its group takes process_group's place (set one of the two).
  DTRAIN_ARG(DeviceMesh, mesh, DeviceMesh())
  // The old name of process_group, kept for one release.
  [[deprecated("PipelineOptions::group is process_group now")]] PipelineOptions& group(Group g) {
    return process_group(std::move(g));
  }
  [[deprecated("PipelineOptions::group is process_group now")]] const Group& group() const { return process_group(); }
  // Data-parallel replicas of the whole pipeline (2D parallelism). With R > 1, the world (of W ranks)
  // is laid out as W/R stages x R replicas: rank = replica * stages + stage. Every rank of the world
  // must construct the Pipeline (it creates subgroups with new_group, in the same order everywhere);
  // the ranks holding the same stage average their gradients with DistributedDataParallel.
  DTRAIN_ARG(int, replicas, 1)
  // Options of the DDP inside each stage group (replicas > 1); process_group is set by the pipeline.
  DTRAIN_ARG(DDPOptions, ddp, DDPOptions())
  DTRAIN_ARG(LossReduction, loss_reduction, LossReduction::kMean)
};

// What one step measured on this rank (for benchmarks and monitoring).
struct PipelineStepStats {
  double step_s = 0;     // the whole step, agreement and gradient sync included
  double compute_s = 0;  // inside the stage's forward, loss and backward
  double recv_s = 0;     // inside boundary receives: waiting for the neighbour, and the copy out
  double send_s = 0;     // posting boundary sends (each tensor copied into its message)
  int64_t micro_batches = 0;
  int64_t boundary_tensors = 0;        // activations and gradients this rank sent
  int64_t boundary_messages = 0;       // the messages that carried them: one each, plus one per change of shape
  int64_t max_live_micro_batches = 0;  // the most micro-batches whose activations were stored at once
};

struct PipelineStepResult {
  double loss = 0;    // the batch's loss (mean over replicas with replicas > 1), on every rank
  at::Tensor output;  // the last stage's outputs for the whole batch (detached); undefined elsewhere
};

class Pipeline {
 public:
  // loss_fn(output micro-batch, target micro-batch) -> scalar, called on the last stage.
  using LossFn = std::function<at::Tensor(const at::Tensor&, const at::Tensor&)>;

  // Splits `model` into stages (options.balance(), or by parameter count); this rank keeps its stage(s).
  Pipeline(torch::nn::Sequential model, PipelineOptions options = PipelineOptions());
  // One module per stage (stages * virtual_stages), in order (options.balance() must be empty); this rank
  // keeps its own.
  Pipeline(std::vector<torch::nn::Sequential> stages, PipelineOptions options = PipelineOptions());
  ~Pipeline();
  Pipeline(const Pipeline&) = delete;
  Pipeline& operator=(const Pipeline&) = delete;

  // One training step's forward and backward over the micro-batches; every rank of the pipeline calls
  // it. input: the batch (first stage; ignored elsewhere, pass an undefined tensor); target: the same
  // batch's targets (last stage; ignored elsewhere). Gradients are accumulated into the stage's
  // parameters (zero them before, as usual); call the optimizer after it on every rank.
  PipelineStepResult step(const at::Tensor& input, const at::Tensor& target, const LossFn& loss_fn);

  // This rank's stage (its layers of the model); with virtual_stages > 1 it throws: use stage_modules().
  const torch::nn::Sequential& stage_module() const;
  // This rank's stages, one per virtual stage: global stages stage(), stage() + num_stages(), ...
  const std::vector<torch::nn::Sequential>& stage_modules() const;
  std::vector<at::Tensor> parameters() const;  // of every stage this rank holds
  int stage() const;                           // this rank's index in the pipeline (its first stage)
  int num_stages() const;                      // ranks of the pipeline
  int virtual_stages() const;
  int replica() const;  // this rank's replica index (0 without replicas)
  bool is_first() const { return stage() == 0; }
  bool is_last() const { return stage() == num_stages() - 1; }
  // Layers per stage (as used; stages * virtual_stages entries), and the index in the Sequential of the
  // first layer of this rank's chunk-th stage (global stage stage() + chunk * num_stages()).
  const std::vector<int64_t>& balance() const;
  int64_t first_layer(int chunk = 0) const;
  const PipelineOptions& options() const;
  // The pipeline group (stage order) and, with replicas > 1, this stage's data-parallel group.
  const Group& pipeline_group() const;
  const Group& stage_group() const;

  // The most micro-batches whose activations this rank held at once during the last step, counting
  // one per stage and micro-batch from its forward until its backward (under ZB-H1 until its W).
  // GPipe: chunks; 1F1B: min(stages - stage, chunks); schedule.cpp gives the others. Counted by the
  // implementation.
  int64_t max_live_micro_batches() const;
  const PipelineStepStats& last_step_stats() const;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

namespace pipeline {

// One action of a rank's schedule. kBackward is the whole backward, except under ZB-H1, where it is the
// input gradient only and kWeight the weight gradients of the same micro-batch.
struct Action {
  enum Kind { kForward, kBackward, kWeight } kind;
  int64_t micro_batch;
  int stage = 0;  // the global stage (virtual stage index) it runs
};
std::string to_string(const Action& a);  // "F3", "B3", "W3"

// The ordered actions of rank `stage` out of `stages` for `chunks` micro-batches, with virtual_stages
// stages per rank (interleaved only). Throws the options' errors for a bad combination.
std::vector<Action> make_schedule(Schedule schedule, int stages, int stage, int64_t chunks, int virtual_stages = 1);
// The errors of make_schedule, without building one.
void check_schedule(Schedule schedule, int stages, int64_t chunks, int virtual_stages);

}  // namespace pipeline
}  // namespace dtrain
