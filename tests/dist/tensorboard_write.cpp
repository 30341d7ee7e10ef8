// Writes a known set of TensorBoard values with dtrain::SummaryWriter, for test_tensorboard.py to read
// back with TensorBoard's own reader and compare with what is written here and with PyTorch's
// histograms of the same values.
//
//   tensorboard_write LOGDIR VALUES_DIR
//
// VALUES_DIR/<tag>.f64 gets each histogram's values as raw float64, for PyTorch's reference.
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <ATen/ATen.h>

#include "dtrain/summary_writer.h"

namespace {

// The same arithmetic as test_tensorboard.py's loss(step), so both sides get the same double.
double loss(int64_t step) { return static_cast<double>(step * 7 % 13) / 3.0 + static_cast<double>(step) * 0.001; }

void save(const std::string& dir, const std::string& tag, const at::Tensor& t) {
  const at::Tensor d = t.to(at::kDouble).contiguous();
  std::ofstream f(dir + "/" + tag + ".f64", std::ios::binary);
  f.write(static_cast<const char*>(d.data_ptr()), static_cast<std::streamsize>(d.numel() * sizeof(double)));
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: %s LOGDIR VALUES_DIR\n", argv[0]);
    return 2;
  }
  const std::string values_dir = argv[2];
  std::filesystem::create_directories(values_dir);
  // doc:begin tb
  dtrain::SummaryWriter w(argv[1]);  // SummaryWriter(log_dir) in Python
  for (int64_t step = 0; step < 100; ++step) w.add_scalar("loss", loss(step), step);
  w.add_scalar("walltime", 1.5, 3, 1234567890.25);  // an explicit wall time (seconds since 1970)
  // Two curves in one chart: the runs <log_dir>/ranks_step_ms_min and ..._max, tag "ranks/step_ms".
  for (int64_t step = 0; step < 10; ++step)
    w.add_scalars("ranks/step_ms", {{"min", step * 0.5}, {"max", step * 1.25 + 0.1}}, step);
  // doc:end tb

  at::manual_seed(0);
  const at::Tensor normal = at::randn({1000});
  const std::vector<std::pair<std::string, at::Tensor>> histograms = {
      {"normal", normal},
      {"tiny_and_zero", at::tensor({0.0, 1e-13, -1e-13, 1e-12, -5e-12, 0.0}, at::kDouble)},
      {"huge", at::tensor({1e25, -3.0, 2.0, 1e19}, at::kDouble)},  // 1e25: beyond the last bucket
      {"ints", at::arange(-50, 50, at::kLong)},
      {"constant", at::full({10}, 3.0)},
  };
  for (const auto& [tag, t] : histograms) {
    save(values_dir, tag, t);
    w.add_histogram(tag, t, 5);
  }
  save(values_dir, "normal_step6", normal * 2);
  w.add_histogram("normal", normal * 2, 6);

  w.add_text("notes", "**dtrain** says hello: \xc3\xa4\xc3\xb6\xc3\xbc", 2);
  w.add_scalar("last", 42.0, 7);  // the main file's last record: the truncation test cuts it
  w.close();
  std::printf("tensorboard_write: wrote %s\n", w.get_logdir().c_str());
  return 0;
}
