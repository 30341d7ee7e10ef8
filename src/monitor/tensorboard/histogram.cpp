#include "monitor/tensorboard/histogram.h"

#include <algorithm>

#include <ATen/ATen.h>

namespace dtrain::tensorboard {

const std::vector<double>& default_bucket_edges() {
  static const std::vector<double> edges = [] {
    std::vector<double> pos;
    for (double v = 1e-12; v < 1e20; v *= 1.1) pos.push_back(v);
    std::vector<double> e;
    e.reserve(2 * pos.size() + 1);
    for (auto it = pos.rbegin(); it != pos.rend(); ++it) e.push_back(-*it);
    e.push_back(0.0);
    e.insert(e.end(), pos.begin(), pos.end());
    return e;
  }();
  return edges;
}

bool make_histogram(const at::Tensor& values, const std::vector<double>& edges, Histogram& h) {
  at::NoGradGuard no_grad;
  const at::Tensor v = values.detach().to(at::kCPU, at::kDouble).contiguous().reshape({-1});  // (N,)
  const int64_t n = v.numel();
  const double* x = v.data_ptr<double>();

  // numpy's bins: [e_i, e_i+1) and the last one closed, [e_n-1, e_n].
  const size_t nbins = edges.size() - 1;
  std::vector<double> counts(nbins, 0.0);
  for (int64_t i = 0; i < n; ++i) {
    if (!(x[i] >= edges.front() && x[i] <= edges.back())) continue;
    size_t b = static_cast<size_t>(std::upper_bound(edges.begin(), edges.end(), x[i]) - edges.begin()) - 1;
    counts[std::min(b, nbins - 1)] += 1;
  }
  size_t first = nbins, last = 0;  // the support: the first and the last non-empty bucket
  for (size_t b = 0; b < nbins; ++b)
    if (counts[b] > 0) first = std::min(first, b), last = b;
  if (first == nbins) return false;

  h.bucket.clear();
  h.bucket_limit.clear();
  if (first == 0) h.bucket.push_back(0.0);
  for (size_t b = first == 0 ? 0 : first - 1; b <= last; ++b) h.bucket.push_back(counts[b]);
  for (size_t e = first; e <= last + 1; ++e) h.bucket_limit.push_back(edges[e]);

  h.min = v.min().item<double>();
  h.max = v.max().item<double>();
  h.num = static_cast<double>(n);
  h.sum = v.sum().item<double>();
  h.sum_squares = v.dot(v).item<double>();
  return true;
}

}  // namespace dtrain::tensorboard
