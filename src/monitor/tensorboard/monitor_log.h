// What Monitor writes to TensorBoard (MonitorOptions().tensorboard(true)), on the aggregating rank:
// the tags, their grouping, and when histograms are taken. Kept apart from monitor.cpp, which only
// hands over each window and epoch.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "dtrain/monitor.h"
#include "dtrain/summary_writer.h"

namespace dtrain::monitor {

class TensorBoardLog {
 public:
  TensorBoardLog(const std::string& dir, int64_t histogram_every);

  // One window (x axis: its last step). Curves, each a TensorBoard chart:
  //   train/loss, train/accuracy, train/samples_per_s (all ranks), train/lr, train/grad_norm
  //   time_ms/step, /other, /forward, /backward, /optimizer, /comm, /comm_wait  (means over ranks)
  //   ranks/<same names>  min and max over ranks in one chart (add_scalars: runs ranks_<name>_min/_max)
  //   ranks/slowest_rank  the rank the others waited for
  //   memory/rss_mb       mean over ranks
  // Non-finite values (a loop that passes no accuracy) are left out. Every histogram_every windows,
  // from the first: parameters/<name> and gradients/<name> of the watched parameters.
  void window(const WindowMetrics& w, const std::vector<at::Tensor>& params, const std::vector<std::string>& names);
  // epoch/train_loss, epoch/train_accuracy, epoch/test_accuracy at step = epoch.
  void epoch(int64_t epoch, const EpochInfo& info);
  void close() { writer_.close(); }

 private:
  void scalar(const std::string& tag, double v, int64_t step);
  SummaryWriter writer_;
  int64_t histogram_every_;
  int64_t windows_ = 0;
};

}  // namespace dtrain::monitor
