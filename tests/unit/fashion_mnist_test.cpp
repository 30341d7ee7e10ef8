// Fashion-MNIST from the Debian package dataset-fashion-mnist: values checked against Python's
// reading of the same files, and every way a file can be broken.
#include "dtrain/datasets/fashion_mnist.h"
#include "matchers.h"

#include <stdlib.h>
#include <zlib.h>

#include <torch/data.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "data/idx_reader.h"
#include "dtrain/sampler.h"
#include "test_util.h"

namespace fs = std::filesystem;
using dtrain::datasets::FashionMNIST;
using dtrain::datasets::FashionMNISTOptions;
using dtrain::test_util::dtrain_error_of;

namespace {

const std::string kRoot = FashionMNIST::kDefaultRoot;

// Values read with Python from the same files:
//   import gzip, numpy as np
//   d = '/usr/share/datasets/fashion-mnist/'
//   for p in ['train', 't10k']:
//       L = np.frombuffer(gzip.open(d + p + '-labels-idx1-ubyte.gz').read(), np.uint8, offset=8)
//       I = np.frombuffer(gzip.open(d + p + '-images-idx3-ubyte.gz').read(), np.uint8, offset=16)
//       I = I.reshape(-1, 28, 28)
//       print(list(L[:12]), [int(I[i].astype(np.int64).sum()) for i in range(3)], np.bincount(L))
//       print(I.mean() / 255, I.std() / 255)
const std::vector<int64_t> kTrainFirstLabels = {9, 0, 0, 3, 0, 2, 7, 2, 5, 5, 0, 9};
const std::vector<int64_t> kTestFirstLabels = {9, 2, 1, 1, 6, 1, 4, 6, 5, 7, 4, 5};
const std::vector<int64_t> kTrainFirstPixelSums = {76247, 84598, 28662};
const std::vector<int64_t> kTestFirstPixelSums = {33456, 100994, 51520};
constexpr double kTrainMean = 0.2860405969887955, kTrainStd = 0.3530242445149223;

std::vector<int64_t> to_vector(const at::Tensor& t) {
  at::Tensor c = t.contiguous().to(at::kLong);
  return std::vector<int64_t>(c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + c.numel());
}

std::string read_file(const fs::path& p, bool gunzip) {
  if (!gunzip) {
    std::ifstream in(p, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), {});
  }
  gzFile f = gzopen(p.c_str(), "rb");
  std::string out;
  char buf[1 << 16];
  int r;
  while ((r = gzread(f, buf, sizeof(buf))) > 0) out.append(buf, r);
  gzclose(f);
  return out;
}

void write_file(const fs::path& p, const std::string& bytes) {
  std::ofstream out(p, std::ios::binary);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

// A fresh temporary folder, removed at the end of the test.
class TempDir {
 public:
  TempDir() {
    std::string tmpl = (fs::temp_directory_path() / "dtrain_fmnist_XXXXXX").string();
    path_ = mkdtemp(tmpl.data());
  }
  ~TempDir() { fs::remove_all(path_); }
  const fs::path& path() const { return path_; }
  // Copies the test split (gzipped, or gunzipped when plain) into this folder.
  void copy_test_split(bool plain) {
    for (const char* name : {"t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"}) {
      const fs::path src = fs::path(kRoot) / (std::string(name) + ".gz");
      if (plain) {
        write_file(path_ / name, read_file(src, true));
      } else {
        fs::copy_file(src, path_ / (std::string(name) + ".gz"));
      }
    }
  }

 private:
  fs::path path_;
};

class FashionMNISTFiles : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    train_ = new FashionMNIST(kRoot, FashionMNIST::Mode::kTrain);
    test_ = new FashionMNIST(kRoot, FashionMNIST::Mode::kTest);
  }
  static void TearDownTestSuite() {
    delete train_;
    delete test_;
  }
  static FashionMNIST* train_;
  static FashionMNIST* test_;
};
FashionMNIST* FashionMNISTFiles::train_ = nullptr;
FashionMNIST* FashionMNISTFiles::test_ = nullptr;

}  // namespace

