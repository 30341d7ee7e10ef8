// The parts of TensorBoard's file format that are dtrain's own: CRC-32C, record framing, the bucket
// edges, the file name, and a failed write that must not stop anything. TensorBoard itself reads
// the files in tests/dist/test_tensorboard.py.
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <cstring>
#include <filesystem>
#include <regex>
#include <thread>

#include <ATen/ATen.h>

#include "common/util.h"
#include "dtrain/errors.h"
#include "dtrain/monitor.h"
#include "dtrain/summary_writer.h"
#include "monitor/tensorboard/histogram.h"
#include "monitor/tensorboard/record.h"
#include "matchers.h"
#include "time_scale.h"

namespace tb = dtrain::tensorboard;
namespace fs = std::filesystem;

namespace {

// A fresh folder under the temporary directory, removed with everything in it.
struct TempDir {
  explicit TempDir(const std::string& name) {
    std::string tmpl = (fs::temp_directory_path() / ("dtrain_" + name + "_XXXXXX")).string();
    path_ = ::mkdtemp(tmpl.data()) ? tmpl : "";
  }
  ~TempDir() {
    std::error_code ec;
    if (!path_.empty()) fs::remove_all(path_, ec);
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

uint64_t le64(const std::string& s, size_t at) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | static_cast<unsigned char>(s[at + i]);
  return v;
}
uint32_t le32(const std::string& s, size_t at) { return static_cast<uint32_t>(le64(s + std::string(4, '\0'), at)); }

// The records of an event file whose framing and both checksums are right, in order; stops at the
// first record that is cut short.
std::vector<std::string> read_records(const std::string& bytes) {
  std::vector<std::string> out;
  size_t at = 0;
  while (at + 12 <= bytes.size()) {
    const uint64_t n = le64(bytes, at);
    EXPECT_EQ(le32(bytes, at + 8), tb::masked_crc32c(bytes.data() + at, 8)) << "length CRC at " << at;
    if (at + 12 + n + 4 > bytes.size()) break;
    const std::string data = bytes.substr(at + 12, n);
    EXPECT_EQ(le32(bytes, at + 12 + n), tb::masked_crc32c(data.data(), data.size())) << "data CRC at " << at;
    out.push_back(data);
    at += 12 + n + 4;
  }
  return out;
}

std::vector<fs::path> event_files(const fs::path& dir) {
  std::vector<fs::path> v;
  for (const auto& e : fs::directory_iterator(dir))
    if (e.path().filename().string().rfind("events.out.tfevents.", 0) == 0) v.push_back(e.path());
  return v;
}

}  // namespace

TEST(Crc32c, StandardCheckValues) {
  EXPECT_EQ(tb::crc32c("123456789", 9), 0xE3069283u);  // the CRC catalogue's check value
  EXPECT_EQ(tb::crc32c("", 0), 0u);
  // RFC 3720 (iSCSI) B.4: 32 zero bytes, 32 bytes of 0xff, the bytes 0..31.
  std::string zeros(32, '\0'), ones(32, '\xff'), ascending(32, '\0');
  for (int i = 0; i < 32; ++i) ascending[i] = static_cast<char>(i);
  EXPECT_EQ(tb::crc32c(zeros.data(), 32), 0x8A9136AAu);
  EXPECT_EQ(tb::crc32c(ones.data(), 32), 0x62A8AB43u);
  EXPECT_EQ(tb::crc32c(ascending.data(), 32), 0x46DD794Eu);
  // The mask: rotate right by 15, add 0xa282ead8 (0xE3069283 -> 0x2507C60D + 0xA282EAD8).
  EXPECT_EQ(tb::masked_crc32c("123456789", 9), 0xC78AB0E5u);
}

TEST(TfRecord, FramesLengthDataAndChecksums) {
  const std::string data = "an event";
  const std::string r = tb::tfrecord(data);
  ASSERT_EQ(r.size(), data.size() + 16);
  EXPECT_EQ(le64(r, 0), data.size());
  EXPECT_EQ(le32(r, 8), tb::masked_crc32c(r.data(), 8));
  EXPECT_EQ(r.substr(12, data.size()), data);
  EXPECT_EQ(le32(r, 12 + data.size()), tb::masked_crc32c(data.data(), data.size()));
}

TEST(Histogram, DefaultEdgesAndTrimmedBuckets) {
  const auto& e = tb::default_bucket_edges();
  ASSERT_EQ(e.size(), 1549u);  // 774 positive edges (1e-12 x 1.1^k < 1e20), as many negative, and 0
  EXPECT_EQ(e[774], 0.0);
  EXPECT_EQ(e[775], 1e-12);
  EXPECT_EQ(e[773], -1e-12);
  EXPECT_TRUE(std::is_sorted(e.begin(), e.end()));

  // 1.0 and 1.005 share the bucket [0.917.., 1.00897..); -2 lies far below.
  tb::Histogram h;
  ASSERT_TRUE(tb::make_histogram(at::tensor({1.0, -2.0, 1.005}, at::kDouble), e, h));
  EXPECT_EQ(h.min, -2.0);
  EXPECT_EQ(h.max, 1.005);
  EXPECT_EQ(h.num, 3);
  EXPECT_NEAR(h.sum, 0.005, 1e-12);
  EXPECT_DOUBLE_EQ(h.sum_squares, 1 + 4 + 1.005 * 1.005);
  ASSERT_EQ(h.bucket.size(), h.bucket_limit.size());
  EXPECT_EQ(h.bucket.front(), 0.0);  // the empty bucket that carries the support's left edge
  double total = 0;
  for (double c : h.bucket) total += c;
  EXPECT_EQ(total, 3);
  EXPECT_EQ(h.bucket[1], 1.0);  // -2's bucket
  EXPECT_EQ(h.bucket.back(), 2.0);
  EXPECT_LT(h.bucket_limit[0], -2.0);
  EXPECT_GT(h.bucket_limit.back(), 1.005);
  EXPECT_LE(h.bucket_limit[h.bucket_limit.size() - 2], 1.0);

  EXPECT_FALSE(tb::make_histogram(at::tensor({NAN, 1e30}, at::kDouble), e, h));  // nothing in a bucket
}

TEST(SummaryWriter, FileNameAndRecords) {
  TempDir dir("tb_names");
  {
    dtrain::SummaryWriter w(dir.path(), dtrain::SummaryWriterOptions().filename_suffix(".v2"));
    w.add_scalar("a", 1.0, 1);
    w.add_text("t", "x");
  }
  const auto files = event_files(dir.path());
  ASSERT_EQ(files.size(), 1u);
  const std::regex name("events\\.out\\.tfevents\\.[0-9]{10}\\." + dtrain::util::host_name() + "\\." +
                        std::to_string(::getpid()) + "\\.[0-9]+\\.v2");
  EXPECT_TRUE(std::regex_match(files[0].filename().string(), name)) << files[0];
  const auto records = read_records(dtrain::util::read_file(files[0].string()));
  ASSERT_EQ(records.size(), 3u);  // file_version, the scalar, the text
  EXPECT_THAT(records[0], HasSubstr("brain.Event:2"));
}

TEST(SummaryWriter, BadInputIsAClearError) {
  TempDir dir("tb_bad");
  dtrain::SummaryWriter w(dir.path());
  try {
    w.add_histogram("empty", at::zeros({0}));
    FAIL() << "no error";
  } catch (const dtrain::Error& e) {
    EXPECT_THAT(std::string(e.what()), HasSubstr("tag empty: the tensor has no element")) << e.what();
  }
  EXPECT_THROW(dtrain::SummaryWriter(dir.path(), dtrain::SummaryWriterOptions().max_queue(0)), dtrain::Error);
}

TEST(SummaryWriter, UnwritableFolderWarnsAndTrainingGoesOn) {
  testing::internal::CaptureStderr();
  {
    dtrain::SummaryWriter w("/proc/self/no_such_folder/run");
    w.add_scalar("loss", 1.0, 1);
    w.add_histogram("w", at::ones({4}), 1);
    w.add_scalars("ranks", {{"min", 1.0}, {"max", 2.0}}, 1);  // two more runs, no more warnings
    w.flush();
  }
  const std::string err = testing::internal::GetCapturedStderr();
  EXPECT_THAT(err, HasSubstr("SummaryWriter: cannot create the folder /proc/self/no_such_folder/run")) << err;
  EXPECT_EQ(err.find("SummaryWriter", err.find("SummaryWriter") + 1), std::string::npos) << "warned twice: " << err;
}

// PyTorch's writer flushes on a timer: a value added to a writer that then stays idle reaches the
// file without another call (its record is far smaller than stdio's buffer, and max_queue is large,
// so only the timer can write it out). The destructor stops a timer with a long period at once.
TEST(SummaryWriter, IdleWriterFlushesWithinFlushSecs) {
  using Clock = std::chrono::steady_clock;
  TempDir dir("tb_timer");
  {
    dtrain::SummaryWriter w(dir.path(), dtrain::SummaryWriterOptions().max_queue(1000).flush_secs(0.2));
    const auto files = event_files(dir.path());
    ASSERT_EQ(files.size(), 1u);
    w.add_scalar("loss", 1.0, 1);
    const auto t0 = Clock::now();
    size_t records = 0;
    // 20 s: far above 0.2 s, so a loaded machine cannot fail it; without the timer it never comes.
    while (Clock::now() - t0 < std::chrono::seconds(20)) {
      records = read_records(dtrain::util::read_file(files[0].string())).size();
      if (records == 2) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    EXPECT_EQ(records, 2u) << "file_version and the scalar: the idle writer did not flush within 20 s";
  }
  const auto t0 = Clock::now();
  { dtrain::SummaryWriter w(dir.path(), dtrain::SummaryWriterOptions().flush_secs(1000)); }
  EXPECT_LT(Clock::now() - t0, dtrain::test_util::scaled(std::chrono::seconds(10)))
      << "the destructor waited for the timer's period";
}

// A write that fails half-way (here: the file-size limit, as a full disk would) warns once, drops the
// rest, and leaves the records written before it readable.
TEST(SummaryWriter, FailedWriteWarnsOnceAndKeepsEarlierRecords) {
  TempDir dir("tb_full");
  std::signal(SIGXFSZ, SIG_IGN);  // EFBIG from write() instead of the signal
  rlimit old{};
  ASSERT_EQ(getrlimit(RLIMIT_FSIZE, &old), 0);
  rlimit small = old;
  small.rlim_cur = 2000;
  ASSERT_EQ(setrlimit(RLIMIT_FSIZE, &small), 0);
  testing::internal::CaptureStderr();
  {
    dtrain::SummaryWriter w(dir.path(), dtrain::SummaryWriterOptions().max_queue(1));
    for (int i = 0; i < 200; ++i) w.add_scalar("loss", i, i);
  }
  const std::string err = testing::internal::GetCapturedStderr();
  ASSERT_EQ(setrlimit(RLIMIT_FSIZE, &old), 0);
  EXPECT_THAT(err, HasSubstr("SummaryWriter: cannot write")) << err;
  EXPECT_EQ(err.find("SummaryWriter", err.find("SummaryWriter") + 1), std::string::npos) << "warned twice: " << err;
  const auto files = event_files(dir.path());
  ASSERT_EQ(files.size(), 1u);
  const auto records = read_records(dtrain::util::read_file(files[0].string()));
  EXPECT_GT(records.size(), 10u);  // every record that fit is whole
  EXPECT_LT(records.size(), 200u);
}

namespace {
// How many of the records hold `text` (a tag appears verbatim in its serialized Event).
int records_with(const std::vector<std::string>& records, const std::string& text) {
  int n = 0;
  for (const auto& r : records) n += r.find(text) != std::string::npos;
  return n;
}
}  // namespace

// One process, no process group: the windows, the epoch values and the histogram cadence reach the
// event files (their values as TensorBoard reads them: test_tensorboard.py's trainer run).
TEST(MonitorTensorBoard, WindowsEpochsAndHistogramCadence) {
  TempDir dir("tb_monitor");
  at::manual_seed(0);
  at::Tensor w = at::randn({4, 3}).requires_grad_(), b = at::zeros({4}).requires_grad_();
  {
    dtrain::Monitor mon(dtrain::MonitorOptions()
                            .output_dir(dir.path())
                            .log_every(2)
                            .trace_steps(0)
                            .plot(false)
                            .progress(false)
                            .tensorboard(true)
                            .histogram_every(2));
    mon.watch_parameters({w, b}, {"fc.weight", "fc.bias"});
    mon.begin_epoch(1, 1, 6);
    for (int step = 1; step <= 6; ++step) {  // windows end at steps 2, 4, 6; histograms in windows 1 and 3
      at::Tensor loss = (at::matmul(at::randn({5, 3}), w.t()) + b).pow(2).mean();
      loss.backward();
      mon.end_step(dtrain::StepInfo().loss(loss.item<double>()).samples(5).accuracy(0.5));
    }
    mon.end_epoch();
    mon.log_epoch(1, dtrain::EpochInfo().train_accuracy(0.5).test_accuracy(0.25));
    mon.close();
  }
  const auto main_files = event_files(dir.path());
  ASSERT_EQ(main_files.size(), 1u);
  const auto records = read_records(dtrain::util::read_file(main_files[0].string()));
  EXPECT_EQ(records_with(records, "train/loss"), 3);
  EXPECT_EQ(records_with(records, "train/accuracy"), 3);
  EXPECT_EQ(records_with(records, "time_ms/comm_wait"), 3);
  EXPECT_EQ(records_with(records, "ranks/slowest_rank"), 3);
  EXPECT_EQ(records_with(records, "parameters/fc.weight"), 2);
  EXPECT_EQ(records_with(records, "gradients/fc.bias"), 2);
  EXPECT_EQ(records_with(records, "epoch/test_accuracy"), 1);
  EXPECT_EQ(records_with(records, "epoch/train_loss"), 0);  // NaN: not known, not logged
  for (const char* run : {"ranks_step_ms_min", "ranks_step_ms_max", "ranks_comm_wait_ms_max"}) {
    const auto files = event_files(fs::path(dir.path()) / run);
    ASSERT_EQ(files.size(), 1u) << run;
    EXPECT_EQ(records_with(read_records(dtrain::util::read_file(files[0].string())), "ranks/"), 3) << run;
  }
}

TEST(MonitorTensorBoard, NeedsAnOutputFolder) {
  try {
    dtrain::Monitor mon(dtrain::MonitorOptions().tensorboard(true).progress(false));
    FAIL() << "no error";
  } catch (const dtrain::Error& e) {
    EXPECT_THAT(std::string(e.what()), HasSubstr("tensorboard(true) needs an output_dir")) << e.what();
  }
}
