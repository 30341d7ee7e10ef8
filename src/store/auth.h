// The job secret and the store's handshake digests (internal header; see Note [Store handshake]
// in server.cpp). HMAC-SHA256 from OpenSSL's libcrypto.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace dtrain::store::detail {

// n bytes from the kernel's random source (getrandom); throws when it fails.
std::vector<uint8_t> random_bytes(size_t n);

// HMAC-SHA256 keyed by `secret` over `role` | server_nonce | client_nonce: what a side sends to
// prove it knows the secret for this connection alone, the secret itself never on the wire.
std::vector<uint8_t> handshake_mac(const std::string& secret, const char* role,
                                   const std::vector<uint8_t>& server_nonce, const std::vector<uint8_t>& client_nonce);

// Equality in time that does not depend on where the two differ.
bool same_digest(const std::vector<uint8_t>& a, const std::vector<uint8_t>& b);

constexpr const char* kClientRole = "dtrain-store client";
constexpr const char* kServerRole = "dtrain-store server";

}  // namespace dtrain::store::detail
