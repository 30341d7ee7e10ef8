// PowerSGD written out plainly for the tests that check dtrain's hooks against it: every rank
// simulated in one process (float64), PyTorch's semantics step by step (warm-up steps, error
// feedback, warm start, shape groups, min_compression_rate, the seeds of the random Qs), and a rank
// that has joined a dtrain::Join sending zeros. Slow and obvious on purpose: it shares no code with
// src/ddp/powersgd.cpp.
#pragma once

#include <algorithm>
#include <cstdint>
#include <map>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include "dtrain/comm_hooks.h"

namespace dtrain::powersgd_ref {

// numpy.random.RandomState(0).randint(1_000_000_000), drawn 24 times: the seeds of PowerSGD's random
// Qs in PyTorch with random_seed=0.
inline const std::vector<int64_t> kNumpySeeds0 = {209652396, 398764591, 924231285, 404868288, 441365315, 463622907,
                                                  192771779, 417693031, 745841673, 530702035, 626610453, 577165042,
                                                  805680932, 204159575, 608910406, 243580376, 917674584, 97308044,
                                                  573126970, 977814209, 179207654, 267012647, 124102743, 987744430};

// Rank-local gradients grads[i] of the parameters a DDP bucket holds (bucket: parameter indices, in
// the bucket's order), as one flat tensor: what the bucket's hook sees.
inline at::Tensor flatten_bucket(const std::vector<at::Tensor>& grads, const std::vector<int>& bucket) {
  std::vector<at::Tensor> parts;
  for (int i : bucket) parts.push_back(grads[i].reshape({-1}));
  return at::cat(parts);
}

// The inverse: out[i] for each parameter i of the bucket, shaped as shapes[i].
inline void unflatten_bucket(const at::Tensor& flat, const std::vector<int>& bucket,
                             const std::vector<at::Tensor>& shapes, std::vector<at::Tensor>& out) {
  int64_t off = 0;
  for (int i : bucket) {
    out[i] = flat.narrow(0, off, shapes[i].numel()).view(shapes[i].sizes()).clone();
    off += shapes[i].numel();
  }
}

inline at::Tensor gram_schmidt_ref(at::Tensor m, double eps) {  // m: rows x cols, columns orthonormalized
  for (int64_t i = 0; i < m.size(1); ++i) {
    at::Tensor col = m.select(1, i);
    col.div_(col.norm().item<double>() + eps);
    for (int64_t j = i + 1; j < m.size(1); ++j) {
      at::Tensor other = m.select(1, j);
      other.sub_(col * at::dot(col, other));
    }
  }
  return m;
}

// Layer-wise PowerSGD (powerSGD_hook) over DDP's buckets: step() takes every rank's local gradients
// and returns what each rank's .grad() holds after the hook; p, q and error are the hook's memories.
struct RefPowerSGD {
  RefPowerSGD(PowerSGDOptions options, int world_size, std::vector<std::vector<int>> bucket_params,
              std::vector<at::Tensor> params)
      : o(std::move(options)), world(world_size), buckets(std::move(bucket_params)), shapes(std::move(params)) {}
  PowerSGDOptions o;
  int world;
  std::vector<std::vector<int>> buckets;  // DDP's bucket -> parameter indices
  std::vector<at::Tensor> shapes;         // a tensor per parameter, for its shape
  size_t next_seed = 0;
  int64_t iter = 0;
  std::map<int, std::vector<at::Tensor>> error;  // bucket -> per rank
  std::map<int, at::Tensor> p, q;                // bucket -> flat, as the hook keeps them
  // Whether a rank that has joined adds its error memory to its zeros (PyTorch's), or sends zeros.
  bool joined_error = true;