TEST_F(FashionMNISTFiles, ShapesTypesAndLabelsMatchPython) {
  for (auto [ds, n, labels, sums] : {std::tuple{train_, 60000, kTrainFirstLabels, kTrainFirstPixelSums},
                                     std::tuple{test_, 10000, kTestFirstLabels, kTestFirstPixelSums}}) {
    ASSERT_EQ(ds->size().value(), static_cast<size_t>(n));
    EXPECT_EQ(ds->images().sizes(), (std::vector<int64_t>{n, 1, 28, 28}));
    EXPECT_EQ(ds->images().scalar_type(), at::kFloat);
    EXPECT_EQ(ds->targets().sizes(), (std::vector<int64_t>{n}));
    EXPECT_EQ(ds->targets().scalar_type(), at::kLong);
    EXPECT_EQ(to_vector(ds->targets().slice(0, 0, 12)), labels);
    for (size_t i = 0; i < sums.size(); ++i) {
      const double sum = ds->images()[i].sum().item<double>() * 255.0;
      EXPECT_NEAR(sum, static_cast<double>(sums[i]), 0.5) << "image " << i;
    }
    // 6000 / 1000 of each class.
    EXPECT_EQ(to_vector(at::bincount(ds->targets())), std::vector<int64_t>(10, n / 10));
    EXPECT_GE(ds->images().min().item<float>(), 0.0f);
    EXPECT_LE(ds->images().max().item<float>(), 1.0f);
    EXPECT_EQ(ds->images().max().item<float>(), 1.0f);
  }
  EXPECT_NEAR(train_->images().mean().item<double>(), kTrainMean, 1e-5);
  EXPECT_TRUE(train_->is_train());
  EXPECT_FALSE(test_->is_train());
  EXPECT_STREQ(FashionMNIST::kClassNames[9], "Ankle boot");
  EXPECT_STREQ(FashionMNIST::kClassNames[0], "T-shirt/top");
}

TEST_F(FashionMNISTFiles, GetAndBatchAgree) {
  auto e = test_->get(3);
  EXPECT_EQ(e.data.sizes(), (std::vector<int64_t>{1, 28, 28}));
  EXPECT_EQ(e.target.item<int64_t>(), kTestFirstLabels[3]);
  const std::vector<size_t> idx = {3, 1, 4, 9999, 0};
  auto b = test_->batch(idx);
  EXPECT_EQ(b.data.sizes(), (std::vector<int64_t>{5, 1, 28, 28}));
  EXPECT_EQ(b.target.sizes(), (std::vector<int64_t>{5}));
  for (size_t k = 0; k < idx.size(); ++k) {
    auto one = test_->get(idx[k]);
    EXPECT_TRUE(at::equal(b.data[k], one.data));
    EXPECT_EQ(b.target[k].item<int64_t>(), one.target.item<int64_t>());
  }
  EXPECT_THAT(dtrain_error_of([&] { test_->get(10000); }), HasSubstr("index 10000 out of range"));
  const std::vector<size_t> bad = {1, 10000};
  EXPECT_THAT(dtrain_error_of([&] { test_->batch(bad); }), HasSubstr("index 10000 out of range"));
}

TEST(FashionMNIST, StandardizeUsesMeanAndStd) {
  FashionMNIST ds(kRoot, FashionMNIST::Mode::kTrain,
                  FashionMNISTOptions().standardize(true).mean(kTrainMean).stddev(kTrainStd));
  EXPECT_NEAR(ds.images().mean().item<double>(), 0.0, 1e-4);
  EXPECT_NEAR(ds.images().std().item<double>(), 1.0, 1e-3);
  FashionMNIST def(kRoot, FashionMNIST::Mode::kTest, FashionMNISTOptions().standardize(true).max_samples(10));
  FashionMNIST raw(kRoot, FashionMNIST::Mode::kTest, FashionMNISTOptions().max_samples(10));
  EXPECT_TRUE(at::allclose(def.images(), (raw.images() - 0.2860) / 0.3530));
  EXPECT_THAT(dtrain_error_of([] {
                FashionMNIST(kRoot, FashionMNIST::Mode::kTest, FashionMNISTOptions().standardize(true).stddev(0));
              }),
              HasSubstr("stddev must be > 0"));
}

TEST_F(FashionMNISTFiles, SubsetIsThePrefix) {
  FashionMNIST sub(kRoot, FashionMNIST::Mode::kTrain, FashionMNISTOptions().max_samples(100));
  ASSERT_EQ(sub.size().value(), 100u);
  EXPECT_TRUE(at::equal(sub.images(), train_->images().slice(0, 0, 100)));
  EXPECT_TRUE(at::equal(sub.targets(), train_->targets().slice(0, 0, 100)));
  FashionMNIST more(kRoot, FashionMNIST::Mode::kTest, FashionMNISTOptions().max_samples(1000000));
  EXPECT_EQ(more.size().value(), 10000u);
}

