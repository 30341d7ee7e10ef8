// SyncBatchNorm: the module and its cross-rank forward and backward (see dtrain/sync_batchnorm.h).
#include "dtrain/sync_batchnorm.h"

#include <ostream>
#include <vector>

#include <ATen/ATen.h>
#include <torch/nn/init.h>

#include "compat/autograd_compat.h"
#include "dtrain/errors.h"

namespace dtrain {
namespace {

// Note [SyncBatchNorm statistics]: each rank sends its own mean, biased variance and count (one
// all_gather of 2C + 1 values), not sums of x and x²: the global variance is then Chan's parallel
// combination, sum_r n_r (var_r + (mean_r - mean)²) / N, which loses no precision to cancellation
// when the mean is large against the spread (sums of squares would, in float32). Weighting by n_r
// is what makes ranks with unequal batches right (each rank's mean counts as many times as it has
// values); a rank with an empty batch sends zeros and weighs nothing. Every rank combines the same
// gathered values in the same order, so all ranks hold bit-identical statistics and running
// statistics. The backward needs only sums over the global batch (of dy and dy * (x - mean)), so
// one all_reduce of 2C values.

// Half-precision inputs are reduced in float32, as PyTorch's batch-norm kernels do.
at::ScalarType accumulate_type(at::ScalarType t) { return t == at::kHalf || t == at::kBFloat16 ? at::kFloat : t; }

// The dimensions summed over: all but the channels (dim 1).
std::vector<int64_t> reduce_dims(const at::Tensor& x) {
  std::vector<int64_t> dims{0};
  for (int64_t d = 2; d < x.dim(); ++d) dims.push_back(d);
  return dims;
}

// A per-channel vector shaped to broadcast against x: (1, C, 1, ...).
at::Tensor per_channel(const at::Tensor& v, const at::Tensor& x) {
  std::vector<int64_t> shape(x.dim(), 1);
  shape[1] = v.numel();
  return v.view(shape);
}

struct GlobalStats {
  at::Tensor mean, var;  // per channel, biased variance of the global batch
  int64_t count = 0;     // values per channel in the global batch
};

// Steps 1-2 of the header's protocol.
GlobalStats gather_stats(const at::Tensor& xa, const Group& group) {
  const int64_t channels = xa.size(1), n = xa.numel() / std::max<int64_t>(channels, 1);
  at::Tensor local = at::zeros({2 * channels + 1}, xa.options());
  if (n > 0) {
    const std::vector<int64_t> dims = reduce_dims(xa);
    auto [var, mean] = at::var_mean(xa, at::IntArrayRef(dims), /*unbiased=*/false);
    local.narrow(0, 0, channels).copy_(mean);
    local.narrow(0, channels, channels).copy_(var);
    local[2 * channels].fill_(static_cast<double>(n));
  }
  std::vector<at::Tensor> all;
  for (int r = 0; r < group.size(); ++r) all.push_back(at::empty_like(local));
  all_gather(all, local, group);
  const at::Tensor g = at::stack(all);  // ranks x (2C + 1)
  const at::Tensor counts = g.narrow(1, 2 * channels, 1);
  GlobalStats s;
  s.count = static_cast<int64_t>(counts.sum().item<double>());
  DTRAIN_CHECK(s.count > 1, "SyncBatchNorm: expected more than 1 value per channel in the global batch when ",
               "training, got ", s.count, " (all ranks together): use a larger batch, or eval() mode");
  const at::Tensor means = g.narrow(1, 0, channels), vars = g.narrow(1, channels, channels);
  s.mean = (means * counts).sum(0) / static_cast<double>(s.count);
  s.var = ((vars + (means - s.mean).pow(2)) * counts).sum(0) / static_cast<double>(s.count);
  return s;
}

// Step 4: the input gradient of the global batch; weight and bias gradients of this rank's part.
std::vector<at::Tensor> backward(const at::Tensor& grad_out, const at::Tensor& xa, const at::Tensor& weight,
                                 const at::Tensor& mean, const at::Tensor& invstd, int64_t count, const Group& group,
                                 const std::vector<bool>& needs, at::ScalarType input_type) {
  const at::Tensor dy = grad_out.contiguous().to(xa.scalar_type());
  const at::Tensor xmu = xa - per_channel(mean, xa);
  const std::vector<int64_t> dims_v = reduce_dims(xa);
  const at::IntArrayRef dims(dims_v);
  const int64_t channels = xa.size(1);
  at::Tensor sum_dy = xa.numel() > 0 ? dy.sum(dims) : at::zeros({channels}, xa.options());
  at::Tensor sum_dy_xmu = xa.numel() > 0 ? (dy * xmu).sum(dims) : at::zeros({channels}, xa.options());
  std::vector<at::Tensor> grads(3);
  if (needs[1] && weight.defined()) grads[1] = (sum_dy_xmu * invstd).to(weight.scalar_type());
  if (needs[2] && weight.defined()) grads[2] = sum_dy.to(weight.scalar_type());
  if (needs[0]) {
    // As PyTorch: the all_reduce happens only where the input needs a gradient, which is the same
    // on every rank of a replicated model.
    at::Tensor combined = at::cat({sum_dy, sum_dy_xmu});
    all_reduce(combined, ReduceOp::SUM, group);
    const double n = static_cast<double>(count);
    const at::Tensor mean_dy = combined.narrow(0, 0, channels) / n;
    const at::Tensor mean_dy_xmu = combined.narrow(0, channels, channels) / n;
    at::Tensor scale = weight.defined() ? invstd * weight.to(xa.scalar_type()) : invstd;
    at::Tensor gi =
        (dy - per_channel(mean_dy, xa) - xmu * per_channel(invstd * invstd * mean_dy_xmu, xa)) * per_channel(scale, xa);
    grads[0] = gi.to(input_type);
  }
  return grads;
}

}  // namespace

SyncBatchNormOptions::SyncBatchNormOptions(const torch::nn::BatchNormOptions& bn)
    : num_features_(bn.num_features()),
      eps_(bn.eps()),
      momentum_(bn.momentum() ? std::optional<double>(*bn.momentum()) : std::nullopt),
      affine_(bn.affine()),
      track_running_stats_(bn.track_running_stats()) {}

SyncBatchNormImpl::SyncBatchNormImpl(SyncBatchNormOptions options_) : options(std::move(options_)) {
  DTRAIN_CHECK(options.num_features() > 0, "SyncBatchNorm: num_features is ", options.num_features(),
               "; pass the number of channels (> 0)");
  DTRAIN_CHECK(options.eps() > 0, "SyncBatchNorm: eps is ", options.eps(), "; it must be > 0 (default 1e-5)");
  reset();
}

SyncBatchNormImpl::SyncBatchNormImpl(SyncBatchNormOptions options_, const torch::nn::Module& batchnorm)
    : options(std::move(options_)) {
  for (const auto& p : batchnorm.named_parameters(/*recurse=*/false))
    (p.key() == "weight" ? weight : bias) = register_parameter(p.key(), p.value(), p.value().requires_grad());
  for (const auto& b : batchnorm.named_buffers(/*recurse=*/false))
    (b.key() == "running_mean"  ? running_mean
     : b.key() == "running_var" ? running_var
                                : num_batches_tracked) = register_buffer(b.key(), b.value());
  DTRAIN_ASSERT(weight.defined() == options.affine() && running_mean.defined() == options.track_running_stats(),
                "a BatchNorm whose tensors do not match its options");
  train(batchnorm.is_training());
}

void SyncBatchNormImpl::reset() {
  const int64_t c = options.num_features();
  if (options.affine()) {
    weight = register_parameter("weight", at::empty({c}));
    bias = register_parameter("bias", at::empty({c}));
  }
  if (options.track_running_stats()) {
    running_mean = register_buffer("running_mean", at::zeros({c}));
    running_var = register_buffer("running_var", at::ones({c}));
    num_batches_tracked = register_buffer("num_batches_tracked", at::tensor(0, at::kLong));
  }
  reset_parameters();
}

void SyncBatchNormImpl::reset_running_stats() {
  if (!options.track_running_stats()) return;
  at::NoGradGuard ng;
  running_mean.zero_();
  running_var.fill_(1);
  num_batches_tracked.zero_();
}

void SyncBatchNormImpl::reset_parameters() {
  reset_running_stats();
  if (!options.affine()) return;
  torch::nn::init::ones_(weight);
  torch::nn::init::zeros_(bias);
}

void SyncBatchNormImpl::pretty_print(std::ostream& stream) const {
  stream << "dtrain::SyncBatchNorm(" << options.num_features() << ", eps=" << options.eps() << ", momentum=";
  if (options.momentum())
    stream << *options.momentum();
  else
    stream << "None";
  stream << ", affine=" << options.affine() << ", track_running_stats=" << options.track_running_stats() << ")";
}

at::Tensor SyncBatchNormImpl::forward(const at::Tensor& input) {
  DTRAIN_CHECK(input.dim() >= 2 && input.dim() <= 5, "SyncBatchNorm: expected a 2D to 5D input (N, C, ...), got ",
               input.dim(), "D: add the batch and channel dimensions");
  DTRAIN_CHECK(input.size(1) == options.num_features(), "SyncBatchNorm: the input has ", input.size(1),
               " channels (dim 1), the layer ", options.num_features(), ": check the layer's num_features");
  // The cumulative moving average (momentum nullopt) uses 1 / batches seen, as PyTorch.
  double factor = options.momentum().value_or(0.0);
  if (is_training() && options.track_running_stats()) {
    at::NoGradGuard ng;
    num_batches_tracked.add_(1);
    if (!options.momentum()) factor = 1.0 / static_cast<double>(num_batches_tracked.item<int64_t>());
  }
  const Group& group = options.process_group();
  const bool sync = is_training() && group.size() > 1;
  if (!sync) {
    // Eval (running statistics) or one rank: plain batch norm, no communication.
    const bool use_batch_stats = is_training() || !options.track_running_stats();
    return at::batch_norm(input, weight, bias, running_mean, running_var, use_batch_stats, factor, options.eps(),
                          /*cudnn_enabled=*/true);
  }
  DTRAIN_CHECK(group.is_member(), "SyncBatchNorm: rank ", dtrain::rank(), " is not a member of group '", group.name(),
               "' that this layer synchronizes over: run the layer only on the group's ranks");
  const at::ScalarType input_type = input.scalar_type();
  const at::Tensor xa = input.contiguous().to(accumulate_type(input_type));
  GlobalStats s;
  at::Tensor invstd, out;
  {
    at::NoGradGuard ng;
    s = gather_stats(xa, group);
    invstd = (s.var + options.eps()).rsqrt();
    if (options.track_running_stats()) {
      const double n = static_cast<double>(s.count);
      running_mean.mul_(1 - factor).add_(s.mean.to(running_mean.scalar_type()), factor);
      running_var.mul_(1 - factor).add_((s.var * (n / (n - 1))).to(running_var.scalar_type()), factor);
    }
    at::Tensor y = (xa - per_channel(s.mean, xa)) * per_channel(invstd, xa);
    if (weight.defined())
      y = y * per_channel(weight.to(y.scalar_type()), xa) + per_channel(bias.to(y.scalar_type()), xa);
    out = y.to(input_type);
  }
  compat::set_custom_backward(out, {input, weight, bias}, "SyncBatchNormBackward",
                              [xa, w = weight, mean = s.mean, invstd, count = s.count, group, input_type](
                                  const at::Tensor& grad, const std::vector<bool>& needs) {
                                return backward(grad, xa, w, mean, invstd, count, group, needs, input_type);
                              });
  return out;
}

}  // namespace dtrain
