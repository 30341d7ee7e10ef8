// Fashion-MNIST: IDX files -> (N,1,H,W) float images in [0,1] (optionally standardized), (N) int64
// labels. The file format is handled by data/idx_reader.
#include "dtrain/datasets/fashion_mnist.h"

#include <sys/stat.h>

#include <ATen/ATen.h>

#include "data/idx_reader.h"

namespace dtrain::datasets {

namespace {

bool is_file(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

// <root>/<name>.gz if present, else <root>/<name>; throws naming both when neither exists.
std::string find_file(const std::string& root, const std::string& name) {
  const std::string base = root.empty() ? name : (root.back() == '/' ? root + name : root + "/" + name);
  if (is_file(base + ".gz")) return base + ".gz";
  if (is_file(base)) return base;
  struct stat st {};
  DTRAIN_CHECK(::stat(root.c_str(), &st) == 0 && S_ISDIR(st.st_mode), "FashionMNIST: folder ", root,
               " does not exist (install the Debian package dataset-fashion-mnist, or pass the folder "
               "holding the IDX files)");
  throw Error(detail::cat(base, ".gz: missing (nor is there ", base,
                          "): FashionMNIST needs the four IDX files of MNIST's layout in ", root));
}

}  // namespace

FashionMNIST::FashionMNIST(const std::string& root, Mode mode, const FashionMNISTOptions& options)
    : mode_(mode), options_(options) {
  DTRAIN_CHECK(!options.standardize() || options.stddev() > 0, "FashionMNIST: stddev must be > 0 to standardize, got ",
               options.stddev());
  const std::string prefix = mode == Mode::kTrain ? "train" : "t10k";
  images_file_ = find_file(root, prefix + "-images-idx3-ubyte");
  labels_file_ = find_file(root, prefix + "-labels-idx1-ubyte");

  data::IdxArray labels = data::read_idx(labels_file_, data::kIdxLabelsMagic, "labels", options.max_samples());
  data::IdxArray images = data::read_idx(images_file_, data::kIdxImagesMagic, "pixels", options.max_samples());
  DTRAIN_CHECK(images.dims[0] == labels.dims[0], images_file_, " holds ", images.dims[0], " images but ", labels_file_,
               " holds ", labels.dims[0], " labels: the files do not belong together");
  DTRAIN_ASSERT(images.items == labels.items, images.items, " vs ", labels.items);
  for (size_t i = 0; i < labels.items; ++i) {
    DTRAIN_CHECK(labels.data[i] < kNumClasses, labels_file_, ": corrupt: label ", int(labels.data[i]), " at index ", i,
                 " is not in [0, ", kNumClasses - 1, "]");
  }

  const auto n = static_cast<int64_t>(images.items);
  const auto rows = static_cast<int64_t>(images.dims[1]);
  const auto cols = static_cast<int64_t>(images.dims[2]);
  // uint8 (N,1,H,W) -> float in [0,1]; .to() copies out of the vector before it is freed.
  images_ = at::from_blob(images.data.data(), {n, 1, rows, cols}, at::kByte).to(at::kFloat).div_(255.0);
  if (options.standardize()) images_.sub_(options.mean()).div_(options.stddev());
  targets_ = at::from_blob(labels.data.data(), {n}, at::kByte).to(at::kLong);  // (N)
}

torch::data::Example<> FashionMNIST::get(size_t index) {
  DTRAIN_CHECK(index < static_cast<size_t>(images_.size(0)), "FashionMNIST: index ", index,
               " out of range for a dataset of ", images_.size(0), " samples");
  const auto i = static_cast<int64_t>(index);
  return {images_[i], targets_[i]};
}

c10::optional<size_t> FashionMNIST::size() const { return static_cast<size_t>(images_.size(0)); }

torch::data::Example<> FashionMNIST::batch(c10::ArrayRef<size_t> indices) const {
  const auto n = static_cast<size_t>(images_.size(0));
  std::vector<int64_t> idx(indices.begin(), indices.end());
  for (size_t k = 0; k < indices.size(); ++k) {
    DTRAIN_CHECK(indices[k] < n, "FashionMNIST: index ", indices[k], " out of range for a dataset of ", n, " samples");
  }
  const at::Tensor index = at::from_blob(idx.data(), {static_cast<int64_t>(idx.size())}, at::kLong);
  at::Tensor data = images_.index_select(0, index);     // (B,1,H,W)
  at::Tensor target = targets_.index_select(0, index);  // (B)
  if (options_.pin_memory()) {
    if (at::hasCUDA()) {
      data = data.pin_memory();
      target = target.pin_memory();
    } else {
      warn_once("fashion_mnist_pin_memory",
                "FashionMNISTOptions().pin_memory(true) has no effect: no CUDA device is available");
    }
  }
  return {data, target};
}

FashionMNISTBatches FashionMNIST::batched() const { return FashionMNISTBatches(*this); }

}  // namespace dtrain::datasets
