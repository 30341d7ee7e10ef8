// --sample_log of train_fashion_mnist: which dataset indices every rank trained, in which step, so
// that tests can count every sample of an epoch across ranks, restarts and world sizes.
//
// File: <dir>/samples.rank<RANK>.attempt<TORCHELASTIC_RESTART_COUNT, or 0>.txt, appended to, one line
// per trained sample:
//   <epoch> <step> <index>
// epoch: 1-based; step: the global optimizer step the sample was trained in, 1-based, so a checkpoint
// checkpoint_<S>.pt holds the effect of steps 1..S and lines with step > S were replayed after a
// resume from it; index: the dataset index (padded duplicates of DistributedSampler appear as the
// index they repeat). Each step's lines are flushed before the next step starts.
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include <torch/data/datasets/base.h>
#include <torch/data/example.h>

#include "dtrain/datasets/fashion_mnist.h"

namespace train {

// A batch together with the dataset indices it was built from.
struct IndexedBatch {
  torch::data::Example<> example;  // data (B, 1, 28, 28), target (B)
  std::vector<size_t> indices;     // (B)
};

// FashionMNIST::batched() that also hands out the indices of each batch (the DataLoader gives only
// the batch itself, and with worker threads the order of fetches is not the order of batches).
class IndexedBatches : public torch::data::datasets::BatchDataset<IndexedBatches, IndexedBatch> {
 public:
  explicit IndexedBatches(dtrain::datasets::FashionMNIST dataset) : dataset_(std::move(dataset)) {}
  IndexedBatch get_batch(c10::ArrayRef<size_t> indices) override {
    return {dataset_.batch(indices), std::vector<size_t>(indices.begin(), indices.end())};
  }
  c10::optional<size_t> size() const override { return dataset_.size(); }

 private:
  dtrain::datasets::FashionMNIST dataset_;
};

// The file of one rank in one attempt (the format above). Inactive when `dir` is empty.
class SampleLog {
 public:
  SampleLog(const std::string& dir, int rank, int attempt);
  ~SampleLog();
  SampleLog(const SampleLog&) = delete;
  SampleLog& operator=(const SampleLog&) = delete;
  // Appends the step's indices and flushes them. Throws dtrain::Error naming the file on failure.
  void write(int64_t epoch, int64_t step, const std::vector<size_t>& indices);

 private:
  std::string path_;
  std::FILE* file_ = nullptr;
};

}  // namespace train
