// TensorBoard event files from C++: PyTorch's torch.utils.tensorboard.SummaryWriter.
//
//   dtrain::SummaryWriter writer("runs/exp1");                  // as SummaryWriter(log_dir="runs/exp1")
//   writer.add_scalar("loss", loss, step);
//   writer.add_scalars("loss", {{"train", train_loss}, {"test", test_loss}}, step);
//   writer.add_histogram("fc1.weight", fc1->weight, step);     // TensorBoard's histogram format
//   writer.add_text("config", "lr 0.001, batch 64");
//   writer.close();                                            // or let the destructor do it
//   // then: tensorboard --logdir runs   and open http://localhost:6006
//
// Files are named as TensorBoard expects, events.out.tfevents.<seconds>.<host>.<pid>.<n><suffix>, and
// hold TFRecords (masked CRC-32C on each) of TensorBoard's Event messages; the first is
// file_version "brain.Event:2". add_scalars writes each of its tags into a run of its own, the
// sub-folder <log_dir>/<main_tag with '/' as '_'>_<tag>, with main_tag as the tag, as PyTorch does,
// so TensorBoard draws them in one chart.
//
// A failed write (disk full, folder removed) prints one warning and the writer drops what follows:
// monitoring never stops the training. A thread of the writer flushes its files every flush_secs, as
// PyTorch's does; a mutex guards them, so the writer may also be called from several threads.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>

#include <ATen/core/Tensor.h>

#include "dtrain/detail/arg.h"

namespace dtrain {

struct SummaryWriterOptions {
  // Appended to the default log_dir (runs/<Mon>DD_HH-MM-SS_<host><comment>) when log_dir is empty.
  DTRAIN_ARG(std::string, comment, "")
  // Events buffered before they are flushed to the file (PyTorch's max_queue).
  DTRAIN_ARG(int, max_queue, 10)
  // At most this many seconds between an event and its flush: the writer's timer thread flushes every
  // flush_secs, also when no value is added (0: every event is flushed at once, and no thread).
  DTRAIN_ARG(double, flush_secs, 120)
  // Appended to every event file's name.
  DTRAIN_ARG(std::string, filename_suffix, "")
};

class SummaryWriter {
 public:
  // Creates log_dir (and parents) and the event file. Empty log_dir: runs/<date>_<host><comment>, as
  // PyTorch. Bad options throw dtrain::Error; a folder or file that cannot be created is a warning.
  explicit SummaryWriter(std::string log_dir = "", SummaryWriterOptions options = SummaryWriterOptions());
  ~SummaryWriter();  // close()
  SummaryWriter(const SummaryWriter&) = delete;
  SummaryWriter& operator=(const SummaryWriter&) = delete;

  // walltime: seconds since the epoch (default: now); global_step: the x axis (default: 0, unset).
  // The value is stored as a float32, as PyTorch's add_scalar does.
  void add_scalar(const std::string& tag, double scalar_value, std::optional<int64_t> global_step = std::nullopt,
                  std::optional<double> walltime = std::nullopt);
  // Several curves in one chart: tag -> value, each written to the run <log_dir>/<main_tag>_<tag>.
  void add_scalars(const std::string& main_tag, const std::map<std::string, double>& tag_scalar_dict,
                   std::optional<int64_t> global_step = std::nullopt, std::optional<double> walltime = std::nullopt);
  // A histogram of the tensor's values with PyTorch's default bins ("tensorflow": 0 and +-1e-12 x 1.1^k
  // up to 1e20, trimmed to the values' support). An empty tensor throws dtrain::Error (PyTorch raises
  // too); a tensor with no finite value inside +-1e20 is skipped with a warning.
  void add_histogram(const std::string& tag, const at::Tensor& values,
                     std::optional<int64_t> global_step = std::nullopt, std::optional<double> walltime = std::nullopt);
  // Text (markdown) for TensorBoard's text dashboard, under the tag "<tag>/text_summary" as PyTorch.
  void add_text(const std::string& tag, const std::string& text_string,
                std::optional<int64_t> global_step = std::nullopt, std::optional<double> walltime = std::nullopt);

  // Writes every buffered event of this writer's files to disk.
  void flush();
  // Flushes and closes the files. Idempotent; an add_* after it starts new files, as in PyTorch.
  void close();

  const std::string& get_logdir() const;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace dtrain