  // grads[r][i]: rank r's local gradient of parameter i (zeros for a rank that has joined a
  // dtrain::Join; joined[r] says which, empty: none). Returns the averaged gradients.
  std::vector<at::Tensor> step(const std::vector<std::vector<at::Tensor>>& grads,
                               const std::vector<bool>& joined = {}) {
    std::vector<at::Tensor> out(shapes.size());
    const bool compress = iter >= o.start_powerSGD_iter();
    for (size_t b = 0; b < buckets.size(); ++b) {
      const int bi = static_cast<int>(b);
      // Each rank's flat bucket, with its error added.
      std::vector<at::Tensor> flat(world);
      for (int r = 0; r < world; ++r) flat[r] = flatten_bucket(grads[r], buckets[b]);
      if (!compress) {
        at::Tensor sum = flat[0] / world;
        for (int r = 1; r < world; ++r) sum = sum + flat[r] / world;
        unflatten(b, sum, out);
        continue;
      }
      std::vector<at::Tensor> before(world);
      for (int r = 0; r < world; ++r) {
        const bool adds_error = joined_error || joined.empty() || !joined[r];
        if (o.use_error_feedback() && error.count(bi) && adds_error) flat[r] = flat[r] + error[bi][r];
        before[r] = flat[r].clone();
      }
      // Matrices per rank, in shape-group order; uncompressed parameters averaged directly.
      struct Mat {
        int param;
        int64_t n, m, rank;
      };
      std::vector<Mat> mats;
      std::vector<std::vector<int64_t>> group_shapes;
      std::vector<std::vector<Mat>> groups;
      std::vector<at::Tensor> result(world);
      for (int r = 0; r < world; ++r) result[r] = flat[r].clone();
      int64_t off = 0;
      std::map<int, int64_t> offset_of;
      for (int i : buckets[b]) {
        offset_of[i] = off;
        const int64_t n = shapes[i].size(0), m = shapes[i].numel() / n;
        const int64_t rk = std::min({n, m, o.matrix_approximation_rank()});
        if (static_cast<double>((n + m) * rk) * o.min_compression_rate() < static_cast<double>(n * m)) {
          std::vector<int64_t> key{n, m};
          auto it = std::find(group_shapes.begin(), group_shapes.end(), key);
          if (it == group_shapes.end()) {
            group_shapes.push_back(key);
            groups.push_back({});
            it = group_shapes.end() - 1;
          }
          groups[it - group_shapes.begin()].push_back(Mat{i, n, m, rk});
        } else {
          at::Tensor sum = at::zeros({shapes[i].numel()}, flat[0].options());
          for (int r = 0; r < world; ++r) sum = sum + flat[r].narrow(0, off, shapes[i].numel());
          for (int r = 0; r < world; ++r) result[r].narrow(0, off, shapes[i].numel()).copy_(sum / world);
        }
        off += shapes[i].numel();
      }
      for (auto& g : groups) mats.insert(mats.end(), g.begin(), g.end());
      auto matrix = [&](const at::Tensor& f, const Mat& mt) {
        return f.narrow(0, offset_of[mt.param], mt.n * mt.m).view({mt.n, mt.m});
      };
      // Qs: random the first time (or always without warm start), else last step's.
      std::vector<at::Tensor> qs;
      if (!o.warm_start() || !q.count(bi)) {
        // One draw per matrix, or per shape group when same-shaped matrices are batched.
        auto gen = at::make_generator<at::CPUGeneratorImpl>(static_cast<uint64_t>(kNumpySeeds0.at(next_seed++)));
        for (auto& g : groups) {
          if (o.batch_tensors_with_same_shape()) {
            at::Tensor all = at::randn({static_cast<int64_t>(g.size()), g[0].m, g[0].rank}, gen, flat[0].options());
            for (size_t k = 0; k < g.size(); ++k)
              qs.push_back(gram_schmidt_ref(all[static_cast<int64_t>(k)].clone(), o.orthogonalization_epsilon()));
          } else {
            for (auto& mt : g)
              qs.push_back(
                  gram_schmidt_ref(at::randn({mt.m, mt.rank}, gen, flat[0].options()), o.orthogonalization_epsilon()));
          }
        }
      } else {
        int64_t at_ = 0;
        for (auto& mt : mats) {
          qs.push_back(gram_schmidt_ref(q[bi].narrow(0, at_, mt.m * mt.rank).view({mt.m, mt.rank}).clone(),
                                        o.orthogonalization_epsilon()));
          at_ += mt.m * mt.rank;
        }
      }
      std::vector<at::Tensor> ps, qsum;
      for (size_t k = 0; k < mats.size(); ++k) {
        at::Tensor psum = at::zeros({mats[k].n, mats[k].rank}, flat[0].options());
        for (int r = 0; r < world; ++r) psum = psum + at::mm(matrix(flat[r], mats[k]), qs[k]);
        ps.push_back(gram_schmidt_ref(psum, o.orthogonalization_epsilon()));
      }
      for (size_t k = 0; k < mats.size(); ++k) {
        at::Tensor s = at::zeros({mats[k].m, mats[k].rank}, flat[0].options());
        for (int r = 0; r < world; ++r) s = s + at::mm(matrix(flat[r], mats[k]).t(), ps[k]);
        qsum.push_back(s / world);
      }
      for (size_t k = 0; k < mats.size(); ++k)
        for (int r = 0; r < world; ++r) matrix(result[r], mats[k]).copy_(at::mm(ps[k], qsum[k].t()));
      std::vector<at::Tensor> pf, qf;
      for (auto& t : ps) pf.push_back(t.reshape({-1}));
      for (auto& t : qsum) qf.push_back(t.reshape({-1}));
      p[bi] = at::cat(pf);
      q[bi] = at::cat(qf);
      if (o.use_error_feedback()) {
        error[bi].assign(world, at::Tensor());
        for (int r = 0; r < world; ++r) error[bi][r] = before[r] - result[r];
      }
      unflatten(b, result[0], out);
    }
    ++iter;
    return out;
  }

  void unflatten(size_t b, const at::Tensor& flat, std::vector<at::Tensor>& out) {
    unflatten_bucket(flat, buckets[b], shapes, out);
  }
};

}  // namespace dtrain::powersgd_ref