TEST_F(FashionMNISTFiles, BatchedLoaderWithDistributedSamplerAndWorkers) {
  FashionMNIST ds = *test_;
  const int64_t replicas = 2;
  std::vector<int64_t> counts(10, 0);
  for (int64_t rank = 0; rank < replicas; ++rank) {
    dtrain::DistributedSampler sampler(ds.size().value(),
                                       dtrain::DistributedSamplerOptions().num_replicas(replicas).rank(rank));
    sampler.set_epoch(1);
    auto loader = torch::data::make_data_loader(ds.batched(), sampler,
                                                torch::data::DataLoaderOptions().batch_size(64).workers(2));
    size_t seen = 0;
    for (torch::data::Example<>& batch : *loader) {
      ASSERT_EQ(batch.data.dim(), 4);
      ASSERT_EQ(batch.data.size(0), batch.target.size(0));
      seen += batch.target.size(0);
      for (int64_t label : to_vector(batch.target)) ++counts[label];
    }
    EXPECT_EQ(seen, 5000u);
  }
  EXPECT_EQ(counts, std::vector<int64_t>(10, 1000));  // 10000 = 2 x 5000: no padding, all seen once
}

TEST_F(FashionMNISTFiles, StackPathWorksToo) {
  auto loader = torch::data::make_data_loader(
      test_->map(torch::data::transforms::Stack<>()),
      dtrain::DistributedSampler(10000, dtrain::DistributedSamplerOptions().num_replicas(4).rank(3)),
      torch::data::DataLoaderOptions().batch_size(100).workers(2));
  size_t seen = 0;
  for (auto& batch : *loader) {
    EXPECT_EQ(batch.data.sizes(), (std::vector<int64_t>{100, 1, 28, 28}));
    seen += batch.data.size(0);
  }
  EXPECT_EQ(seen, 2500u);
}

TEST(FashionMNIST, PinMemoryIsAcceptedOnCpu) {
  FashionMNIST ds(kRoot, FashionMNIST::Mode::kTest, FashionMNISTOptions().pin_memory(true).max_samples(8));
  const std::vector<size_t> idx = {0, 1};
  auto b = ds.batch(idx);  // pinned with CUDA; unchanged (warned once) without
  EXPECT_EQ(b.data.size(0), 2);
}

TEST_F(FashionMNISTFiles, UngzippedCopyLoadsTheSame) {
  TempDir dir;
  dir.copy_test_split(/*plain=*/true);
  FashionMNIST plain(dir.path().string(), FashionMNIST::Mode::kTest);
  EXPECT_EQ(plain.images_file(), (dir.path() / "t10k-images-idx3-ubyte").string());
  EXPECT_TRUE(at::equal(plain.images(), test_->images()));
  EXPECT_TRUE(at::equal(plain.targets(), test_->targets()));
}

TEST(FashionMNIST, MissingFileOrFolder) {
  TempDir dir;
  dir.copy_test_split(false);
  fs::remove(dir.path() / "t10k-images-idx3-ubyte.gz");
  std::string msg = dtrain_error_of([&] { FashionMNIST(dir.path().string(), FashionMNIST::Mode::kTest); });
  EXPECT_THAT(msg, HasSubstr((dir.path() / "t10k-images-idx3-ubyte.gz").string() + ": missing")) << msg;
  msg = dtrain_error_of([&] { FashionMNIST(dir.path().string(), FashionMNIST::Mode::kTrain); });
  EXPECT_THAT(msg, HasSubstr("train-images-idx3-ubyte.gz: missing")) << msg;
  msg = dtrain_error_of([] { FashionMNIST("/nonexistent/fmnist", FashionMNIST::Mode::kTest); });
  EXPECT_THAT(msg, HasSubstr("/nonexistent/fmnist does not exist")) << msg;
}

TEST(FashionMNIST, WrongMagicNumber) {
  TempDir dir;
  dir.copy_test_split(true);
  // A labels file where the images should be.
  fs::copy_file(dir.path() / "t10k-labels-idx1-ubyte", dir.path() / "t10k-images-idx3-ubyte",
                fs::copy_options::overwrite_existing);
  std::string msg = dtrain_error_of([&] { FashionMNIST(dir.path().string(), FashionMNIST::Mode::kTest); });
  EXPECT_THAT(msg, HasSubstr("t10k-images-idx3-ubyte: not an IDX file of the expected kind: magic number 2049")) << msg;
  // Garbage.
  write_file(dir.path() / "t10k-images-idx3-ubyte", "hello, world, not an IDX file");
  msg = dtrain_error_of([&] { FashionMNIST(dir.path().string(), FashionMNIST::Mode::kTest); });
  EXPECT_THAT(msg, HasSubstr("magic number")) << msg;
  write_file(dir.path() / "t10k-images-idx3-ubyte", "");
  msg = dtrain_error_of([&] { FashionMNIST(dir.path().string(), FashionMNIST::Mode::kTest); });
  EXPECT_THAT(msg, HasSubstr("truncated: expected a 4-byte IDX header, got 0 bytes")) << msg;
}

