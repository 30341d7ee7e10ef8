// PowerSGD (Vogels, Karimireddy, Jaggi: "PowerSGD: Practical Low-Rank Gradient Compression for
// Distributed Optimization", 2019) as PyTorch's ddp_comm_hooks/powerSGD_hook.py computes it.
//
// powerSGD_hook, per bucket and synchronized iteration:
//   1. Before start_powerSGD_iter: allreduce_hook (plain average); the last bucket counts the iteration.
//   2. Error feedback: add the bucket's error memory (zeros the first time) and keep a copy.
//   3. Each gradient viewed as a matrix (shape[0] x the rest): compressed when
//      (n + m) * r * min_compression_rate < n * m with r = min(n, m, rank), else uncompressed.
//   4. The uncompressed ones are concatenated, to be all-reduced as one tensor together with P (step 6).
//   5. P and Q live in one flat tensor each per bucket, matrices grouped by shape in first-seen order.
//      Qs: the first time (always without warm start) drawn from N(0, 1) by a CPU generator seeded
//      with the state's next seed (numpy's RandomState(random_seed).randint(1e9), as PyTorch), each
//      orthogonalized; with warm start afterwards the previous Qs, orthogonalized again.
//   6. P = M Q, summed with step 4's tensor in one call (SUM: P is orthogonalized next, so the
//      scale does not matter).
//   --- the rest runs when DDP waits for the Future (Note [Comm hook futures]), step 7 up to Q's
//       all-reduce earlier: in the next bucket's hook or the first continuation (Note [PowerSGD pipeline]) ---
//   7. Uncompressed: divide by the group size, copy back. P orthogonalized, Q = M^T P, all-reduced and
//      divided by the group size, M = P Q^T written into the bucket.
//   8. Error memory = what step 2 left minus the result; without warm start P and Q are dropped;
//      the last bucket counts the iteration.
// Orthogonalization: Gram-Schmidt (with orthogonalization_epsilon) for r <= 2 and half types, else QR.
#include <algorithm>
#include <cmath>
#include <map>
#include <random>
#include <tuple>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>  // batched_powerSGD_hook's Q

#include "ddp/hook_collectives.h"
#include "ddp/powersgd_kernels.h"
#include "dtrain/comm_hooks.h"

namespace dtrain {
namespace psgd = ddp::psgd;

struct PowerSGDBucketStep;

struct detail::PowerSGDStateImpl {
  PowerSGDOptions options;
  std::mt19937 rng;  // numpy's RandomState(seed) is this generator seeded the same way
  std::map<int, at::Tensor> error, p_memory, q_memory;
  int64_t iter = 0;
  int64_t numel_before = 0, numel_after = 0;
  // Note [PowerSGD pipeline]: each bucket needs two all-reduces in sequence (P, then Q = M^T P of
  // the orthogonalized sum), and over TCP each costs a round trip of a millisecond or more however
  // small it is. Run in the continuations alone, the three that follow the last bucket's P (that P,
  // then each bucket's Q) waited one after the other at the end of backward with nothing to do
  // meanwhile. So a bucket's step 7 up to its Q all-reduce (started asynchronously) moves earlier:
  // - the hook of bucket k + 1, once its own P all-reduce is started, does it for bucket k (whose P
  //   went during the backward in between): bucket k + 1's P round trip passes meanwhile;
  // - the first continuation does it for the last bucket before writing its own bucket: that write
  //   (and each later bucket's) passes during the last Q's round trip;
  // - a continuation finds its bucket's Q started (or done) and writes the bucket once it is summed.
  // The order of collectives stays one on every rank: hooks run in bucket order, continuations after
  // them in bucket order (Note [Comm hook futures]), so every rank issues P0, P1, Q0, P2, Q1, ...,
  // then the last Q; only the program points moved. The values are PyTorch's: the same operations on
  // the same tensors. `pending`: the latest bucket whose P all-reduce is started and Q not yet.
  std::shared_ptr<PowerSGDBucketStep> pending;

