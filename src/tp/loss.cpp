// parallel_cross_entropy: cross-entropy over logits whose classes are sharded (Megatron-LM's
// vocab-parallel cross-entropy; PyTorch's loss_parallel). Per sample i, with this rank holding the
// classes [start, start + V_r) of the logits z_i:
//   1. m_i = max over all classes: the local max, all-reduced (MAX); subtracted for stability. The
//      same all-reduce gives the widest part, ceil(V / n): rank r's classes start at r times it
//      (torch.chunk's cut, which may leave the last ranks fewer classes, or none).
//   2. s_i = sum over all classes of exp(z_i - m_i), and t_i = z_{i, target_i} - m_i, taken by the
//      rank holding target_i (0 elsewhere): one SUM all-reduce of both.
//   3. loss_i = log s_i - t_i (0 for ignore_index), then the reduction.
//   Backward, on each rank's own classes, without communication:
//     d loss_i / d z_ic = softmax_ic - [c == target_i] = exp(z_ic - m_i) / s_i - [c == target_i].
#include <ATen/ATen.h>

#include <limits>

#include "compat/autograd_compat.h"
#include "dtrain/tensor_parallel.h"

namespace dtrain {

at::Tensor parallel_cross_entropy(const at::Tensor& local_logits, const at::Tensor& target, const Group& group,
                                  int64_t ignore_index, const std::string& reduction) {
  DTRAIN_CHECK(reduction == "mean" || reduction == "sum" || reduction == "none", "parallel_cross_entropy: reduction '",
               reduction, "' is not one of 'mean', 'sum', 'none'");
  DTRAIN_CHECK(local_logits.dim() >= 1 && target.sizes() == local_logits.sizes().slice(0, local_logits.dim() - 1),
               "parallel_cross_entropy: target ", target.sizes(), " must be the logits' ", local_logits.sizes(),
               " without the last (class) dimension");
  const int64_t classes = local_logits.size(-1);
  at::Tensor loss, softmax, onehot, keep;
  {
    at::NoGradGuard no_grad;
    at::Tensor z = local_logits.to(at::kDouble == local_logits.scalar_type() ? at::kDouble : at::kFloat);
    // A rank without classes has no max of its own: the lowest value, which the others' replace.
    at::Tensor local_max = classes > 0
                               ? std::get<0>(z.max(-1))
                               : at::full(target.sizes(), -std::numeric_limits<double>::infinity(), z.options());
    at::Tensor both = at::cat({local_max.reshape({-1}), at::full({1}, static_cast<double>(classes), z.options())});
    all_reduce(both, ReduceOp::MAX, group);  // step 1
    at::Tensor m = both.narrow(0, 0, local_max.numel()).view(local_max.sizes());
    const int64_t start = group.rank() * static_cast<int64_t>(both[-1].item<double>());
    at::Tensor e = (z - m.unsqueeze(-1)).exp();
    at::Tensor local_target = target - start;
    at::Tensor mine = (local_target >= 0).logical_and(local_target < classes);
    at::Tensor index = local_target.masked_fill(mine.logical_not(), 0).unsqueeze(-1);
    at::Tensor t =
        classes == 0 ? at::zeros_like(m) : (z.gather(-1, index).squeeze(-1) - m).masked_fill(mine.logical_not(), 0.0);
    at::Tensor st = at::stack({e.sum(-1), t});
    all_reduce(st, ReduceOp::SUM, group);  // step 2
    keep = (target != ignore_index).to(z.scalar_type());
    loss = (st[0].log() - st[1]) * keep;  // step 3
    softmax = e / st[0].unsqueeze(-1);
    onehot = classes == 0 ? at::zeros_like(z)
                          : at::zeros_like(z).scatter_(-1, index, mine.unsqueeze(-1).to(z.scalar_type()));
  }
  // The gradient of each sample's loss, as reduction gives it.
  const double count = std::max(1.0, keep.sum().item<double>());
  at::Tensor out = reduction == "none" ? loss : reduction == "sum" ? loss.sum() : loss.sum() / count;
  out = out.to(local_logits.scalar_type());
  const auto dtype = local_logits.scalar_type();
  compat::set_custom_backward(
      out, {local_logits}, "dtrain::parallel_cross_entropy", [=](const at::Tensor& g, const std::vector<bool>& needs) {
        if (!needs[0]) return std::vector<at::Tensor>{at::Tensor()};
        at::Tensor per_sample = g.to(keep.scalar_type()) * keep;
        if (reduction == "mean") per_sample = per_sample / count;
        return std::vector<at::Tensor>{((softmax - onehot) * per_sample.unsqueeze(-1)).to(dtype)};
      });
  return out;
}

}  // namespace dtrain
