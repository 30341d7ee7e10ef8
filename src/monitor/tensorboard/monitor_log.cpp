#include "monitor/tensorboard/monitor_log.h"

#include <cmath>

#include <ATen/ATen.h>

namespace dtrain::monitor {

TensorBoardLog::TensorBoardLog(const std::string& dir, int64_t histogram_every)
    // Flushed every window: a window is the unit TensorBoard should show as soon as it exists.
    : writer_(dir, SummaryWriterOptions().max_queue(1000)), histogram_every_(histogram_every) {}

void TensorBoardLog::scalar(const std::string& tag, double v, int64_t step) {
  if (std::isfinite(v)) writer_.add_scalar(tag, v, step);
}

void TensorBoardLog::window(const WindowMetrics& w, const std::vector<at::Tensor>& params,
                            const std::vector<std::string>& names) {
  const int64_t step = w.step;
  scalar("train/loss", w.loss, step);
  scalar("train/accuracy", w.accuracy, step);
  scalar("train/samples_per_s", w.samples_per_s, step);
  scalar("train/lr", w.lr, step);
  scalar("train/grad_norm", w.grad_norm, step);
  const std::pair<const char*, const RankStat*> times[] = {{"step", &w.step_ms},           {"other", &w.other_ms},
                                                           {"forward", &w.forward_ms},     {"backward", &w.backward_ms},
                                                           {"optimizer", &w.optimizer_ms}, {"comm", &w.comm_ms},
                                                           {"comm_wait", &w.comm_wait_ms}};
  for (const auto& [name, stat] : times) {
    scalar(std::string("time_ms/") + name, stat->mean, step);
    if (std::isfinite(stat->min) && std::isfinite(stat->max))
      writer_.add_scalars(std::string("ranks/") + name + "_ms", {{"min", stat->min}, {"max", stat->max}}, step);
  }
  scalar("ranks/slowest_rank", w.slowest_rank, step);
  scalar("memory/rss_mb", w.rss_mb.mean, step);

  if (histogram_every_ > 0 && windows_++ % histogram_every_ == 0) {
    at::NoGradGuard no_grad;
    for (size_t i = 0; i < params.size(); ++i) {
      const std::string name = i < names.size() ? names[i] : std::to_string(i);
      if (params[i].numel() == 0) continue;
      writer_.add_histogram("parameters/" + name, params[i], step);
      const at::Tensor& g = params[i].grad();
      if (g.defined()) writer_.add_histogram("gradients/" + name, g, step);
    }
  }
  writer_.flush();
}

void TensorBoardLog::epoch(int64_t epoch, const EpochInfo& info) {
  scalar("epoch/train_loss", info.train_loss(), epoch);
  scalar("epoch/train_accuracy", info.train_accuracy(), epoch);
  scalar("epoch/test_loss", info.test_loss(), epoch);
  scalar("epoch/test_accuracy", info.test_accuracy(), epoch);
  writer_.flush();
}

}  // namespace dtrain::monitor