  void maybe_increase_iter(bool is_last) {
    if (is_last) ++iter;
  }
  // Step 1 of both hooks: before start_powerSGD_iter the bucket is all-reduced uncompressed (it
  // counts the iteration when the last bucket passes).
  bool warming_up(const GradBucket& bucket) {
    if (iter >= options.start_powerSGD_iter()) return false;
    maybe_increase_iter(bucket.is_last());
    return true;
  }
  // numpy's legacy RandomState.randint(1_000_000_000): 32-bit draws masked to 30 bits, rejected
  // above the bound, so a C++ rank draws the seeds a Python rank would.
  int64_t next_seed() {
    constexpr uint32_t kHigh = 1000000000u - 1, kMask = (1u << 30) - 1;
    uint32_t v;
    do v = static_cast<uint32_t>(rng()) & kMask;
    while (v > kHigh);
    return v;
  }
};

// The hooks' way in (PowerSGDState keeps its state private).
struct detail::PowerSGDAccess {
  static const std::shared_ptr<PowerSGDStateImpl>& impl(const PowerSGDState& state) { return state.impl_; }
};

PowerSGDState::PowerSGDState(PowerSGDOptions o) : impl_(std::make_shared<detail::PowerSGDStateImpl>()) {
  DTRAIN_CHECK(o.matrix_approximation_rank() >= 1, "PowerSGDOptions: matrix_approximation_rank must be >= 1, got ",
               o.matrix_approximation_rank());
  DTRAIN_CHECK(!((o.use_error_feedback() || o.warm_start()) && o.start_powerSGD_iter() <= 1),
               "PowerSGDOptions: start_powerSGD_iter must be > 1 with use_error_feedback or warm_start, got ",
               o.start_powerSGD_iter(), ": start at 2 or later (PyTorch's rule), or turn both off");
  DTRAIN_CHECK(o.min_compression_rate() >= 0, "PowerSGDOptions: min_compression_rate must be >= 0, got ",
               o.min_compression_rate());
  DTRAIN_CHECK(o.orthogonalization_epsilon() >= 0, "PowerSGDOptions: orthogonalization_epsilon must be >= 0, got ",
               o.orthogonalization_epsilon());
  DTRAIN_CHECK(o.cpu_block_bytes() >= 0, "PowerSGDOptions: cpu_block_bytes must be >= 0 (0: no blocks), got ",
               o.cpu_block_bytes());
  impl_->rng.seed(o.random_seed());
  impl_->options = std::move(o);
}

const PowerSGDOptions& PowerSGDState::options() const { return impl_->options; }
int64_t PowerSGDState::iter() const { return impl_->iter; }
namespace {
at::Tensor find_or_undefined(const std::map<int, at::Tensor>& m, int k) {
  auto it = m.find(k);
  return it == m.end() ? at::Tensor() : it->second;
}
}  // namespace
at::Tensor PowerSGDState::error(int bucket) const { return find_or_undefined(impl_->error, bucket); }
at::Tensor PowerSGDState::p_memory(int bucket) const { return find_or_undefined(impl_->p_memory, bucket); }
at::Tensor PowerSGDState::q_memory(int bucket) const { return find_or_undefined(impl_->q_memory, bucket); }
PowerSGDState::CompressionStats PowerSGDState::compression_stats() const {
  CompressionStats s;
  s.numel_before = impl_->numel_before;
  s.numel_after = impl_->numel_after;
  s.rate = s.numel_after > 0 ? static_cast<double>(s.numel_before) / static_cast<double>(s.numel_after) : 0.0;
  return s;
}

// One bucket's PowerSGD step between its hook and its result (what the continuation needs).
struct PowerSGDBucketStep {
  Group group;
  int world = 1;
  bool is_last = false;
  at::Tensor input, sums, p_memory, q_memory;
  int64_t n_flat = 0, block_bytes = 0;
  double eps = 0;
  std::vector<at::Tensor> uncompressed, uncompressed_err, to_compress, to_compress_err, matrices, ps, qs;
  std::vector<std::vector<size_t>> members;
  Future p_sum, q_sum;  // q_sum is valid once start_q_sum ran
};

namespace {

// Step 7 up to Q's all-reduce, started asynchronously: the averages of the uncompressed tensors (and
// their error), P orthogonalized, Q = M^T P.
void start_q_sum(PowerSGDBucketStep& w) {
  w.p_sum.wait();
  if (w.n_flat > 0) w.p_memory.copy_(w.sums.narrow(0, w.n_flat, w.p_memory.numel()));
  // Step 8's error of the uncompressed tensors: what they held minus the average.
  const at::Tensor averages = w.sums.narrow(0, 0, w.n_flat).div_(w.world);
  int64_t at_ = 0;
  for (size_t u = 0; u < w.uncompressed.size(); ++u) {
    const at::Tensor& t = w.uncompressed[u];
    at::Tensor avg = averages.narrow(0, at_, t.numel()).view_as(t);
    if (w.uncompressed_err[u].defined()) at::sub_out(w.uncompressed_err[u], t, avg);
    t.copy_(avg);
    at_ += t.numel();
  }
  for (const auto& p : w.ps) psgd::orthogonalize(p, w.eps);
  // M^T P reads M once per column of P already (skinny_bmm_out); blocks did not make it cheaper.
  for (size_t k = 0; k < w.matrices.size(); ++k) psgd::skinny_bmm_out(w.qs[k], w.matrices[k].transpose(1, 2), w.ps[k]);
  w.q_sum = ddp::small_sum_future(w.q_memory, w.group);
}

// The rest of step 7 and step 8's error: M = P Q^T once Q is summed.
void write_result(PowerSGDBucketStep& w) {
  w.q_sum.wait();
  w.q_memory.div_(w.world);
  for (size_t k = 0; k < w.matrices.size(); ++k) {
    if (w.members[k].size() == 1) {
      // Step 8's error (M - P Q^T) in the same pass over M that makes M P Q^T.
      at::Tensor m = w.matrices[k][0];
      psgd::write_approximation(m, w.to_compress_err[w.members[k][0]], w.ps[k][0], w.qs[k][0], w.block_bytes);
    } else {
      at::bmm_out(w.matrices[k], w.ps[k], w.qs[k].transpose(1, 2));
      for (size_t i = 0; i < w.members[k].size(); ++i) {
        const size_t m = w.members[k][i];
        at::Tensor approx = w.matrices[k][static_cast<int64_t>(i)];
        if (w.to_compress_err[m].defined()) at::sub_out(w.to_compress_err[m], w.to_compress[m], approx);
        w.to_compress[m].copy_(approx);
      }
    }
  }
}

// Both hooks begin alike: the state, the bucket's buffer and place, and step 2's error memory.
struct HookStart {
  std::shared_ptr<detail::PowerSGDStateImpl> impl;
  Group group;
  int world = 1;
  at::Tensor input;
  bool is_last = false;
  int index = 0;
  Future warmup;           // step 1: valid() when the hook returns this plain average
  at::Tensor error;        // step 2's error memory (undefined without error feedback), of `error_numel`
  bool add_error = false;  // a new error memory is zeros: nothing to add
};

// Step 1, then step 2's error memory: the one this bucket kept, or new zeros of `error_numel`
// elements (the bucket's, or the batched hook's padded square).
HookStart begin_hook(PowerSGDState& state, GradBucket& bucket, int64_t error_numel) {
  HookStart h;
  h.impl = detail::PowerSGDAccess::impl(state);
  auto& s = *h.impl;
  h.group = s.options.process_group();
  h.world = h.group.size();
  h.input = bucket.buffer();
  h.is_last = bucket.is_last();
  h.index = bucket.index();
  if (s.warming_up(bucket)) {
    h.warmup = allreduce_hook(h.group, bucket);
    return h;
  }
  if (s.options.use_error_feedback()) {
    auto it = s.error.find(h.index);
    h.add_error = it != s.error.end();
    h.error = h.add_error ? it->second : (s.error[h.index] = at::zeros({error_numel}, h.input.options()));
  }
  return h;
}

// Step 3's result: per-parameter views of the bucket, to be compressed or not, each with the view of
// its error beside it, and the sizes of P and Q the compressed ones need.
struct Classified {
  std::vector<at::Tensor> to_compress, to_compress_err, uncompressed, uncompressed_err;
  int64_t total_p = 0, total_q = 0;
};

// Step 3: views of buffer() (not gradients(): under a compression wrapper buffer() is the cast copy,
// and that is what must be compressed); counts the compression statistics.
Classified classify(detail::PowerSGDStateImpl& s, const GradBucket& bucket, const at::Tensor& input,
                    const at::Tensor& error) {
  Classified c;
  int64_t offset = 0;
  for (const auto& g : bucket.gradients()) {
    at::Tensor t = input.narrow(0, offset, g.numel()).view(g.sizes());
    at::Tensor e = error.defined() ? error.narrow(0, offset, g.numel()).view(g.sizes()) : at::Tensor();
    offset += g.numel();
    const int64_t n = t.dim() == 0 ? 1 : t.size(0), m = t.numel() / std::max<int64_t>(n, 1);
    const int64_t r = std::min({n, m, s.options.matrix_approximation_rank()});
    const int64_t before = n * m, after = (n + m) * r;
    s.numel_before += before;
    if (static_cast<double>(after) * s.options.min_compression_rate() < static_cast<double>(before)) {
      c.to_compress.push_back(t.view({n, m}));
      c.to_compress_err.push_back(e.defined() ? e.view({n, m}) : e);
      c.total_p += n * r;
      c.total_q += m * r;
      s.numel_after += after;
    } else {
      c.uncompressed.push_back(t);
      c.uncompressed_err.push_back(e);
      s.numel_after += before;
    }
  }
  return c;
}

// Step 5's batches: per batch the matrices (b x n x m; a view of the bucket when b = 1, else a stacked
// copy, into which the error is added first), its P and Q in the bucket's flat memories, and the
// indices into to_compress it holds. Shapes in first-seen order.
struct Batches {
  std::vector<at::Tensor> matrices, ps, qs;
  std::vector<std::vector<size_t>> members;
};

Batches batch_by_shape(const PowerSGDOptions& o, Classified& c, bool add_error, const at::Tensor& p_memory,
                       const at::Tensor& q_memory) {
  std::vector<std::vector<size_t>> by_shape;
  for (size_t k = 0; k < c.to_compress.size(); ++k) {
    auto it = std::find_if(by_shape.begin(), by_shape.end(), [&](const std::vector<size_t>& v) {
      return c.to_compress[v[0]].sizes() == c.to_compress[k].sizes();
    });
    if (it == by_shape.end())
      by_shape.push_back({k});
    else
      it->push_back(k);
  }
  Batches out;
  int64_t p_at = 0, q_at = 0;
  for (auto& same_shape : by_shape) {
    std::vector<std::vector<size_t>> batches;
    if (o.batch_tensors_with_same_shape())
      batches.push_back(same_shape);
    else
      for (size_t k : same_shape) batches.push_back({k});
    for (auto& b : batches) {
      const at::Tensor& first = c.to_compress[b[0]];
      const int64_t count = static_cast<int64_t>(b.size()), n = first.size(0), m = first.size(1);
      const int64_t r = std::min({n, m, o.matrix_approximation_rank()});
      std::vector<at::Tensor> parts;
      for (size_t k : b) {
        if (add_error && count > 1) c.to_compress[k].add_(c.to_compress_err[k]);  // before the stacked copy
        parts.push_back(c.to_compress[k]);
      }
      out.matrices.push_back(count == 1 ? first.unsqueeze(0) : at::stack(parts));
      out.members.push_back(b);
      out.ps.push_back(p_memory.narrow(0, p_at, count * n * r).view({count, n, r}));
      out.qs.push_back(q_memory.narrow(0, q_at, count * m * r).view({count, m, r}));
      p_at += count * n * r;
      q_at += count * m * r;
    }
  }
  return out;
}

}  // namespace

Future powerSGD_hook(PowerSGDState& state, GradBucket& bucket) {
  HookStart h = begin_hook(state, bucket, bucket.buffer().numel());
  if (h.warmup.valid()) return h.warmup;
  std::shared_ptr<detail::PowerSGDStateImpl> impl = h.impl;
  auto& s = *impl;
  at::NoGradGuard ng;
  const at::Tensor& input = h.input;
  const bool add_error = h.add_error;
  // Step 2. The copy PyTorch keeps for the error is not needed: the error is written in step 8 from
  // the bucket's values before they are overwritten, into the same buffer (no allocation per step).
  // The error is added tensor by tensor below: into a matrix compressed on its own in the same pass
  // as M Q (psgd::fold_error_and_project), so that pass reads the matrix from memory only once.
  Classified c = classify(s, bucket, input, h.error);
  // Step 4.
  std::vector<at::Tensor> flat;
  for (size_t u = 0; u < c.uncompressed.size(); ++u) {
    if (add_error) c.uncompressed[u].add_(c.uncompressed_err[u]);
    flat.push_back(c.uncompressed[u].reshape({-1}));
  }
  at::Tensor uncompressed_memory = flat.empty() ? at::empty({0}, input.options()) : at::cat(flat);
  // Step 5.
  const bool randomize = !s.options.warm_start() || s.p_memory.count(h.index) == 0;
  if (randomize) {
    s.p_memory[h.index] = at::empty({c.total_p}, input.options());
    s.q_memory[h.index] = at::empty({c.total_q}, input.options());
  }
  at::Tensor p_memory = s.p_memory[h.index], q_memory = s.q_memory[h.index];
  Batches batches = batch_by_shape(s.options, c, add_error, p_memory, q_memory);
  std::vector<at::Tensor>&matrices = batches.matrices, &ps = batches.ps, &qs = batches.qs;
  std::vector<std::vector<size_t>>& members = batches.members;
  const double eps = s.options.orthogonalization_epsilon();
  if (!randomize)
    for (auto& q : qs) psgd::orthogonalize(q, eps);
  else
    psgd::random_qs(qs, s.next_seed(), eps);
  // Step 6 (and step 2 for the matrices compressed on their own).
  for (size_t k = 0; k < matrices.size(); ++k) {
    if (members[k].size() == 1) {
      at::Tensor p = ps[k][0];
      psgd::fold_error_and_project(matrices[k][0], add_error ? c.to_compress_err[members[k][0]] : at::Tensor(),
                                   qs[k][0], p, s.options.cpu_block_bytes());
    } else {
      psgd::skinny_bmm_out(ps[k], matrices[k], qs[k]);
    }
  }
  // Steps 4 and 6 share one all-reduce (PyTorch starts two): both are small, and over TCP between
  // busy ranks each collective costs a round of waiting for the other rank, more than its bytes.
  auto step = std::make_shared<PowerSGDBucketStep>();
  PowerSGDBucketStep& w = *step;
  w.group = h.group;
  w.world = h.world;
  w.is_last = h.is_last;
  w.input = input;
  w.uncompressed = std::move(c.uncompressed);
  w.uncompressed_err = std::move(c.uncompressed_err);
  w.n_flat = uncompressed_memory.numel();
  w.sums = w.n_flat == 0 ? p_memory : at::cat({uncompressed_memory, p_memory});
  w.to_compress = std::move(c.to_compress);
  w.to_compress_err = std::move(c.to_compress_err);
  w.matrices = std::move(matrices);
  w.members = std::move(members);
  w.ps = std::move(ps);
  w.qs = std::move(qs);
  w.p_memory = p_memory;
  w.q_memory = q_memory;
  w.eps = eps;
  w.block_bytes = s.options.cpu_block_bytes();
  w.p_sum = ddp::small_sum_future(w.sums, h.group);
  // Note [PowerSGD pipeline]: the previous bucket's Q all-reduce goes now, while this P is in flight.
  if (s.pending) start_q_sum(*s.pending);
  s.pending = step;
  return Future(input).then([impl, step](const at::Tensor&) {
    at::NoGradGuard ng;
    // The latest bucket's Q (this one's when it is the latest) goes before this bucket is written.
    if (impl->pending) {
      start_q_sum(*impl->pending);
      impl->pending.reset();
    }
    if (!step->q_sum.valid()) start_q_sum(*step);  // not reached: a later hook or the line above started it
    write_result(*step);
    // Step 8.
    if (!impl->options.warm_start()) {
      impl->p_memory.clear();
      impl->q_memory.clear();
    }
    impl->maybe_increase_iter(step->is_last);
    return step->input;
  });
}

Future batched_powerSGD_hook(PowerSGDState& state, GradBucket& bucket) {
  // PyTorch's square: side x side >= the bucket's elements, zero-padded.
  const int64_t total = bucket.buffer().numel();
  const int64_t side = static_cast<int64_t>(std::ceil(std::sqrt(static_cast<double>(total))));
  HookStart h = begin_hook(state, bucket, side * side);
  if (h.warmup.valid()) return h.warmup;
  std::shared_ptr<detail::PowerSGDStateImpl> impl = h.impl;
  auto& s = *impl;
  const Group group = h.group;
  const int world = h.world;
  at::Tensor input = h.input;
  const bool is_last = h.is_last;
  const int index = h.index;
  at::NoGradGuard ng;
  const int64_t r = s.options.matrix_approximation_rank();
  s.numel_before += total;
  s.numel_after += side * r * 2;
  // PyTorch resizes the bucket itself to side^2 (zero padding); a padded copy computes the same
  // values without reallocating the storage DDP's gradient slots view.
  at::Tensor padded = at::empty({side * side}, input.options());
  padded.narrow(0, 0, total).copy_(input);
  padded.narrow(0, total, side * side - total).zero_();
  // The error memory is added in the pass that computes P = M Q and written in place in the pass
  // that writes P Q^T (psgd::fold_error_and_project, psgd::write_approximation), as in powerSGD_hook.
  const bool add_error = h.add_error;
  at::Tensor error = h.error.defined() ? h.error.view({side, side}) : at::Tensor();
  at::Tensor matrix = padded.view({side, side});
  if (!s.options.warm_start() || s.p_memory.count(index) == 0) {
    s.p_memory[index] = at::empty({side, r}, input.options());
    auto gen = at::make_generator<at::CPUGeneratorImpl>(static_cast<uint64_t>(s.next_seed()));
    s.q_memory[index] = at::randn({side, r}, gen, input.options().device(at::kCPU)).to(input.device());
  }
  at::Tensor p = s.p_memory[index], q = s.q_memory[index];
  psgd::orthogonalize(q.unsqueeze(0), 0);  // PyTorch passes no epsilon here
  psgd::fold_error_and_project(matrix, add_error ? error : at::Tensor(), q, p, s.options.cpu_block_bytes());
  Future p_sum = ddp::small_sum_future(p, group);
  return p_sum.then(
      [impl, group, world, is_last, input, total, padded, error, matrix, p, q](const at::Tensor&) mutable {
        at::NoGradGuard ng;
        auto& s = *impl;
        psgd::orthogonalize(p.unsqueeze(0), 0);
        at::Tensor q3 = q.unsqueeze(0);
        psgd::skinny_bmm_out(q3, matrix.t().unsqueeze(0), p.unsqueeze(0));
        ddp::small_sum_future(q, group).wait();
        q.div_(world);
        psgd::write_approximation(matrix, error, p, q, s.options.cpu_block_bytes());
        if (!s.options.warm_start()) {
          s.p_memory.clear();
          s.q_memory.clear();
        }
        input.copy_(padded.narrow(0, 0, total));
        s.maybe_increase_iter(is_last);
        return input;
      });
}

}  // namespace dtrain
