// One rank training a small model with dtrain::DistributedDataParallel in a job shared with Python
// ranks (InitOptions().pytorch_peers): tests/dist/ddp_peer_train.py is the Python side (PyTorch's
// DistributedDataParallel), and this file runs the same steps call for call with the same float64
// arithmetic, so that every rank of a mixed job ends every step with the same bits
// (tests/dist/test_pytorch_peers_ddp.py).
//
//   ddp_peer_train --mode MODE[,MODE...] [--steps N] --out DIR
//                  [--dtrain-only]   (every rank dtrain's: its own calls, PyTorch's semantics)
//   MODE: unused, default, bucketview, static, small, smallunused, join, joindefault or ignored
//
// small and smallunused are default and unused with Python's bucket_cap_mb=0.001 (several buckets).
// join and joindefault are unused and default with uneven inputs under dtrain::Join: rank r runs 7 r
// steps fewer, and writes one more record, the model after the Join. ignored is default with the
// branch's parameters left out of DDP (DDPOptions::ignored_params; Python's
// _set_params_and_buffers_to_ignore_for_model): each rank keeps its own and trains them on its own
// gradients.
//
// The modes run one after another in the one process group, each with a fresh model, DDP and
// optimizer, as the Python side does. After every step it appends this rank's parameters
// (named_parameters order) and then the BatchNorm buffers running_mean and running_var, as raw
// little-endian float64, to DIR/MODE/rank<r>.bin. Prints
// "ddp_peer_train: ALL OK" and the language at the end; any error: one line on stderr, exit 1.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include <ATen/Parallel.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/linear.h>

#include "dtrain/ddp.h"
#include "dtrain/join.h"
#include "dtrain/process_group.h"

namespace {

at::TensorOptions f64() { return at::TensorOptions().dtype(at::kDouble); }

struct NetImpl : torch::nn::Module {
  NetImpl()
      : fc1(register_module("fc1", torch::nn::Linear(8, 16))),
        bn(register_module("bn", torch::nn::BatchNorm1d(16))),
        fc2(register_module("fc2", torch::nn::Linear(16, 4))),
        branch(register_module("branch", torch::nn::Linear(16, 4))) {}

  at::Tensor forward(const at::Tensor& x, bool use_branch) {
    at::Tensor h = at::relu(bn(fc1(x)));
    at::Tensor out = fc2(h);
    if (use_branch) out = out + branch(h);
    return out;
  }

  torch::nn::Linear fc1;
  torch::nn::BatchNorm1d bn;
  torch::nn::Linear fc2, branch;
};
TORCH_MODULE(Net);

bool use_branch(const std::string& mode, int step, int rank) {
  // unused: steps where every rank, only rank 1, or no rank uses the branch.
  if (mode == "unused" || mode == "smallunused" || mode == "join") return step % 6 == 0 || (step % 6 == 2 && rank == 1);
  return mode != "static";  // static: the branch is never used
}

// PyTorch 2.x's torch.optim.Adam(params, lr, foreach=False) op for op (_single_tensor_adam in
// torch/optim/adam.py, amsgrad, weight_decay and maximize off): torch::optim::Adam updates the
// moments with other ops (mul_ and add_ rather than lerp_), whose last bits differ.
class PythonAdam {
 public:
  PythonAdam(std::vector<at::Tensor> params, double lr) : params_(std::move(params)), lr_(lr) {
    state_.resize(params_.size());
  }

