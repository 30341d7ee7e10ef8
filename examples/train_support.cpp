#include "train_support.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>

#include <CLI/CLI.hpp>

#include <openssl/evp.h>

#include "dtrain/errors.h"

namespace train {

namespace {

std::string errno_text() { return std::strerror(errno); }

const char* allowed_text(Allowed allowed) {
  switch (allowed) {
    case Allowed::kInteger:
      return "an integer";
    case Allowed::kPositiveInteger:
      return "a positive integer";
    case Allowed::kNonNegativeInteger:
      return "an integer >= 0";
    case Allowed::kPositiveNumber:
      return "a number > 0";
    case Allowed::kNonNegativeNumber:
      return "a number >= 0";
  }
  return "a number";
}

bool is_integer(Allowed allowed) {
  return allowed == Allowed::kInteger || allowed == Allowed::kPositiveInteger ||
         allowed == Allowed::kNonNegativeInteger;
}

// The whole of `s` as a number of the allowed kind (decimal integers; finite numbers), in range.
bool parse_number(const std::string& s, Allowed allowed, int64_t* integer, double* number) {
  if (s.empty()) return false;
  char* end = nullptr;
  errno = 0;
  if (is_integer(allowed)) {
    const long long v = std::strtoll(s.c_str(), &end, 10);
    if (errno != 0 || *end != '\0') return false;
    *integer = v;
    return allowed == Allowed::kInteger || v > 0 || (v == 0 && allowed == Allowed::kNonNegativeInteger);
  }
  const double v = std::strtod(s.c_str(), &end);
  if (errno != 0 || *end != '\0' || !std::isfinite(v)) return false;
  *number = v;
  return v > 0 || (v == 0 && allowed == Allowed::kNonNegativeNumber);
}

// The default as --help shows it (1e-3 as 0.001, not 0.001000).
std::string number_text(double v) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%g", v);
  return buf;
}

}  // namespace

// --- flags -----------------------------------------------------------------------------------------

NumericFlags::Flag& NumericFlags::add_text(const std::string& name, const std::string& default_text, Allowed allowed,
                                           const std::string& help) {
  Flag& f = flags_.emplace_back();
  f.text = default_text;
  f.allowed = allowed;
  f.option =
      app_.add_option(name, f.text, help)->type_name(is_integer(allowed) ? "INT" : "FLOAT")->default_str(default_text);
  return f;
}

void NumericFlags::add(const std::string& name, int64_t& value, Allowed allowed, const std::string& help) {
  add_text(name, std::to_string(value), allowed, help).integer = &value;
}

void NumericFlags::add(const std::string& name, double& value, Allowed allowed, const std::string& help) {
  add_text(name, number_text(value), allowed, help).number = &value;
}

std::optional<int> NumericFlags::parse(int argc, char** argv, const std::string& program) {
  try {
    app_.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) return app_.exit(e);  // --help
    std::string what = e.what();  // CLI11's own errors (an unknown flag, a missing value): one line too
    std::replace(what.begin(), what.end(), '\n', ' ');
    std::fprintf(stderr, "%s: error: %s (see --help)\n", program.c_str(), what.c_str());
    return 1;
  }
  for (const Flag& f : flags_) {
    if (f.option->count() == 0) continue;  // not given: the default stays
    int64_t integer = 0;
    double number = 0;
    if (!parse_number(f.text, f.allowed, &integer, &number)) {
      std::fprintf(stderr, "%s: error: %s must be %s, got '%s'\n", program.c_str(), f.option->get_name().c_str(),
                   allowed_text(f.allowed), f.text.c_str());
      return 1;
    }
    if (f.integer) *f.integer = integer;
    if (f.number) *f.number = number;
  }
  return std::nullopt;
}

// --- parameters ------------------------------------------------------------------------------------

std::string parameter_bytes(const std::vector<at::Tensor>& params) {
  std::string out;
  for (const auto& p : params) {
    const at::Tensor t = p.detach().to(at::kCPU, at::kFloat).contiguous();
    out.append(static_cast<const char*>(t.data_ptr()), t.numel() * sizeof(float));
  }
  return out;
}

std::string sha256_hex(const std::string& bytes) {
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  DTRAIN_CHECK(EVP_Digest(bytes.data(), bytes.size(), digest, &len, EVP_sha256(), nullptr) == 1,
               "OpenSSL EVP_Digest(sha256) failed");
  static const char* kHex = "0123456789abcdef";
  std::string hex;
  for (unsigned int i = 0; i < len; ++i) {
    hex += kHex[digest[i] >> 4];
    hex += kHex[digest[i] & 15];
  }
  return hex;
}

void write_file(const std::string& path, const std::string& bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  DTRAIN_CHECK(f, "cannot create ", path, ": ", errno_text());
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  f.close();
  DTRAIN_CHECK(f, "cannot write ", path, ": ", errno_text());
}

}  // namespace train
