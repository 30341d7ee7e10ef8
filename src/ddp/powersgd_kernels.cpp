// PowerSGD's CPU kernels (powersgd_kernels.h).
#include "ddp/powersgd_kernels.h"

#include <algorithm>
#include <tuple>

#include <ATen/CPUGeneratorImpl.h>

namespace dtrain::ddp::psgd {
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

// Rows of a matrix that one block of the passes below holds. Those passes go over a matrix block by
// block so that the block they read from memory is still in the core's L2 cache for the rest of
// their work on it: the error added and M Q in one read of M, and M - P Q^T and P Q^T in one, instead of a read (and
// often a write) of the whole matrix per operation. PowerSGD's work on the CPU is bound by memory traffic, not
// arithmetic (rank r is small), so this is what costs. block_bytes: PowerSGDOptions::cpu_block_bytes (by default a
// block and the scratch beside it fill half of a 512 KB L2, leaving room for the error memory streaming through).
int64_t block_rows(const at::Tensor& m, int64_t block_bytes) {
  const int64_t n = std::max<int64_t>(m.size(0), 1);
  // A GPU gains nothing from host-cache-sized blocks, only more kernel launches: one block.
  if (!m.device().is_cpu() || block_bytes == 0) return n;
  const int64_t row_bytes = std::max<int64_t>(m.size(1) * static_cast<int64_t>(m.element_size()), 1);
  return std::clamp<int64_t>(block_bytes / row_bytes, 1, n);
}

}  // namespace

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

// Steps 2 and 6 for one matrix: m += err (when err is defined), then p = m q, block by block. For
// r <= 2 a column of p at a time with matrix-vector products (see skinny_bmm_out: a general matrix
// product with so few columns costs more), into a transposed scratch whose rows are contiguous.
void fold_error_and_project(const at::Tensor& m, const at::Tensor& err, const at::Tensor& q, at::Tensor& p,
                            int64_t block_bytes) {
  const int64_t n = m.size(0), r = q.size(1), rows = block_rows(m, block_bytes);
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
// an inner dimension of 1 or 2 runs far below memory speed, slower than a plain copy of the matrix.
void write_approximation(at::Tensor& m, const at::Tensor& err, const at::Tensor& p, const at::Tensor& q,
                         int64_t block_bytes) {
  const int64_t n = m.size(0), r = q.size(1), rows = block_rows(m, block_bytes);
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

}  // namespace dtrain::ddp::psgd
