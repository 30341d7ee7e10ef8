// train_llm's metrics, as torchtitan's MetricsProcessor: every log_freq steps the loss over all
// ranks, lr, gradient norm, tokens/s of every rank and of the job, MFU and every rank's peak RSS,
// printed by rank 0 and written to <dump_folder>/metrics.jsonl and TensorBoard; on a terminal a
// progress bar between the lines.
//
//   llm::TrainMetrics metrics(options, llm::flops_per_token(args, seq_len), llm::measure_peak_flops(at::kFloat));
//   for (step...) { ...; metrics.step_done(step, loss); if (step % log_freq == 0) metrics.log(step, r); }
//   metrics.finish();
//
// MFU (model FLOPs utilization) = model FLOPs per token x this rank's tokens/s over this rank's
// measured peak: the FLOP/s of a large matmul in the training dtype, at this rank's threads, timed
// while every rank measures at once (the ranks share the machine's cores as they do in training).
#pragma once

#include <chrono>
#include <cstdint>
#include <fstream>
#include <memory>
#include <optional>
#include <string>

#include <c10/core/ScalarType.h>

#include "dtrain/monitor.h"
#include "dtrain/summary_writer.h"
#include "llm/llama.h"

namespace llm {

// torchtitan's model FLOPs per token of a training step (forward and backward): 6 N for the matmuls
// of the N parameters besides the embedding (a lookup, no FLOPs), and 12 L H Dh T for attention's
// scores and weighted values (L layers, H heads of Dh, T the sequence length; causal masking not
// discounted, as torchtitan and PaLM's appendix count it).
double flops_per_token(const llama::ModelArgs& args, int64_t seq_len);

// FLOP/s of an n x n x n matmul in `dtype` on this rank's intra-op threads: the best of a few timed
// rounds of at least 0.1 s each. Collective-free, but meant to be called by every rank at once.
double measure_peak_flops(c10::ScalarType dtype, int64_t n = 512);

struct StepMetricsInput {
  double loss = 0, grad_norm = 0, lr = 0;
};

struct TrainMetricsOptions {
  int rank = 0, world = 1;
  int64_t dp = 1;                // data-parallel ranks (each reads its own windows)
  int64_t tokens_per_step = 0;   // this rank's tokens per optimizer step
  int64_t windows_per_step = 0;  // this rank's windows (samples) per optimizer step
  int64_t total_steps = 0;       // for the progress bar
  std::string dump_folder;       // metrics.jsonl and tb/ go here (rank 0)
  bool jsonl = true, tensorboard = false;
};

class TrainMetrics {
 public:
  // Rank 0 opens metrics.jsonl (appending: a resumed run continues the file) and the TensorBoard
  // writer; a file that cannot be written is an error on that rank (the caller makes it collective).
  TrainMetrics(TrainMetricsOptions options, double flops_per_token, double peak_flops);
  // After every step: the progress bar (rank 0, on a terminal only).
  void step_done(int64_t step, double loss);
  // The metrics of the steps since the last call. Collective (one all-reduce of a few values).
  // Returns the loss averaged over the ranks.
  double log(int64_t step, const StepMetricsInput& r);
  void finish();  // ends the bar's line

  double peak_flops() const { return peak_flops_; }
  double flops_per_token() const { return flops_per_token_; }

 private:
  TrainMetricsOptions o_;
  double flops_per_token_, peak_flops_;
  std::ofstream jsonl_;
  std::unique_ptr<dtrain::SummaryWriter> tb_;
  std::optional<dtrain::Progress> bar_;
  std::chrono::steady_clock::time_point since_ = std::chrono::steady_clock::now();
  int64_t steps_since_ = 0;
};

}  // namespace llm
