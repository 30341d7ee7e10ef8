// The job secret and the handshake digests (see auth.h and store.h).
#include "store/auth.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <sys/random.h>

#include <cerrno>
#include <cstring>
#include <stdexcept>

#include "store/store.h"

namespace dtrain::store {
namespace detail {

std::vector<uint8_t> random_bytes(size_t n) {
  std::vector<uint8_t> out(n);
  size_t got = 0;
  while (got < n) {
    const ssize_t r = getrandom(out.data() + got, n - got, 0);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) throw std::runtime_error(std::string("getrandom failed: ") + std::strerror(errno));
    got += static_cast<size_t>(r);
  }
  return out;
}

std::vector<uint8_t> handshake_mac(const std::string& secret, const char* role,
                                   const std::vector<uint8_t>& server_nonce, const std::vector<uint8_t>& client_nonce) {
  std::vector<uint8_t> msg(role, role + std::strlen(role) + 1);  // with its NUL: roles never run together
  msg.insert(msg.end(), server_nonce.begin(), server_nonce.end());
  msg.insert(msg.end(), client_nonce.begin(), client_nonce.end());
  std::vector<uint8_t> out(EVP_MAX_MD_SIZE);
  unsigned int len = 0;
  if (!HMAC(EVP_sha256(), secret.data(), static_cast<int>(secret.size()), msg.data(), msg.size(), out.data(), &len))
    throw std::runtime_error("HMAC-SHA256 failed (OpenSSL)");
  out.resize(len);
  return out;
}

bool same_digest(const std::vector<uint8_t>& a, const std::vector<uint8_t>& b) {
  return a.size() == b.size() && CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0;
}

}  // namespace detail

std::string new_job_secret() {
  static const char* hex = "0123456789abcdef";
  std::string out;
  for (uint8_t b : detail::random_bytes(kMinSecretBytes)) {
    out += hex[b >> 4];
    out += hex[b & 15];
  }
  return out;
}

std::string check_job_secret(const std::string& secret, const std::string& from) {
  if (secret.size() < kMinSecretBytes)
    throw std::runtime_error(from + " holds " + std::to_string(secret.size()) + " bytes: a job secret has at least " +
                             std::to_string(kMinSecretBytes) +
                             " (make one with: head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \\n')");
  if (secret.find('\0') != std::string::npos || secret.find('\n') != std::string::npos)
    throw std::runtime_error(from + " holds a NUL or a line break: a job secret is one line of text");
  return secret;
}

}  // namespace dtrain::store
