// PowerSGD's CPU kernels (powersgd.cpp's steps 2, 6, 7 and 8 on one matrix or a batch): the
// orthogonalization PyTorch uses, and the passes over a gradient matrix arranged so that each block of
// it is read from memory once. Internal to src/ddp.
#pragma once

#include <cstdint>
#include <vector>

#include <ATen/ATen.h>

namespace dtrain::ddp::psgd {

// PyTorch's _orthogonalize on each matrix of a batch (b x n x r), in place: Gram-Schmidt (with
// epsilon) for r <= 2 and half types, else QR.
void orthogonalize(at::Tensor m, double epsilon);

// out = a b for a batch of matrices (b x n x m times b x m x r), where r is PowerSGD's small rank.
void skinny_bmm_out(at::Tensor& out, const at::Tensor& a, const at::Tensor& b);

// Steps 2 and 6 for one matrix: m += err (when err is defined), then p = m q, block by block.
void fold_error_and_project(const at::Tensor& m, const at::Tensor& err, const at::Tensor& q, at::Tensor& p,
                            int64_t block_bytes);

// Steps 7 and 8 for one matrix: err = m - p q^T (when err is defined), then m = p q^T, block by block.
void write_approximation(at::Tensor& m, const at::Tensor& err, const at::Tensor& p, const at::Tensor& q,
                         int64_t block_bytes);

// N(0, 1) values for each q in turn from one generator seeded with `seed`, each orthogonalized.
void random_qs(std::vector<at::Tensor>& qs, int64_t seed, double epsilon);

}  // namespace dtrain::ddp::psgd
