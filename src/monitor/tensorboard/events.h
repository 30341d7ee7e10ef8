// Serialized TensorBoard Event messages (event.proto), one function per kind of record dtrain writes.
//
// The only code that touches protobuf: it is compiled into the small static library
// dtrain_tensorboard_events with hidden visibility, so libdtrain exports no protobuf symbol and no
// file of libdtrain includes a protobuf header (Note [TensorBoard and protobuf] in src/CMakeLists.txt).
// Plain C++ types in, the Event's bytes out.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace dtrain::tensorboard {

// TensorBoard's HistogramProto.
struct Histogram {
  double min = 0, max = 0, num = 0, sum = 0, sum_squares = 0;
  std::vector<double> bucket_limit;  // right edges
  std::vector<double> bucket;        // counts
};

// The first record of every file: file_version "brain.Event:2", which TensorBoard checks.
std::string file_version_event(double wall_time);
// A scalar as PyTorch's add_scalar writes it: Summary.Value.simple_value (a float).
std::string scalar_event(const std::string& tag, float value, int64_t step, double wall_time);
std::string histogram_event(const std::string& tag, const Histogram& h, int64_t step, double wall_time);
// Text as PyTorch's add_text writes it: tag "<tag>/text_summary", a string tensor of shape [1] and
// plugin "text", which TensorBoard's text dashboard shows.
std::string text_event(const std::string& tag, const std::string& text, int64_t step, double wall_time);

}  // namespace dtrain::tensorboard
