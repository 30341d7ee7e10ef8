// Helpers of examples/train_fashion_mnist.cpp that are not about training itself (progress and metrics
// are dtrain::Monitor's: dtrain/monitor.h): an atomically written checkpoint, and a fingerprint of the parameters.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

namespace torch::optim {
class Optimizer;
}
namespace torch::nn {
class Module;
}

namespace train {

// Writes model (under "model") and optimizer (under "optimizer") into one torch::serialize archive at
// `path`, atomically: the bytes go to a temporary file in the same folder, which is fsync'ed and then
// renamed over `path`, so a crash never leaves a half-written checkpoint. Load it with
//   torch::serialize::InputArchive a; a.load_from(path);
//   torch::serialize::InputArchive m, o; a.read("model", m); a.read("optimizer", o);
//   model->load(m); optimizer.load(o);
// Throws dtrain::Error naming the path on failure.
void save_checkpoint(const std::string& path, const torch::nn::Module& model, const torch::optim::Optimizer& opt,
                     int64_t epoch);

// The raw bytes of every parameter in order (float32 contiguous, host byte order): what --dump_params
// writes and what params_sha256 hashes.
std::string parameter_bytes(const std::vector<at::Tensor>& params);
// Lower-case hex SHA-256 of `bytes` (OpenSSL's libcrypto); empty when built without OpenSSL.
std::string sha256_hex(const std::string& bytes);
// Writes `bytes` to `path` (throws dtrain::Error naming the path on failure).
void write_file(const std::string& path, const std::string& bytes);

}  // namespace train