  void step() {
    at::NoGradGuard no_grad;
    for (size_t i = 0; i < params_.size(); ++i) {
      at::Tensor& param = params_[i];
      const at::Tensor& grad = param.grad();
      if (!grad.defined()) continue;  // Python skips it: its step count does not advance either
      State& s = state_[i];
      if (!s.exp_avg.defined()) {
        s.exp_avg = at::zeros_like(param, at::MemoryFormat::Preserve);
        s.exp_avg_sq = at::zeros_like(param, at::MemoryFormat::Preserve);
      }
      s.step += 1;  // Python's step is a float64 tensor read back with .item(): an exact integer
      s.exp_avg.lerp_(grad, 1 - beta1_);
      s.exp_avg_sq.mul_(beta2_).addcmul_(grad, grad, 1 - beta2_);
      // Python floats: beta ** step and bias_correction2 ** 0.5 are C's pow (not sqrt).
      const double bias_correction1 = 1 - std::pow(beta1_, s.step);
      const double bias_correction2 = 1 - std::pow(beta2_, s.step);
      const double step_size = lr_ / bias_correction1;
      const double bias_correction2_sqrt = std::pow(bias_correction2, 0.5);
      at::Tensor denom = (s.exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps_);
      param.addcdiv_(s.exp_avg, denom, -step_size);
    }
  }

  void zero_grad() {  // set_to_none=True
    for (at::Tensor& p : params_) p.mutable_grad().reset();
  }

 private:
  struct State {
    double step = 0;
    at::Tensor exp_avg, exp_avg_sq;
  };
  std::vector<at::Tensor> params_;
  std::vector<State> state_;
  double lr_;
  double beta1_ = 0.9, beta2_ = 0.999, eps_ = 1e-8;
};

struct Args {
  std::vector<std::string> modes;
  std::string out;
  int steps = 50;
  bool dtrain_only = false;  // a job of dtrain ranks alone: dtrain's own protocol, PyTorch's semantics
};

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "--dtrain-only") {
      a.dtrain_only = true;
      continue;
    }
    if (i + 1 >= argc) throw std::invalid_argument("missing the value of " + flag);
    const std::string value = argv[++i];
    if (flag == "--mode") {
      for (size_t begin = 0; begin <= value.size();) {
        const size_t comma = std::min(value.find(',', begin), value.size());
        a.modes.push_back(value.substr(begin, comma - begin));
        begin = comma + 1;
      }
    } else if (flag == "--steps") {
      a.steps = std::stoi(value);
    } else if (flag == "--out") {
      a.out = value;
    } else {
      throw std::invalid_argument("unknown argument " + flag);
    }
  }
  const std::vector<std::string> modes{"unused",      "default", "bucketview", "static",     "ignored",
                                       "smallunused", "small",   "join",       "joindefault"};
  if (a.modes.empty()) throw std::invalid_argument("--mode MODE[,MODE...] is required");
  for (const std::string& mode : a.modes)
    if (std::find(modes.begin(), modes.end(), mode) == modes.end())
      throw std::invalid_argument("--mode '" + mode +
                                  "' is not unused, default, bucketview, static, small, smallunused, join, "
                                  "joindefault or ignored");
  if (a.out.empty()) throw std::invalid_argument("--out DIR is required");
  return a;
}

