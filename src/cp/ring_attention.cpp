// Ring attention: each rank keeps its queries and the K/V blocks of every rank pass by it around the
// ring; the partial results are merged by their row log-sum-exp, so the output is exact attention.
//
// Note [Ring attention's backward]: backward does not keep the cp - 1 blocks received in forward
// (cp times the local K/V, the memory context parallelism exists to save). It keeps q, k, v, the
// output and each query row's log-sum-exp, passes K/V around the ring again, and recomputes each
// block's probabilities from the saved log-sum-exp (flash attention's backward: P = exp(S - lse),
// dS = P * (dP - rowsum(dO * O))). A block's dK/dV is a sum over every rank's queries, so its
// accumulator travels with the block, one message behind it on a tag of its own; after cp steps
// the accumulator of each rank's own block, every rank's share added, arrives back at its owner.
// The cost: the forward's block products once more and a second trip of K/V, as ring-flash-attention.
#include <ATen/ATen.h>

#include <limits>
#include <memory>
#include <utility>

#include "comm/tags.h"
#include "compat/autograd_compat.h"
#include "cp/blocks.h"
#include "dtrain/context_parallel.h"

namespace dtrain {
namespace {

constexpr int64_t kSeqDim = 2;  // [B, H, S, D]

// The neighbours of this rank on the ring, as global ranks (point to point takes global ranks).
struct RingPeers {
  int next = 0, prev = 0;
};
RingPeers ring_peers(const Group& group) {
  const int n = group.size(), me = group.rank();
  return {group.ranks()[static_cast<size_t>((me + 1) % n)], group.ranks()[static_cast<size_t>((me + n - 1) % n)]};
}

// One message to the next rank and one from the previous, both in flight until wait().
class RingShift {
 public:
  RingShift(const at::Tensor& mine, const Group& group, int tag) : sent_(mine), got_(at::empty_like(mine)) {
    const RingPeers peers = ring_peers(group);
    send_ = isend(sent_, peers.next, group, tag);
    recv_ = irecv(got_, peers.prev, group, tag);
  }
  at::Tensor wait() {
    send_.wait();
    recv_.wait();
    return got_;
  }