TEST(FashionMNIST, TruncatedFiles) {
  {  // plain: the exact byte count is known
    TempDir dir;
    dir.copy_test_split(true);
    const fs::path images = dir.path() / "t10k-images-idx3-ubyte";
    fs::resize_file(images, 16 + 1234);
    const std::string msg = dtrain_error_of([&] { FashionMNIST(dir.path().string(), FashionMNIST::Mode::kTest); });
    EXPECT_THAT(msg, HasSubstr(images.string() + ": truncated: expected 7840000 bytes of pixels, got 1234")) << msg;
  }
  {  // gzipped, cut in the middle of the stream
    TempDir dir;
    dir.copy_test_split(false);
    const fs::path images = dir.path() / "t10k-images-idx3-ubyte.gz";
    fs::resize_file(images, fs::file_size(images) / 2);
    const std::string msg = dtrain_error_of([&] { FashionMNIST(dir.path().string(), FashionMNIST::Mode::kTest); });
    EXPECT_THAT(msg, HasSubstr(images.string() + ": truncated: expected 7840000 bytes of pixels, got ")) << msg;
    EXPECT_THAT(msg, HasSubstr("gzip stream ends early")) << msg;
  }
  {  // labels cut
    TempDir dir;
    dir.copy_test_split(true);
    fs::resize_file(dir.path() / "t10k-labels-idx1-ubyte", 8 + 10);
    const std::string msg = dtrain_error_of([&] { FashionMNIST(dir.path().string(), FashionMNIST::Mode::kTest); });
    EXPECT_THAT(msg, HasSubstr("truncated: expected 10000 bytes of labels, got 10")) << msg;
  }
}

TEST(FashionMNIST, CorruptFiles) {
  TempDir dir;
  dir.copy_test_split(false);
  // Bytes flipped inside the deflate data: zlib reports a data error or a failed CRC.
  const fs::path images = dir.path() / "t10k-images-idx3-ubyte.gz";
  std::string bytes = read_file(images, false);
  for (size_t i = bytes.size() / 2; i < bytes.size() / 2 + 64; ++i) bytes[i] = static_cast<char>(~bytes[i]);
  write_file(images, bytes);
  std::string msg = dtrain_error_of([&] { FashionMNIST(dir.path().string(), FashionMNIST::Mode::kTest); });
  EXPECT_THAT(msg, HasSubstr(images.string() + ": ")) << msg;
  EXPECT_THAT(msg, HasSubstr("corrupt")) << msg;

  // Images and labels that do not belong together (different counts).
  TempDir mixed;
  mixed.copy_test_split(true);
  std::string labels = read_file(mixed.path() / "t10k-labels-idx1-ubyte", false);
  labels[7] = static_cast<char>(0x0f);  // count 10000 (0x2710) -> 0x270f = 9999
  labels.pop_back();
  write_file(mixed.path() / "t10k-labels-idx1-ubyte", labels);
  msg = dtrain_error_of([&] { FashionMNIST(mixed.path().string(), FashionMNIST::Mode::kTest); });
  EXPECT_THAT(msg, HasSubstr("holds 10000 images but")) << msg;
  EXPECT_THAT(msg, HasSubstr("holds 9999 labels")) << msg;

  // A label outside 0..9; trailing bytes.
  labels = read_file(dir.path() / "t10k-labels-idx1-ubyte.gz", true);
  labels[8 + 5] = static_cast<char>(200);
  write_file(mixed.path() / "t10k-labels-idx1-ubyte", labels);
  msg = dtrain_error_of([&] { FashionMNIST(mixed.path().string(), FashionMNIST::Mode::kTest); });
  EXPECT_THAT(msg, HasSubstr("label 200 at index 5")) << msg;
  labels[8 + 5] = 1;
  write_file(mixed.path() / "t10k-labels-idx1-ubyte", labels + "xyz");
  msg = dtrain_error_of([&] { FashionMNIST(mixed.path().string(), FashionMNIST::Mode::kTest); });
  EXPECT_THAT(msg, HasSubstr("3 unexpected bytes after the 10000 items")) << msg;
}

TEST(IdxReader, ReadsHeaderAndPrefix) {
  auto labels =
      dtrain::data::read_idx(kRoot + "/train-labels-idx1-ubyte.gz", dtrain::data::kIdxLabelsMagic, "labels", 5);
  EXPECT_EQ(labels.dims, (std::vector<uint32_t>{60000}));
  EXPECT_EQ(labels.items, 5u);
  EXPECT_EQ(labels.data, (std::vector<uint8_t>{9, 0, 0, 3, 0}));
  auto images = dtrain::data::read_idx(kRoot + "/t10k-images-idx3-ubyte.gz", dtrain::data::kIdxImagesMagic, "pixels");
  EXPECT_EQ(images.dims, (std::vector<uint32_t>{10000, 28, 28}));
  EXPECT_EQ(images.data.size(), 7840000u);
}
