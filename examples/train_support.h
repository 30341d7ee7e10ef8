// Helpers of examples/train_fashion_mnist.cpp that are not about training itself: the numeric flags'
// checks and a fingerprint of the parameters (progress and metrics are dtrain::Monitor's,
// dtrain/monitor.h; checkpoints are the library's, dtrain/checkpoint.h).
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

namespace CLI {
class App;
class Option;
}  // namespace CLI

namespace train {

// The values a numeric flag allows.
enum class Allowed { kInteger, kPositiveInteger, kNonNegativeInteger, kPositiveNumber, kNonNegativeNumber };

// Numeric flags that the trainer checks itself. CLI11's PositiveNumber / NonNegativeNumber print their
// upper bound in full on a bad value (DBL_MAX: 310 digits) and its conversion errors do not say what is
// allowed. Each flag is read as text instead and checked after CLI11 parsed the command line, so every
// bad value fails with one line naming the flag, the value and what is allowed:
//   train_fashion_mnist: error: --batch_size must be a positive integer, got '0'
class NumericFlags {
 public:
  explicit NumericFlags(CLI::App& app) : app_(app) {}
  // Adds `name` to the app; `value` holds the default (shown by --help) and, after parse(), the value given.
  void add(const std::string& name, int64_t& value, Allowed allowed, const std::string& help);
  void add(const std::string& name, double& value, Allowed allowed, const std::string& help);
  // Parses the command line into the app's options and these flags' values. Returns std::nullopt to go
  // on, else the exit code after printing the help (0) or one line "<program>: error: ..." (1).
  std::optional<int> parse(int argc, char** argv, const std::string& program);

 private:
  struct Flag {
    std::string text;  // CLI11 writes the flag's argument here
    const CLI::Option* option = nullptr;
    int64_t* integer = nullptr;
    double* number = nullptr;
    Allowed allowed = Allowed::kInteger;
  };
  Flag& add_text(const std::string& name, const std::string& default_text, Allowed allowed, const std::string& help);
  CLI::App& app_;
  std::deque<Flag> flags_;  // a deque: CLI11 keeps pointers to each text
};

// The raw bytes of every parameter in order (float32 contiguous, host byte order): what --dump_params
// writes and what params_sha256 hashes.
std::string parameter_bytes(const std::vector<at::Tensor>& params);
// Lower-case hex SHA-256 of `bytes` (OpenSSL's libcrypto, which examples/CMakeLists.txt requires).
std::string sha256_hex(const std::string& bytes);
// Writes `bytes` to `path` (throws dtrain::Error naming the path on failure).
void write_file(const std::string& path, const std::string& bytes);

}  // namespace train
