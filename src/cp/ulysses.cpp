// Ulysses attention (DeepSpeed-Ulysses): an all-to-all trades the sequence shard for a head shard, each
// rank attends over the whole sequence with its heads, and a second all-to-all trades back. Autograd
// runs through the differentiable all-to-all, whose backward is the reverse exchange.
#include <ATen/ATen.h>

#include "cp/blocks.h"
#include "dtrain/context_parallel.h"
#include "dtrain/functional_collectives.h"

namespace dtrain {

at::Tensor ulysses_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const Group& group,
                             bool is_causal, std::optional<double> scale) {
  DTRAIN_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "ulysses_attention: q, k, v have shapes ", q.sizes(), ", ",
               k.sizes(), ", ", v.sizes(), ": pass [batch, heads, local sequence, head_dim]");
  const int64_t n = group.size();
  DTRAIN_CHECK(q.size(1) % n == 0 && k.size(1) % n == 0, "ulysses_attention: ", q.size(1), " query and ", k.size(1),
               " key heads do not divide by the cp group's size ", n,
               ": use ring_attention, or a cp size that divides the heads");
  DTRAIN_CHECK(q.size(2) % 2 == 0, "ulysses_attention: the local sequence length ", q.size(2),
               " is odd: pass parts made by context_parallel_shard (two equal chunks)");
  const double s = cp::attention_scale(q, scale);
  // [B, H, S / n, D] -> [B, H / n, S, D], the sequence in the ranks' order (each rank's two chunks).
  auto to_heads = [&](const at::Tensor& t) { return functional::all_to_all(t.contiguous(), 1, 2, group); };
  at::Tensor qh = to_heads(q), kh = to_heads(k), vh = to_heads(v);
  if (is_causal) {
    // The mask follows positions: put the chunks in sequence order, and back after.
    qh = cp::reorder_chunks(qh, 2, n, /*to_sequence=*/true);
    kh = cp::reorder_chunks(kh, 2, n, true);
    vh = cp::reorder_chunks(vh, 2, n, true);
  }
  at::Tensor scores = cp::block_scores(qh, kh, s, is_causal ? BlockMask::kCausal : BlockMask::kFull);
  at::Tensor out = at::matmul(at::softmax(scores, -1), vh);
  if (is_causal) out = cp::reorder_chunks(out, 2, n, /*to_sequence=*/false);
  return functional::all_to_all(out.contiguous(), 2, 1, group);
}

}  // namespace dtrain
