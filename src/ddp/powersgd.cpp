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
#include <ATen/CPUGeneratorImpl.h>

#include "ddp/hook_collectives.h"
#include "dtrain/comm_hooks.h"

namespace dtrain {

struct PowerSGDBucketStep;

struct PowerSGDState::Impl {
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

PowerSGDState::PowerSGDState(PowerSGDOptions o) : impl_(std::make_shared<Impl>()) {
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

namespace {

// Gram-Schmidt on the columns of each matrix of a batch (b x n x r), in place.
void gram_schmidt(at::Tensor& m, double epsilon) {
  static const int64_t kRowDim = 1;
  const at::IntArrayRef kRows(&kRowDim, 1);
  const int64_t cols = m.size(2);
  for (int64_t i = 0; i < cols; ++i) {
    at::Tensor col = m.narrow(2, i, 1);
    at::Tensor norm = at::linalg_vector_norm(col, 2, kRows, /*keepdim=*/true);
    col.div_(epsilon == 0 ? norm : norm + epsilon);
    if (i + 1 < cols) {
      at::Tensor rest = m.narrow(2, i + 1, cols - i - 1);
      rest.sub_(at::sum(col * rest, kRows, /*keepdim=*/true) * col);
    }
  }
}

// PyTorch's _orthogonalize: QR is faster beyond rank 2 but has no half-precision kernels.
void orthogonalize(at::Tensor m, double epsilon) {
  const auto dtype = m.scalar_type();
  if (m.size(2) <= 2 || dtype == at::kHalf || dtype == at::kBFloat16) {
    gram_schmidt(m, epsilon);
  } else {
    m.copy_(std::get<0>(at::linalg_qr(m)));
  }
}

// out = a b for a batch of matrices (b x n x m times b x m x r), where r is PowerSGD's small rank.
// A general matrix product first copies (packs) all of `a` into panels; a product with r columns
// of `b` reads `a` once per column instead, which for r <= 2 costs less than the packing. The sums
// are the same up to the order of float additions.
void skinny_bmm_out(at::Tensor& out, const at::Tensor& a, const at::Tensor& b) {
  if (b.size(2) > 2) {
    at::bmm_out(out, a, b);
    return;
  }
  for (int64_t i = 0; i < a.size(0); ++i)
    for (int64_t j = 0; j < b.size(2); ++j) {
      at::Tensor col = out.select(0, i).select(1, j);
      if (col.is_contiguous()) {
        at::mv_out(col, a.select(0, i), b.select(0, i).select(1, j));
      } else {
        col.copy_(at::mv(a.select(0, i), b.select(0, i).select(1, j)));
      }
    }
}

// Rows of a matrix that one block of the passes below holds. Those passes go over a matrix block by
// block so that the block they read from memory is still in the core's L2 cache for the rest of
// their work on it: the error added and M Q in one read of M, and M - P Q^T and P Q^T in one, instead of a read (and
// often a write) of the whole matrix per operation. PowerSGD's work on the CPU is bound by memory traffic, not
// arithmetic (rank r is small), so this is what costs. block_bytes: PowerSGDOptions::cpu_block_bytes (by default a
// block and the scratch beside it fill half of a 512 KB L2, leaving room for the error memory streaming through).
int64_t psgd_block_rows(const at::Tensor& m, int64_t block_bytes) {
  const int64_t n = std::max<int64_t>(m.size(0), 1);
  // A GPU gains nothing from host-cache-sized blocks, only more kernel launches: one block.
  if (!m.device().is_cpu() || block_bytes == 0) return n;
  const int64_t row_bytes = std::max<int64_t>(m.size(1) * static_cast<int64_t>(m.element_size()), 1);
  return std::clamp<int64_t>(block_bytes / row_bytes, 1, n);
}

// Steps 2 and 6 for one matrix: m += err (when err is defined), then p = m q, block by block. For
// r <= 2 a column of p at a time with matrix-vector products (see skinny_bmm_out: a general matrix
// product with so few columns costs more), into a transposed scratch whose rows are contiguous.
void psgd_fold_error_and_project(const at::Tensor& m, const at::Tensor& err, const at::Tensor& q, at::Tensor& p,
                                 int64_t block_bytes) {
  const int64_t n = m.size(0), r = q.size(1), rows = psgd_block_rows(m, block_bytes);
  const bool skinny = r <= 2;
  at::Tensor pt = skinny ? at::empty({r, n}, p.options()) : at::Tensor();
  for (int64_t i = 0; i < n; i += rows) {
    const int64_t b = std::min(rows, n - i);
    at::Tensor blk = m.narrow(0, i, b);
    if (err.defined()) blk.add_(err.narrow(0, i, b));
    if (!skinny) {
      at::Tensor pb = p.narrow(0, i, b);
      at::mm_out(pb, blk, q);
      continue;
    }
    for (int64_t j = 0; j < r; ++j) {
      at::Tensor out = pt.select(0, j).narrow(0, i, b);
      at::mv_out(out, blk, q.select(1, j));
    }
  }
  if (skinny) p.copy_(pt.t());
}

// Steps 7 and 8 for one matrix: err = m - p q^T (when err is defined), then m = p q^T, block by
// block: each block of the approximation is computed once into a cache-sized scratch and used twice.
// For r <= 2 the product is a sum of r outer products (elementwise kernels): a matrix product with
// an inner dimension of 1 or 2 runs far below memory speed (3 ms for P Q^T over 16.8 MB of float32,
// measured, against 1.8 ms for a plain copy).
void psgd_write_approximation(at::Tensor& m, const at::Tensor& err, const at::Tensor& p, const at::Tensor& q,
                              int64_t block_bytes) {
  const int64_t n = m.size(0), r = q.size(1), rows = psgd_block_rows(m, block_bytes);
  const bool skinny = r <= 2;
  const at::Tensor qt = q.t().contiguous();
  at::Tensor scratch = err.defined() ? at::empty({rows, m.size(1)}, m.options()) : at::Tensor();
  for (int64_t i = 0; i < n; i += rows) {
    const int64_t b = std::min(rows, n - i);
    at::Tensor blk = m.narrow(0, i, b), pb = p.narrow(0, i, b);
    at::Tensor approx = err.defined() ? scratch.narrow(0, 0, b) : blk;
    if (skinny) {
      at::mul_out(approx, pb.narrow(1, 0, 1), qt.narrow(0, 0, 1));
      for (int64_t j = 1; j < r; ++j) approx.addcmul_(pb.narrow(1, j, 1), qt.narrow(0, j, 1));
    } else {
      at::mm_out(approx, pb, qt);
    }
    if (!err.defined()) continue;
    at::Tensor eb = err.narrow(0, i, b);
    at::sub_out(eb, blk, approx);
    blk.copy_(approx);
  }
}

// N(0, 1) values for each q in turn from one generator seeded with `seed`, each orthogonalized.
void random_qs(std::vector<at::Tensor>& qs, int64_t seed, double epsilon) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(static_cast<uint64_t>(seed));
  for (auto& q : qs) {
    q.copy_(at::randn(q.sizes(), gen, q.options().device(at::kCPU)));
    orthogonalize(q, epsilon);
  }
}

}  // namespace

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
  for (const auto& p : w.ps) orthogonalize(p, w.eps);
  // M^T P reads M once per column of P already (skinny_bmm_out); blocks did not make it cheaper.
  for (size_t k = 0; k < w.matrices.size(); ++k) skinny_bmm_out(w.qs[k], w.matrices[k].transpose(1, 2), w.ps[k]);
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
      psgd_write_approximation(m, w.to_compress_err[w.members[k][0]], w.ps[k][0], w.qs[k][0], w.block_bytes);
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

}  // namespace

Future powerSGD_hook(PowerSGDState& state, GradBucket& bucket) {
  std::shared_ptr<PowerSGDState::Impl> impl = state.impl();
  auto& s = *impl;
  const Group group = s.options.process_group();
  const int world = group.size();
  at::Tensor input = bucket.buffer();
  const bool is_last = bucket.is_last();
  if (s.warming_up(bucket)) return allreduce_hook(group, bucket);  // step 1
  at::NoGradGuard ng;
  const int index = bucket.index();
  // Step 2. The copy PyTorch keeps for the error is not needed: the error is written in step 8 from
  // the bucket's values before they are overwritten, into the same buffer (no allocation per step).
  // The error is added tensor by tensor below: into a matrix compressed on its own in the same pass
  // as M Q (psgd_fold_error_and_project), so that pass reads the matrix from memory only once.
  at::Tensor error;
  bool add_error = false;  // a new error memory is zeros: nothing to add
  if (s.options.use_error_feedback()) {
    auto it = s.error.find(index);
    add_error = it != s.error.end();
    error = add_error ? it->second : (s.error[index] = at::zeros({input.numel()}, input.options()));
  }
  // Step 3: per-parameter views of buffer() (not gradients(): under a compression wrapper buffer()
  // is the cast copy, and that is what must be compressed), with the error's view beside each.
  std::vector<at::Tensor> to_compress, uncompressed, to_compress_err, uncompressed_err;
  int64_t offset = 0, total_p = 0, total_q = 0;
  for (const auto& g : bucket.gradients()) {
    at::Tensor t = input.narrow(0, offset, g.numel()).view(g.sizes());
    at::Tensor e = error.defined() ? error.narrow(0, offset, g.numel()).view(g.sizes()) : at::Tensor();
    offset += g.numel();
    const int64_t n = t.dim() == 0 ? 1 : t.size(0), m = t.numel() / std::max<int64_t>(n, 1);
    const int64_t r = std::min({n, m, s.options.matrix_approximation_rank()});
    const int64_t before = n * m, after = (n + m) * r;
    s.numel_before += before;
    if (static_cast<double>(after) * s.options.min_compression_rate() < static_cast<double>(before)) {
      to_compress.push_back(t.view({n, m}));
      to_compress_err.push_back(e.defined() ? e.view({n, m}) : e);
      total_p += n * r;
      total_q += m * r;
      s.numel_after += after;
    } else {
      uncompressed.push_back(t);
      uncompressed_err.push_back(e);
      s.numel_after += before;
    }
  }
  // Step 4.
  std::vector<at::Tensor> flat;
  for (size_t u = 0; u < uncompressed.size(); ++u) {
    if (add_error) uncompressed[u].add_(uncompressed_err[u]);
    flat.push_back(uncompressed[u].reshape({-1}));
  }
  at::Tensor uncompressed_memory = flat.empty() ? at::empty({0}, input.options()) : at::cat(flat);
  // Step 5.
  const bool randomize = !s.options.warm_start() || s.p_memory.count(index) == 0;
  if (randomize) {
    s.p_memory[index] = at::empty({total_p}, input.options());
    s.q_memory[index] = at::empty({total_q}, input.options());
  }
  at::Tensor p_memory = s.p_memory[index], q_memory = s.q_memory[index];
  std::vector<std::vector<size_t>> by_shape;  // indices into to_compress, shapes in first-seen order
  for (size_t k = 0; k < to_compress.size(); ++k) {
    auto it = std::find_if(by_shape.begin(), by_shape.end(), [&](const std::vector<size_t>& v) {
      return to_compress[v[0]].sizes() == to_compress[k].sizes();
    });
    if (it == by_shape.end())
      by_shape.push_back({k});
    else
      it->push_back(k);
  }
  // Per batch: the matrices (b x n x m; a view of the bucket when b = 1, else a stacked copy), P, Q.
  std::vector<at::Tensor> matrices, ps, qs;
  std::vector<std::vector<size_t>> members;
  int64_t p_at = 0, q_at = 0;
  for (auto& same_shape : by_shape) {
    std::vector<std::vector<size_t>> batches;
    if (s.options.batch_tensors_with_same_shape())
      batches.push_back(same_shape);
    else
      for (size_t k : same_shape) batches.push_back({k});
    for (auto& b : batches) {
      const at::Tensor& first = to_compress[b[0]];
      const int64_t count = static_cast<int64_t>(b.size()), n = first.size(0), m = first.size(1);
      const int64_t r = std::min({n, m, s.options.matrix_approximation_rank()});
      std::vector<at::Tensor> parts;
      for (size_t k : b) {
        if (add_error && count > 1) to_compress[k].add_(to_compress_err[k]);  // before the stacked copy
        parts.push_back(to_compress[k]);
      }
      matrices.push_back(count == 1 ? first.unsqueeze(0) : at::stack(parts));
      members.push_back(b);
      ps.push_back(p_memory.narrow(0, p_at, count * n * r).view({count, n, r}));
      qs.push_back(q_memory.narrow(0, q_at, count * m * r).view({count, m, r}));
      p_at += count * n * r;
      q_at += count * m * r;
    }
  }
  const double eps = s.options.orthogonalization_epsilon();
  if (!randomize)
    for (auto& q : qs) orthogonalize(q, eps);
  else
    random_qs(qs, s.next_seed(), eps);
  // Step 6 (and step 2 for the matrices compressed on their own).
  for (size_t k = 0; k < matrices.size(); ++k) {
    if (members[k].size() == 1) {
      at::Tensor p = ps[k][0];
      psgd_fold_error_and_project(matrices[k][0], add_error ? to_compress_err[members[k][0]] : at::Tensor(), qs[k][0],
                                  p, s.options.cpu_block_bytes());
    } else {
      skinny_bmm_out(ps[k], matrices[k], qs[k]);
    }
  }
  // Steps 4 and 6 share one all-reduce (PyTorch starts two): both are small, and over TCP between
  // busy ranks each collective costs a round of waiting for the other rank, more than its bytes.
  auto step = std::make_shared<PowerSGDBucketStep>();
  PowerSGDBucketStep& w = *step;
  w.group = group;
  w.world = world;
  w.is_last = is_last;
  w.input = input;
  w.uncompressed = std::move(uncompressed);
  w.uncompressed_err = std::move(uncompressed_err);
  w.n_flat = uncompressed_memory.numel();
  w.sums = w.n_flat == 0 ? p_memory : at::cat({uncompressed_memory, p_memory});
  w.to_compress = std::move(to_compress);
  w.to_compress_err = std::move(to_compress_err);
  w.matrices = std::move(matrices);
  w.members = std::move(members);
  w.ps = std::move(ps);
  w.qs = std::move(qs);
  w.p_memory = p_memory;
  w.q_memory = q_memory;
  w.eps = eps;
  w.block_bytes = s.options.cpu_block_bytes();
  w.p_sum = ddp::small_sum_future(w.sums, group);
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
  std::shared_ptr<PowerSGDState::Impl> impl = state.impl();
  auto& s = *impl;
  const Group group = s.options.process_group();
  const int world = group.size();
  at::Tensor input = bucket.buffer();
  const bool is_last = bucket.is_last();
  if (s.warming_up(bucket)) return allreduce_hook(group, bucket);
  at::NoGradGuard ng;
  const int index = bucket.index();
  const int64_t total = input.numel();
  const int64_t side = static_cast<int64_t>(std::ceil(std::sqrt(static_cast<double>(total))));
  const int64_t r = s.options.matrix_approximation_rank();
  s.numel_before += total;
  s.numel_after += side * r * 2;
  // PyTorch resizes the bucket itself to side^2 (zero padding); a padded copy computes the same
  // values without reallocating the storage DDP's gradient slots view.
  at::Tensor padded = at::empty({side * side}, input.options());
  padded.narrow(0, 0, total).copy_(input);
  padded.narrow(0, total, side * side - total).zero_();
  // The error memory is added in the pass that computes P = M Q and written in place in the pass
  // that writes P Q^T (psgd_fold_error_and_project, psgd_write_approximation), as in powerSGD_hook.
  at::Tensor error;
  bool add_error = false;
  if (s.options.use_error_feedback()) {
    auto it = s.error.find(index);
    add_error = it != s.error.end();
    error = (add_error ? it->second : (s.error[index] = at::zeros({side * side}, input.options()))).view({side, side});
  }
  at::Tensor matrix = padded.view({side, side});
  if (!s.options.warm_start() || s.p_memory.count(index) == 0) {
    s.p_memory[index] = at::empty({side, r}, input.options());
    auto gen = at::make_generator<at::CPUGeneratorImpl>(static_cast<uint64_t>(s.next_seed()));
    s.q_memory[index] = at::randn({side, r}, gen, input.options().device(at::kCPU)).to(input.device());
  }
  at::Tensor p = s.p_memory[index], q = s.q_memory[index];
  orthogonalize(q.unsqueeze(0), 0);  // PyTorch passes no epsilon here
  psgd_fold_error_and_project(matrix, add_error ? error : at::Tensor(), q, p, s.options.cpu_block_bytes());
  Future p_sum = ddp::small_sum_future(p, group);
  return p_sum.then(
      [impl, group, world, is_last, input, total, padded, error, matrix, p, q](const at::Tensor&) mutable {
        at::NoGradGuard ng;
        auto& s = *impl;
        orthogonalize(p.unsqueeze(0), 0);
        at::Tensor q3 = q.unsqueeze(0);
        skinny_bmm_out(q3, matrix.t().unsqueeze(0), p.unsqueeze(0));
        ddp::small_sum_future(q, group).wait();
        q.div_(world);
        psgd_write_approximation(matrix, error, p, q, s.options.cpu_block_bytes());
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
