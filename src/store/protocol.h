// Wire protocol and socket helpers shared by the store server and client (internal header).
//
// Every message, in both directions, is one frame:
//
//   u32 length (little-endian, bytes that follow) | payload
//
// Request payload:  u8 opcode | fields...      Response payload: u8 status | fields...
// A field is `u32 length | bytes`; integers (deltas, counts, timeouts) are 8-byte little-endian
// fields. One request is outstanding per connection: the client sends a frame and blocks until the
// response frame arrives (for GET/WAIT that is when the keys exist or the server-side timeout fires).
//
// A connection opens with a handshake (Note [Store handshake] in server.cpp): the server's first
// frame is HELLO, and the client's first request must be AUTH.
//
//   HELLO (server) status OK, magic "dtrain-store/1", auth(i64: 1 = a job secret is required), nonce
//   AUTH          client_nonce, client_mac          server_mac       (or status ERROR, then closed)
//
//   op            request fields                     OK response fields
//   SET           key, value                         -
//   GET           key, timeout_ms                    value            (or status TIMEOUT)
//   COMPARE_SET   key, expected, desired             value now stored
//   ADD           key, delta(i64)                    new value(i64)
//   CHECK         n(i64), key * n                    1 or 0 (i64)
//   DELETE        key                                1 or 0 (i64)
//   NUM_KEYS      -                                  count(i64)
//   WAIT          timeout_ms, n(i64), key * n        -                (or status TIMEOUT)
//
// timeout_ms == 0 means wait forever (c10d's kNoTimeout). Status ERROR carries one message field.
#pragma once

#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>

#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace dtrain::store::detail {

enum class Op : uint8_t { kSet = 1, kGet, kCompareSet, kAdd, kCheck, kDelete, kNumKeys, kWait, kAuth };
enum class Status : uint8_t { kOk = 0, kTimeout = 1, kError = 2 };

constexpr const char* kMagic = "dtrain-store/1";

// What one client can make the server hold. PyTorch's libuv store caps keys at 8 KiB and payloads
// at 8 MiB; values here may be larger (a few MiB of Gloo or NCCL addresses on big jobs, with room).
constexpr size_t kMaxKeyBytes = 8 << 10;
constexpr size_t kMaxValueBytes = 64 << 20;
constexpr size_t kMaxStoredBytes = size_t{2} << 30;  // keys and values together
constexpr int64_t kMaxKeysPerRequest = 1 << 16;      // CHECK, WAIT
// A frame holds at most a COMPARE_SET of two values; a longer length is a corrupt or hostile peer.
constexpr uint32_t kMaxFrameBytes = 2 * kMaxValueBytes + 2 * kMaxKeyBytes + 64;
constexpr uint32_t kMaxAuthFrameBytes = 256;  // before the handshake, nothing longer is read
constexpr size_t kNonceBytes = 32;

// Appends fields to a payload.
class Writer {
 public:
  explicit Writer(uint8_t head) { buf_.push_back(head); }
  Writer& bytes(const void* data, size_t n) {
    put_u32(static_cast<uint32_t>(n));
    const auto* p = static_cast<const uint8_t*>(data);
    buf_.insert(buf_.end(), p, p + n);
    return *this;
  }
  Writer& str(const std::string& s) { return bytes(s.data(), s.size()); }
  Writer& blob(const std::vector<uint8_t>& b) { return bytes(b.data(), b.size()); }
  Writer& i64(int64_t v) {
    uint8_t le[8];
    for (int i = 0; i < 8; ++i) le[i] = static_cast<uint8_t>(static_cast<uint64_t>(v) >> (8 * i));
    return bytes(le, 8);
  }
  // The complete frame: length prefix + payload.
  std::vector<uint8_t> frame() const {
    std::vector<uint8_t> out(4 + buf_.size());
    encode_u32(static_cast<uint32_t>(buf_.size()), out.data());
    std::memcpy(out.data() + 4, buf_.data(), buf_.size());  // buf_ always holds the head byte
    return out;
  }
  // The complete frame, appended to `out` without a copy of its own (a reply of a large value).
  void append_frame_to(std::vector<uint8_t>& out) const {
    uint8_t le[4];
    encode_u32(static_cast<uint32_t>(buf_.size()), le);
    out.insert(out.end(), le, le + 4);
    out.insert(out.end(), buf_.begin(), buf_.end());
  }
  static void encode_u32(uint32_t v, uint8_t* out) {
    for (int i = 0; i < 4; ++i) out[i] = static_cast<uint8_t>(v >> (8 * i));
  }

 private:
  void put_u32(uint32_t v) {
    uint8_t le[4];
    encode_u32(v, le);
    buf_.insert(buf_.end(), le, le + 4);
  }
  std::vector<uint8_t> buf_;
};

inline uint32_t decode_u32(const uint8_t* p) {
  return uint32_t(p[0]) | uint32_t(p[1]) << 8 | uint32_t(p[2]) << 16 | uint32_t(p[3]) << 24;
}

// Reads fields from a payload; throws std::runtime_error on a malformed payload.
class Reader {
 public:
  Reader(const uint8_t* data, size_t n) : p_(data), end_(data + n) {}
  uint8_t head() {
    need(1);
    return *p_++;
  }
  std::vector<uint8_t> blob() {
    need(4);
    uint32_t n = decode_u32(p_);
    p_ += 4;
    need(n);
    std::vector<uint8_t> out(p_, p_ + n);
    p_ += n;
    return out;
  }
  std::string str() {
    auto b = view();
    return std::string(b.begin(), b.end());
  }
  // A field without a copy: valid while the payload is.
  std::string_view view() {
    need(4);
    uint32_t n = decode_u32(p_);
    p_ += 4;
    need(n);
    std::string_view out(reinterpret_cast<const char*>(p_), n);
    p_ += n;
    return out;
  }
  // Whether every byte was read.
  bool done() const { return p_ == end_; }
  int64_t i64() {
    auto b = blob();
    if (b.size() != 8)
      throw std::runtime_error("malformed store message: integer field of size " + std::to_string(b.size()));
    uint64_t v = 0;
    for (int i = 0; i < 8; ++i) v |= uint64_t(b[i]) << (8 * i);
    return static_cast<int64_t>(v);
  }

 private:
  void need(size_t n) const {
    if (static_cast<size_t>(end_ - p_) < n) throw std::runtime_error("malformed store message");
  }
  const uint8_t* p_;
  const uint8_t* end_;
};

// TCP keepalive: a peer whose host is gone without a FIN (powered off, partitioned) is noticed
// within about 30 s (10 s idle, then 4 probes 5 s apart), well inside any group timeout.
inline void set_keepalive(int fd) {
  int on = 1, idle = 10, interval = 5, count = 4;
  setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &on, sizeof on);
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle, sizeof idle);
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &interval, sizeof interval);
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &count, sizeof count);
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &on, sizeof on);
}

// "host:port", with brackets around IPv6 literals: "[::1]:29500".
inline std::string host_port(const std::string& host, uint16_t port) {
  if (host.find(':') != std::string::npos) return "[" + host + "]:" + std::to_string(port);
  return host + ":" + std::to_string(port);
}

}  // namespace dtrain::store::detail