 private:
  at::Tensor sent_, got_;
  Work send_, recv_;
};

// What forward keeps for backward: the local inputs and output, and each query row's log-sum-exp.
struct RingSaved {
  at::Tensor q, k, v, out, lse;
  Group group;
  bool causal = false;
  double scale = 1.0;
};

// Merges one block's (out_b, lse_b) into the running (out, lse) of its query rows.
void ring_merge(at::Tensor& out, at::Tensor& lse, const at::Tensor& out_b, const at::Tensor& lse_b) {
  at::Tensor lse_new = at::logaddexp(lse, lse_b);
  out = out * (lse - lse_new).exp().unsqueeze(-1) + out_b * (lse_b - lse_new).exp().unsqueeze(-1);
  lse = lse_new;
}

void check_ring_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal, const char* op) {
  DTRAIN_CHECK(q.dim() == 4 && k.dim() == 4, op, ": q has shape ", q.sizes(), " and k ", k.sizes(),
               ": pass [batch, heads, local sequence, head_dim]");
  DTRAIN_CHECK(k.sizes() == v.sizes(), op, ": k has shape ", k.sizes(), " and v ", v.sizes(), ": give them one shape");
  DTRAIN_CHECK(q.size(0) == k.size(0) && q.size(1) == k.size(1) && q.size(3) == k.size(3), op, ": q has shape ",
               q.sizes(), " and k ", k.sizes(),
               ": batch, heads and head_dim must agree (repeat k and v to q's heads for grouped-query attention)");
  DTRAIN_CHECK(q.scalar_type() == k.scalar_type() && k.scalar_type() == v.scalar_type(), op, ": q, k, v are ",
               q.scalar_type(), ", ", k.scalar_type(), ", ", v.scalar_type(), ": give them one dtype");
  DTRAIN_CHECK(!causal || (q.size(kSeqDim) == k.size(kSeqDim) && q.size(kSeqDim) % 2 == 0), op,
               ": is_causal with local lengths q ", q.size(kSeqDim), " and k ", k.size(kSeqDim),
               ": give both the same even length, as context_parallel_shard makes");
}

// Forward: Q stays, K/V (stacked as one message) move one rank on per step; the next block's
// transfer is in flight while this one's scores are computed.
std::pair<at::Tensor, at::Tensor> ring_forward(const RingSaved& s) {
  const int64_t n = s.group.size(), me = s.group.rank();
  const int64_t q_parts = s.causal ? 2 : 1;
  std::vector<at::Tensor> out(q_parts), lse(q_parts);
  for (int64_t c = 0; c < q_parts; ++c) {
    at::Tensor qc = cp::chunk_of(s.q, kSeqDim, s.causal ? c : -1);
    out[c] = at::zeros_like(qc);
    lse[c] = at::full(qc.sizes().slice(0, 3), -std::numeric_limits<double>::infinity(), qc.options());
  }
  const std::vector<RingBlock> blocks = ring_attention_blocks(n, me, s.causal);
  at::Tensor kv = at::stack({s.k, s.v}).contiguous();
  for (int64_t step = 0; step < n; ++step) {
    std::unique_ptr<RingShift> shift;
    if (step + 1 < n) shift = std::make_unique<RingShift>(kv, s.group, comm::kRingKvTag);
    for (const RingBlock& b : blocks) {
      if (b.step != step) continue;
      const int64_t qi = b.q_chunk < 0 ? 0 : b.q_chunk;
      at::Tensor qb = cp::chunk_of(s.q, kSeqDim, b.q_chunk);
      at::Tensor kb = cp::chunk_of(kv[0], kSeqDim, b.kv_chunk), vb = cp::chunk_of(kv[1], kSeqDim, b.kv_chunk);
      at::Tensor scores = cp::block_scores(qb, kb, s.scale, b.mask);
      at::Tensor lse_b = at::logsumexp(scores, -1);
      ring_merge(out[qi], lse[qi], at::matmul((scores - lse_b.unsqueeze(-1)).exp(), vb), lse_b);
    }
    if (shift) kv = shift->wait();
  }
  return {at::cat(out, kSeqDim), at::cat(lse, kSeqDim)};
}

// One block's share of the gradients (flash attention's backward): P from the saved log-sum-exp,
// dS = P * (dP - rowsum(dO * O)).
void ring_block_backward(const RingSaved& s, const RingBlock& b, const at::Tensor& dout, const at::Tensor& delta,
                         const at::Tensor& kv, at::Tensor& dq, at::Tensor& dkv) {
  at::Tensor qb = cp::chunk_of(s.q, kSeqDim, b.q_chunk), dob = cp::chunk_of(dout, kSeqDim, b.q_chunk);
  at::Tensor kb = cp::chunk_of(kv[0], kSeqDim, b.kv_chunk), vb = cp::chunk_of(kv[1], kSeqDim, b.kv_chunk);
  at::Tensor lse = cp::chunk_of(s.lse, kSeqDim, b.q_chunk), dl = cp::chunk_of(delta, kSeqDim, b.q_chunk);
  at::Tensor p = (cp::block_scores(qb, kb, s.scale, b.mask) - lse.unsqueeze(-1)).exp();
  at::Tensor ds = p * (at::matmul(dob, vb.transpose(-2, -1)) - dl.unsqueeze(-1));
  cp::chunk_of(dq, kSeqDim, b.q_chunk).add_(at::matmul(ds, kb) * s.scale);
  cp::chunk_of(dkv[0], kSeqDim, b.kv_chunk).add_(at::matmul(ds.transpose(-2, -1), qb) * s.scale);
  cp::chunk_of(dkv[1], kSeqDim, b.kv_chunk).add_(at::matmul(p.transpose(-2, -1), dob));
}

// Backward: K/V go around the ring again, and with each block its dK/dV accumulator, one step
// behind; after the last step each rank receives the finished gradients of its own K/V.
std::vector<at::Tensor> ring_backward(const RingSaved& s, at::Tensor dout) {
  at::NoGradGuard no_grad;
  const int64_t n = s.group.size(), me = s.group.rank();
  dout = dout.defined() ? dout.contiguous() : at::zeros_like(s.out);
  const at::Tensor delta = (dout * s.out).sum(-1);
  const std::vector<RingBlock> blocks = ring_attention_blocks(n, me, s.causal);
  at::Tensor dq = at::zeros_like(s.q);
  at::Tensor kv = at::stack({s.k, s.v}).contiguous();
  at::Tensor dkv = at::zeros_like(kv);
  std::unique_ptr<RingShift> grad_shift;
  for (int64_t step = 0; step < n; ++step) {
    std::unique_ptr<RingShift> kv_shift;
    if (step + 1 < n) kv_shift = std::make_unique<RingShift>(kv, s.group, comm::kRingKvTag);
    if (grad_shift) dkv = grad_shift->wait();  // the accumulator of the block now held
    for (const RingBlock& b : blocks)
      if (b.step == step) ring_block_backward(s, b, dout, delta, kv, dq, dkv);
    if (n > 1) grad_shift = std::make_unique<RingShift>(dkv, s.group, comm::kRingGradTag);
    if (kv_shift) kv = kv_shift->wait();
  }
  if (grad_shift) dkv = grad_shift->wait();  // our own block, every rank's share added
  return {dq, dkv[0], dkv[1]};
}

}  // namespace

at::Tensor ring_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const Group& group,
                          bool is_causal, std::optional<double> scale) {
  check_ring_inputs(q, k, v, is_causal, "ring_attention");
  auto saved = std::make_shared<RingSaved>();
  at::Tensor out;
  {
    at::NoGradGuard no_grad;
    // Detached: the saved tensors must not hold the graph (nor the output its own node).
    saved->q = q.detach().contiguous();
    saved->k = k.detach().contiguous();
    saved->v = v.detach().contiguous();
    saved->group = group;
    saved->causal = is_causal;
    saved->scale = cp::attention_scale(q, scale);
    std::tie(out, saved->lse) = ring_forward(*saved);
    saved->out = out.detach();
  }
  compat::set_custom_backward(out, {q, k, v}, "dtrain::ring_attention",
                              [saved](const at::Tensor& g, const std::vector<bool>& needs) {
                                std::vector<at::Tensor> grads = ring_backward(*saved, g);
                                for (size_t i = 0; i < grads.size(); ++i)
                                  if (!needs[i]) grads[i] = at::Tensor();
                                return grads;
                              });
  return out;
}

}  // namespace dtrain
