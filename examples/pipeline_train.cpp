// pipeline_train: the tutorial's section 5.2 (`Pipe(model, chunks=4)`) for real — SimpleModel
// (128 -> 256 -> 256 -> 10) split over the ranks, one stage per rank, the batch split into
// micro-batches, trained with GPipe or 1F1B; with --replicas 2 on 4 ranks, 2 stages x 2 replicas.
//
//   ./build/bin/dtrain-run --standalone --nproc_per_node 2 ./build/bin/pipeline_train --chunks 4
//   ./build/bin/dtrain-run --standalone --nproc_per_node 4 ./build/bin/pipeline_train --replicas 2
//
// Python (the tutorial, deprecated torch.distributed.pipeline.sync):   C++ (dtrain):
//   model = nn.Sequential(l1.to("cuda:0"), l2.to("cuda:1"))               the whole Sequential on every rank;
//   model = Pipe(model, chunks=4)                                         dtrain::Pipeline pipe(seq,
//   PipelineOptions().chunks(4)) output = model(input).local_value(); loss(output).backward()          pipe.step(input,
//   target, loss_fn) optimizer.step()                                                      optimizer.step() on every
//   rank
// Pipe runs the stages on the GPUs of one process; dtrain runs them on ranks (processes, machines), so
// every rank steps its own stage's optimizer. The task: labels from a fixed random linear "teacher" of
// the inputs, so the loss falls. The last line (rank 0) is `RESULT steps=N first_loss=A final_loss=B`.
#include <cstdio>
#include <string>

#include <ATen/ATen.h>
#include <CLI/CLI.hpp>

#include "cli_checks.h"
#include <torch/nn/functional/loss.h>
#include <torch/optim/adam.h>
#include <torch/utils.h>

#include "dtrain/pipeline.h"
#include "dtrain/process_group.h"
#include "dtrain/system.h"
#include "tutorial_models.h"

int main(int argc, char** argv) {
  CLI::App app{"The tutorial's SimpleModel trained in a pipeline over the ranks"};
  int steps = 30, replicas = 1;
  int64_t batch_size = 64, chunks = 4;
  double lr = 1e-3;
  std::string schedule = "1f1b";
  app.add_option("--steps", steps, "training steps")->check(dtrain_cli::positive());
  app.add_option("--batch_size", batch_size, "samples per step (per replica)")->check(dtrain_cli::positive());
  app.add_option("--chunks", chunks, "micro-batches per step")->check(dtrain_cli::positive());
  app.add_option("--schedule", schedule, "gpipe or 1f1b")->check(CLI::IsMember({"gpipe", "1f1b"}));
  app.add_option("--replicas", replicas, "data-parallel copies of the pipeline")->check(dtrain_cli::positive());
  app.add_option("--lr", lr, "Adam learning rate");
  CLI11_PARSE(app, argc, argv);

  dtrain::reduce_allocator_churn();
  dtrain::init_process_group();
  // doc:begin pipeline
  // The same initial weights on every rank: each keeps only its own stage's layers.
  torch::manual_seed(0);
  tutorial::SimpleModel model;
  dtrain::Pipeline pipe(model->net,
                        dtrain::PipelineOptions()
                            .chunks(chunks)
                            .schedule(schedule == "gpipe" ? dtrain::Schedule::kGPipe : dtrain::Schedule::k1F1B)
                            .replicas(replicas));
  std::printf("rank %d: stage %d of %d (replica %d), layers %lld..%lld of the SimpleModel\n", dtrain::rank(),
              pipe.stage(), pipe.num_stages(), pipe.replica(), static_cast<long long>(pipe.first_layer()),
              static_cast<long long>(pipe.first_layer() + pipe.balance()[pipe.stage()] - 1));
  torch::optim::Adam optimizer(pipe.parameters(), torch::optim::AdamOptions(lr));
  // doc:end pipeline

  // doc:begin loop
  // Data: the same stream on every rank (each replica takes its slice of a global batch).
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1);
  const at::Tensor teacher = at::randn({128, 10}, gen);
  auto loss_fn = [](const at::Tensor& out, const at::Tensor& t) {
    return torch::nn::functional::cross_entropy(out, t);
  };
  double first_loss = 0, loss = 0;
  for (int step = 0; step < steps; ++step) {
    at::Tensor x = at::randn({batch_size * replicas, 128}, gen);  // (R*B, 128)
    at::Tensor y = x.mm(teacher).argmax(1);                       // (R*B,)
    x = x.chunk(replicas)[pipe.replica()];
    y = y.chunk(replicas)[pipe.replica()];
    optimizer.zero_grad();
    auto r = pipe.step(pipe.is_first() ? x : at::Tensor(), pipe.is_last() ? y : at::Tensor(), loss_fn);
    optimizer.step();
    loss = r.loss;  // the batch's mean loss, on every rank
    if (step == 0) first_loss = loss;
    if (dtrain::rank() == 0 && (step % 10 == 0 || step == steps - 1))
      std::printf("step %d: loss %.4f (%s, chunks %lld, peak stored micro-batches on this stage %lld)\n", step, loss,
                  dtrain::to_string(pipe.options().schedule()).c_str(), static_cast<long long>(chunks),
                  static_cast<long long>(pipe.max_live_micro_batches()));
  }
  // doc:end loop
  if (dtrain::rank() == 0) std::printf("RESULT steps=%d first_loss=%.4f final_loss=%.4f\n", steps, first_loss, loss);
  dtrain::destroy_process_group();
  return 0;
}
