#include "train_support.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>


#ifdef DTRAIN_HAVE_OPENSSL
#include <openssl/evp.h>
#endif

#include "dtrain/errors.h"

namespace train {

namespace {

std::string errno_text() { return std::strerror(errno); }

}  // namespace

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
#ifdef DTRAIN_HAVE_OPENSSL
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
#else
  (void)bytes;
  return "";
#endif
}

void write_file(const std::string& path, const std::string& bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  DTRAIN_CHECK(f, "cannot create ", path, ": ", errno_text());
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  f.close();
  DTRAIN_CHECK(f, "cannot write ", path, ": ", errno_text());
}

}  // namespace train
