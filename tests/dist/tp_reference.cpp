// The C++ side of test_tp_pytorch.py: the MLP and the vocab-parallel language model of
// tp_models.h, and the sequence-parallel block of sp_models.h (on each rank's positions, and whole
// around it), under dtrain's parallelize_module, on the weights and data tp_reference.py gives
// PyTorch's own, writing the same JSON: local shard shapes, local outputs, input gradients and
// parameter gradients at the first step, local parameters after 5 Adam steps.
//   tp_reference OUT.json   (run on every rank, env:// from the launcher)
#include <torch/optim/adam.h>

#include <fstream>
#include <iomanip>
#include <iostream>
#include <limits>
#include <sstream>

#include "dtrain/device_mesh.h"
#include "sp_models.h"
#include "tp_models.h"

namespace {

constexpr int kSteps = 5;

// Values both languages compute alike (no random generator is shared between them).
at::Tensor wave(int64_t n, double scale, double freq, double phase) {
  return at::arange(n, at::kDouble).mul(freq).add(phase).sin().mul(scale);
}

void fill(torch::nn::Module& m) {
  m.to(at::kDouble);
  torch::NoGradGuard no_grad;
  int k = 0;
  for (auto& p : m.parameters()) {
    p.copy_(wave(p.numel(), 0.3, 0.7, 1.3 * k).view(p.sizes()));
    ++k;
  }
}

std::string json_list(const at::Tensor& t) {
  std::ostringstream s;
  s << std::setprecision(std::numeric_limits<double>::max_digits10) << "[";
  at::Tensor flat = t.detach().reshape({-1}).contiguous();
  for (int64_t i = 0; i < flat.numel(); ++i) s << (i ? ", " : "") << flat[i].item<double>();
  return s.str() + "]";
}

template <typename Fn>
std::string json_dict(torch::nn::Module& m, Fn value) {
  std::ostringstream s;
  bool first = true;
  for (const auto& kv : m.named_parameters()) {
    s << (first ? "" : ", ") << "\"" << kv.key() << "\": " << value(kv.value());
    first = false;
  }
  return "{" + s.str() + "}";
}

// run(step) -> (output, loss); as tp_reference.py's record(). `input`, where given, is the leaf
// whose gradient is recorded too (run(step) sets it).
template <typename Run>
std::string record(torch::nn::Module& m, Run run, const at::Tensor* input = nullptr) {
  const std::string shape_dict = json_dict(m, [](const at::Tensor& t) {
    std::ostringstream s;
    s << t.sizes();
    return s.str();
  });
  torch::optim::Adam opt(m.parameters(), torch::optim::AdamOptions(1e-2));
  std::string output, grads, input_grad;
  for (int step = 0; step < kSteps; ++step) {
    opt.zero_grad();
    auto [y, loss] = run(step);
    loss.backward();
    if (step == 0) {
      output = json_list(y);
      grads = json_dict(m, [](const at::Tensor& t) { return json_list(t.grad()); });
      if (input) input_grad = ", \"input_grad\": " + json_list(input->grad());
    }
    opt.step();
  }
  return "{\"shapes\": " + shape_dict + ", \"output\": " + output + input_grad + ", \"grads\": " + grads +
         ", \"params\": " + json_dict(m, [](const at::Tensor& t) { return json_list(t); }) + "}";
}

// The sequence-parallel block: on each rank's positions (its loss theirs: the ranks' sum is the
// block's), or `whole` on every rank around it (the loss counted once).
std::string record_sp(const dtrain::Group& group, bool whole) {
  constexpr int64_t kSeq = 6;
  sp_models::SPNet net;
  fill(*net);
  dtrain::parallelize_module(*net, group, sp_models::sp_plan(whole));
  const int64_t n = group.size(), r = group.rank();
  at::Tensor leaf;
  return record(
      *net,
      [&](int step) {
        at::Tensor x = wave(2 * kSeq * 8, 1.0, 0.13, 0.7 * step).view({2, kSeq, 8});
        at::Tensor t = wave(2 * kSeq * 8, 1.0, 0.05, 0.31 * step + 1.5).view({2, kSeq, 8});
        if (!whole) {
          x = x.chunk(n, 1)[r];
          t = t.chunk(n, 1)[r];
        }
        leaf = x.clone().requires_grad_(true);
        at::Tensor y = net(leaf);
        return std::make_pair(y, whole ? (y - t).pow(2).mean() : (y - t).pow(2).sum());
      },
      &leaf);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::cerr << "usage: tp_reference OUT.json\n";
    return 2;
  }
  try {
    dtrain::init_process_group();
    tp_models::MLP mlp(8, 16);  // w1, w2: dtrain::ParallelLinear
    fill(*mlp);
    // doc:begin tp_mlp
    auto mesh = dtrain::init_device_mesh({dtrain::world_size()}, {"tp"});
    dtrain::parallelize_module(*mlp, mesh, {{"w1", dtrain::ColwiseParallel()}, {"w2", dtrain::RowwiseParallel()}});
    // doc:end tp_mlp
    const std::string mlp_json = record(*mlp, [&](int step) {
      at::Tensor x = wave(5 * 8, 1.0, 0.1, 0.97 * step).view({5, 8});
      at::Tensor t = wave(5 * 8, 1.0, 0.05, 0.31 * step + 1.5).view({5, 8});
      at::Tensor y = mlp(x);
      return std::make_pair(y, (y - t).pow(2).mean());
    });
    tp_models::LM lm(11, 6, 12);
    fill(*lm);
    // doc:begin tp_lm
    dtrain::parallelize_module(
        *lm, mesh,
        {{"emb", dtrain::RowwiseParallel().input_layouts(dtrain::Replicate())},  // vocabulary-parallel
         {"head", dtrain::ColwiseParallel()}});                                  // logits sharded by class
    // doc:end tp_lm
    const std::string lm_json = record(*lm, [&](int step) {
      at::Tensor tokens = at::arange(12, at::kLong).mul(7 + step).remainder(11);
      at::Tensor target = at::arange(12, at::kLong).mul(5 + step).add(1).remainder(12);
      // doc:begin tp_loss
      at::Tensor logits = lm(tokens);  // [12, 12 / tp]: this rank's classes
      at::Tensor loss = dtrain::parallel_cross_entropy(logits, target, mesh.get_group());
      // doc:end tp_loss
      return std::make_pair(logits, loss);
    });
    const std::string sp_json = record_sp(mesh.get_group(), false), spio_json = record_sp(mesh.get_group(), true);
    std::ofstream(argv[1]) << "{\"mlp\": " << mlp_json << ", \"lm\": " << lm_json << ", \"sp\": " << sp_json
                           << ", \"spio\": " << spio_json << "}\n";
    dtrain::barrier();
    dtrain::destroy_process_group();
  } catch (const std::exception& e) {
    std::cerr << "tp_reference: error: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
