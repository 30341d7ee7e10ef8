// Fashion-MNIST (and classic MNIST): torchvision.datasets.FashionMNIST for C++.
//
//   using dtrain::datasets::FashionMNIST;
//   FashionMNIST train(FashionMNIST::kDefaultRoot, FashionMNIST::Mode::kTrain,
//                      dtrain::datasets::FashionMNISTOptions().standardize(true));
//   dtrain::DistributedSampler sampler(train.size().value());
//   // Fast path: whole batches, one index_select each. data (B,1,28,28) float, target (B) int64.
//   auto loader = torch::data::make_data_loader(
//       train.batched(), sampler, torch::data::DataLoaderOptions().batch_size(64).workers(2));
//   // Or LibTorch's usual per-sample path, as with torch::data::datasets::MNIST:
//   auto loader2 = torch::data::make_data_loader(
//       train.map(torch::data::transforms::Stack<>()), sampler, DataLoaderOptions().batch_size(64));
//
// PyTorch tutorial -> C++:
//   DataLoader(ds, batch_size=b, num_workers=n, sampler=s)
//       -> make_data_loader(ds.batched(), s, DataLoaderOptions().batch_size(b).workers(n))
//   pin_memory=True -> FashionMNISTOptions().pin_memory(true): batches from batched()/batch() are
//       pinned (at::Tensor::pin_memory) when a CUDA device is available, so .to(cuda, non_blocking)
//       can overlap; in CPU builds it does nothing (warned once), as PyTorch without an accelerator.
//
// Files: the Debian package dataset-fashion-mnist installs them in /usr/share/datasets/fashion-mnist/
// (train-images-idx3-ubyte.gz, train-labels-idx1-ubyte.gz, t10k-images-idx3-ubyte.gz,
// t10k-labels-idx1-ubyte.gz). Any folder in MNIST's layout works, gzipped or not (name.gz is
// preferred over name); classic MNIST files work too. A missing, corrupt or truncated file throws
// dtrain::Error, one line naming the file and what is wrong.
//
// Images are converted once at load to float in [0, 1] (then standardized if asked), so get(i) and
// batches are views/copies of ready tensors: about 188 MB for the 60000 training images.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>

#include <torch/data/datasets/base.h>
#include <torch/data/example.h>

#include "dtrain/detail/arg.h"
#include "dtrain/errors.h"

namespace dtrain::datasets {

// Mean and standard deviation of the Fashion-MNIST training pixels in [0, 1] (the usual
// Normalize((0.2860,), (0.3530,))). Classic MNIST: 0.1307 / 0.3081.
constexpr double kFashionMNISTMean = 0.2860;
constexpr double kFashionMNISTStd = 0.3530;

struct FashionMNISTOptions {
  // Standardize pixels: (x - mean) / stddev after scaling to [0, 1]. Off: pixels stay in [0, 1].
  DTRAIN_ARG(bool, standardize, false)
  DTRAIN_ARG(double, mean, kFashionMNISTMean)
  DTRAIN_ARG(double, stddev, kFashionMNISTStd)
  // Load only the first N samples (the rest of the files is then neither read nor checked).
  DTRAIN_ARG(std::optional<size_t>, max_samples, std::nullopt)
  // Pin the memory of batches from batch()/batched() when CUDA is available (CPU builds: no effect).
  DTRAIN_ARG(bool, pin_memory, false)
};

class FashionMNISTBatches;

class FashionMNIST : public torch::data::datasets::Dataset<FashionMNIST> {
 public:
  enum class Mode { kTrain, kTest };
  static constexpr const char* kDefaultRoot = "/usr/share/datasets/fashion-mnist";
  static constexpr size_t kNumClasses = 10;
  // torchvision's FashionMNIST.classes, indexed by label.
  static constexpr std::array<const char*, kNumClasses> kClassNames = {
      "T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot"};

  // Loads <root>/{train,t10k}-{images-idx3,labels-idx1}-ubyte[.gz]. Throws dtrain::Error.
  explicit FashionMNIST(const std::string& root = kDefaultRoot, Mode mode = Mode::kTrain,
                        const FashionMNISTOptions& options = FashionMNISTOptions());

  // One sample: data (1,28,28) float (a view), target () int64.
  torch::data::Example<> get(size_t index) override;
  c10::optional<size_t> size() const override;

  // A whole batch with one index_select per tensor: data (B,1,28,28), target (B).
  torch::data::Example<> batch(c10::ArrayRef<size_t> indices) const;
  // This dataset as a BatchDataset whose get_batch is batch(): give it to make_data_loader to get
  // Example<> batches without per-sample work. Shares the tensors (no copy).
  FashionMNISTBatches batched() const;

  const at::Tensor& images() const { return images_; }    // (N,1,28,28) float
  const at::Tensor& targets() const { return targets_; }  // (N) int64
  bool is_train() const { return mode_ == Mode::kTrain; }
  // The files this dataset was read from.
  const std::string& images_file() const { return images_file_; }
  const std::string& labels_file() const { return labels_file_; }
  const FashionMNISTOptions& options() const { return options_; }

 private:
  Mode mode_;
  FashionMNISTOptions options_;
  std::string images_file_, labels_file_;
  at::Tensor images_;   // (N,1,28,28) float
  at::Tensor targets_;  // (N) int64
};

// FashionMNIST::batched(): batches as one Example<> (data (B,1,28,28), target (B)).
class FashionMNISTBatches : public torch::data::datasets::BatchDataset<FashionMNISTBatches, torch::data::Example<>> {
 public:
  explicit FashionMNISTBatches(FashionMNIST dataset) : dataset_(std::move(dataset)) {}
  torch::data::Example<> get_batch(c10::ArrayRef<size_t> indices) override { return dataset_.batch(indices); }
  c10::optional<size_t> size() const override { return dataset_.size(); }
  const FashionMNIST& dataset() const { return dataset_; }

 private:
  FashionMNIST dataset_;
};

}  // namespace dtrain::datasets