// One mode: a fresh model, DDP and optimizer; writes OUT/MODE/rank<r>.bin. The DDP (its buckets and
// hooks) is gone when it returns, before the next mode's or the group's end.
void train(const std::string& mode, int steps, const std::string& out) {
  const int rank = dtrain::rank();
  Net model;
  {
    at::NoGradGuard no_grad;
    // Deterministic and independent of any RNG, so that Python builds the same numbers.
    int k = 0;
    for (at::Tensor& p : model->parameters()) {
      p.copy_((at::sin(at::arange(p.numel(), f64()) * 0.37 + k) * 0.3).reshape(p.sizes()));
      ++k;
    }
    // DDP must broadcast rank 0's parameters: without it these ranks would train other numbers.
    if (rank != 0)
      for (at::Tensor& p : model->parameters()) p.add_(1.0);
  }

  // Python's bucket_cap_mb given explicitly is also its first bucket's size.
  const bool small = mode == "small" || mode == "smallunused";
  const double cap_mb = small ? 0.001 : dtrain::kDefaultBucketCapMB;
  dtrain::DistributedDataParallel ddp(
      model, dtrain::DDPOptions()
                 .find_unused_parameters(mode == "unused" || mode == "smallunused" || mode == "join")
                 .gradient_as_bucket_view(mode == "bucketview")
                 .static_graph(mode == "static")
                 .bucket_cap_mb(cap_mb)
                 .first_bucket_cap_mb(small ? cap_mb : dtrain::kDefaultFirstBucketCapMB)
                 .ignored_params(mode == "ignored" ? std::vector<at::Tensor>{model->branch->weight, model->branch->bias}
                                                   : std::vector<at::Tensor>{}));
  PythonAdam opt(ddp.parameters(), 1e-2);

  std::error_code made;
  std::filesystem::create_directories(out + "/" + mode, made);  // every rank: one of them makes it
  const std::string path = out + "/" + mode + "/rank" + std::to_string(rank) + ".bin";
  std::ofstream file(path, std::ios::binary);
  if (!file) throw std::runtime_error("cannot write " + path);
  auto write_record = [&] {
    std::vector<at::Tensor> state;
    for (const at::Tensor& p : model->parameters()) state.push_back(p.detach().reshape(-1));
    state.push_back(model->bn->running_mean.reshape(-1));
    state.push_back(model->bn->running_var.reshape(-1));
    // x86 and arm64 are little-endian: the bytes as they lie in memory are the file's format.
    at::Tensor all = at::cat(state).to(at::kDouble).contiguous();
    file.write(reinterpret_cast<const char*>(all.data_ptr<double>()),
               static_cast<std::streamsize>(all.numel() * sizeof(double)));
  };
  const bool uneven = mode == "join" || mode == "joindefault";
  std::optional<dtrain::Join> join;
  if (uneven) join.emplace(std::vector<dtrain::Joinable*>{&ddp});
  for (int step = 0; step < steps - (uneven ? 7 * rank : 0); ++step) {
    at::Tensor x = at::sin(at::arange(32 * 8, f64()).reshape({32, 8}) * 0.01 * (rank + 1) + step);
    at::Tensor y = at::cos(at::arange(32 * 4, f64()).reshape({32, 4}) * 0.02 * (rank + 1) + 0.5 * step);
    const bool branch = use_branch(mode, step, rank);
    if (step % 5 == 3) {
      // Accumulate locally: no optimizer step, the next step's gradients add to these.
      auto guard = ddp.no_sync();
      torch::nn::functional::mse_loss(ddp(x, branch), y).backward();
    } else {
      torch::nn::functional::mse_loss(ddp(x, branch), y).backward();
      opt.step();
      opt.zero_grad();
    }
    write_record();
  }
  if (join) {
    join->join();
    write_record();  // the model every rank holds after the Join
  }
  file.close();
  if (!file) throw std::runtime_error("writing " + path + " failed");
}

void run(const Args& args) {
  // One intra-op thread, as the Python side: no result may depend on how a kernel splits its work.
  at::set_num_threads(1);
  dtrain::init_process_group(dtrain::InitOptions().pytorch_peers(!args.dtrain_only));
  // float64 by default, as Python's set_default_dtype: Module::to(kDouble) would also turn
  // BatchNorm's integer num_batches_tracked into a double, which Python DDP broadcasts as int64.
  at::set_default_dtype(caffe2::TypeMeta::Make<double>());
  for (const std::string& mode : args.modes) train(mode, args.steps, args.out);
  dtrain::destroy_process_group();
}

}  // namespace

int main(int argc, char** argv) {
  try {
    run(parse(argc, argv));
  } catch (const c10::Error& e) {
    std::string what = e.what_without_backtrace();
    for (char& c : what)
      if (c == '\n') c = ' ';
    std::fprintf(stderr, "ddp_peer_train: error: %s\n", what.c_str());
    return 1;
  } catch (const std::exception& e) {
    std::string what = e.what();
    for (char& c : what)
      if (c == '\n') c = ' ';
    std::fprintf(stderr, "ddp_peer_train: error: %s\n", what.c_str());
    return 1;
  }
  std::printf("ddp_peer_train: ALL OK\n");
  std::printf("ddp_peer_train: language C++\n");  // the test checks each position ran the side it asked for
  return 0;
}
