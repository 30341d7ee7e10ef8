// Helpers of examples/train_fashion_mnist.cpp that are not about training itself: a fingerprint of
// the parameters (progress and metrics are dtrain::Monitor's, dtrain/monitor.h; checkpoints are the
// library's, dtrain/checkpoint.h).
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

namespace train {

// The raw bytes of every parameter in order (float32 contiguous, host byte order): what --dump_params
// writes and what params_sha256 hashes.
std::string parameter_bytes(const std::vector<at::Tensor>& params);
// Lower-case hex SHA-256 of `bytes` (OpenSSL's libcrypto); empty when built without OpenSSL.
std::string sha256_hex(const std::string& bytes);
// Writes `bytes` to `path` (throws dtrain::Error naming the path on failure).
void write_file(const std::string& path, const std::string& bytes);

}  // namespace train
