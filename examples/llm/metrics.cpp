#include "llm/metrics.h"

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <vector>

#include <ATen/ATen.h>

#include "dtrain/dtrain.h"
#include "dtrain/system.h"

namespace llm {

double flops_per_token(const llama::ModelArgs& a, int64_t seq_len) {
  const double dense = static_cast<double>(a.num_params() - a.vocab_size * a.dim);  // the embedding is a lookup
  const double attention = 12.0 * static_cast<double>(a.n_layers * a.n_heads * a.head_dim() * seq_len);
  return 6.0 * dense + attention;
}

double measure_peak_flops(c10::ScalarType dtype, int64_t n) {
  // Fixed values, not random ones: the global generator's state is the training's (a resumed run
  // restores it from the checkpoint, and this runs after that).
  const at::Tensor a = at::linspace(-1, 1, n * n, at::TensorOptions().dtype(dtype)).view({n, n});
  const at::Tensor b = a.t().contiguous();
  at::Tensor c = at::mm(a, b);  // warm up: the thread pool, the kernel's packing buffers
  double best = 0;
  for (int round = 0; round < 3; ++round) {
    const auto t0 = std::chrono::steady_clock::now();
    int64_t reps = 0;
    double secs = 0;
    do {
      at::mm_out(c, a, b);
      ++reps;
      secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    } while (secs < 0.1);
    best = std::max(best, 2.0 * static_cast<double>(n * n * n) * static_cast<double>(reps) / secs);
  }
  return best;
}

TrainMetrics::TrainMetrics(TrainMetricsOptions options, double flops_per_token, double peak_flops)
    : o_(std::move(options)), flops_per_token_(flops_per_token), peak_flops_(peak_flops) {
  if (o_.rank != 0) return;
  const std::filesystem::path dump(o_.dump_folder);
  std::filesystem::create_directories(dump);
  if (o_.jsonl) {
    jsonl_.open(dump / "metrics.jsonl", std::ios::app);
    DTRAIN_CHECK(jsonl_.good(), "job.dump_folder ", dump.string(), ": cannot write metrics.jsonl");
  }
  if (o_.tensorboard) tb_ = std::make_unique<dtrain::SummaryWriter>((dump / "tb").string());
  // The bar only where one is drawn (a terminal, or dtrain-run's on one): the metric lines are the log.
  if (o_.total_steps > 0)
    bar_.emplace(dtrain::ProgressOptions()
                     .total(o_.total_steps)
                     .label("train")
                     .plain_lines(false)
                     .samples_per_step(o_.windows_per_step * o_.dp));
}

void TrainMetrics::step_done(int64_t step, double loss) {
  ++steps_since_;
  if (bar_) bar_->update(step, loss);
}

double TrainMetrics::log(int64_t step, const StepMetricsInput& r) {
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - since_).count();
  const double rank_tokens = static_cast<double>(steps_since_ * o_.tokens_per_step);
  const size_t w = static_cast<size_t>(o_.world);
  std::vector<double> v(2 * w + 1, 0.0);
  v[static_cast<size_t>(o_.rank)] = rank_tokens / secs;
  v[w + static_cast<size_t>(o_.rank)] = static_cast<double>(dtrain::peak_rss_bytes()) / (1 << 20);
  v[2 * w] = r.loss;
  v = dtrain::all_reduce_values(v);
  const double loss = v[2 * w] / static_cast<double>(w);  // tensor-parallel ranks hold the same loss
  since_ = std::chrono::steady_clock::now();
  steps_since_ = 0;
  if (o_.rank != 0) return loss;
  // Every rank computes the model's FLOPs for its own windows; tensor- and context-parallel ranks share
  // theirs, so
  // the job's model FLOP/s are the data-parallel ranks' tokens, spread over every rank's peak.
  const double total = rank_tokens * static_cast<double>(o_.dp) / secs;
  const double mfu = total * flops_per_token_ / (peak_flops_ * static_cast<double>(o_.world));
  double peak = 0;
  std::string tps, rss;
  for (size_t i = 0; i < w; ++i) {
    tps += (i ? "," : "") + std::to_string(v[i]);
    rss += (i ? "," : "") + std::to_string(v[w + i]);
    peak = std::max(peak, v[w + i]);
  }
  if (bar_) bar_->finish();  // the line goes under the bar, which the next step redraws
  std::printf(
      "step %5lld/%lld  loss %.4f  lr %.2e  grad_norm %.3f  tokens/s %.0f per rank, %.0f total  MFU %.1f%%  "
      "peak RSS %.0f MiB (max over ranks)\n",
      static_cast<long long>(step), static_cast<long long>(o_.total_steps), loss, r.lr, r.grad_norm,
      total / static_cast<double>(o_.dp), total, 100 * mfu, peak);
  std::fflush(stdout);
  if (jsonl_.is_open()) {
    char head[320];
    std::snprintf(head, sizeof head,
                  "{\"step\": %lld, \"loss\": %.17g, \"lr\": %.17g, \"grad_norm\": %.17g, \"mfu\": %.17g, ",
                  static_cast<long long>(step), loss, r.lr, r.grad_norm, mfu);
    jsonl_ << head << "\"tokens_per_s\": [" << tps << "], \"tokens_per_s_total\": " << total << ", \"peak_rss_mib\": ["
           << rss << "]}\n";
    jsonl_.flush();
  }
  if (tb_) {
    tb_->add_scalar("loss", loss, step);
    tb_->add_scalar("lr", r.lr, step);
    tb_->add_scalar("grad_norm", r.grad_norm, step);
    tb_->add_scalar("tokens_per_s", total, step);
    tb_->add_scalar("mfu", mfu, step);
    tb_->add_scalar("peak_rss_mib", peak, step);
    tb_->flush();
  }
  return loss;
}

void TrainMetrics::finish() {
  if (bar_) bar_->finish();
  if (tb_) tb_->flush();
}

}  // namespace llm
