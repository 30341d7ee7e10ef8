// The histogram PyTorch's SummaryWriter.add_histogram writes with its default bins="tensorflow".
#pragma once

#include <ATen/core/Tensor.h>

#include <vector>

#include "monitor/tensorboard/events.h"

namespace dtrain::tensorboard {

// TensorFlow's bucket edges, as PyTorch builds them: 0, and +-1e-12 * 1.1^k for every k with
// 1e-12 * 1.1^k < 1e20, multiplied up step by step (so the edges equal PyTorch's to the last bit),
// ascending. 1549 edges.
const std::vector<double>& default_bucket_edges();

// numpy.histogram of the values (as float64) over the edges, then trimmed as PyTorch's
// make_histogram does: the buckets from the first to the last non-empty one, preceded by an empty
// bucket whose right limit is the support's left edge (TensorBoard keeps only right limits).
// min / max / num / sum / sum_squares over every value. Values outside [edges.front(), edges.back()]
// (and NaN) fall into no bucket, as in numpy. Returns false, leaving h alone, when no value falls
// into a bucket (PyTorch raises there): there is nothing TensorBoard could draw.
bool make_histogram(const at::Tensor& values, const std::vector<double>& edges, Histogram& h);

}  // namespace dtrain::tensorboard
