// Torch-free key-value rendezvous store: a server bound to ONE address and a blocking client.
//
// Used by the launcher (dtrain-run hosts the store on node 0) and by the library (rank 0 hosts it
// when no launcher does; every rank talks to it through comm/store_adapter, a c10d::Store).
//
// Note [Why our own store]: LibTorch 1.13's c10d::TCPStore listens on all interfaces and has no
// option against it. dtrain's rendezvous listens only on the master address (loopback for
// single-node runs), see SECURITY.md.
//
// Semantics follow c10d::Store: get() and wait() block until the keys exist or the timeout passes;
// add() creates the key at 0; compare_set() sets `desired` when the current value equals
// `expected` (or the key is absent and `expected` is empty) and returns the value now stored.
//
// A job secret closes the store: a server given one serves only clients that prove they know it
// (HMAC-SHA256 challenge-response, the secret never sent), and a client given one talks only to a
// server that proves it too. dtrain-run makes one per job and hands it to its workers in
// DTRAIN_JOB_SECRET. Without one on both sides the store is open, as PyTorch's TCPStore is.
//
//   StoreServer server("127.0.0.1", 0, secret);
//   StoreClient client("127.0.0.1", server.port(), std::chrono::seconds(30), secret);
//   client.set("k", to_bytes("v"));
//
// Limits (protocol.h, ServerLimits): keys of 8 KiB, values of 64 MiB, 2^20 keys; a connection that
// sends a frame slower than 60 s, no handshake within 5 s, or reads none of its replies for 60 s is
// closed; a connection whose replies do not drain is read no further until they do; connections in
// the handshake have a budget of their own, and everything the store holds shares one memory budget
// (see Note [Store budgets] in server_guard.cpp).
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

struct addrinfo;

namespace dtrain::store {

using Bytes = std::vector<uint8_t>;
using Millis = std::chrono::milliseconds;

// Thrown when a wait/get outlives its timeout. The message names the keys and the timeout.
struct TimeoutError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// The environment variable that carries a job's secret to its processes.
constexpr const char* kSecretEnv = "DTRAIN_JOB_SECRET";
constexpr size_t kMinSecretBytes = 32;

// A fresh random secret: 32 bytes from the kernel, as 64 hex digits.
std::string new_job_secret();
// `secret` when it can be a job secret (at least kMinSecretBytes, one line); else throws one line
// that names `from` (where it came from) and how to make one.
std::string check_job_secret(const std::string& secret, const std::string& from);

// The addresses of host:port (getaddrinfo's list). A name that does not resolve yet is asked again
// until `timeout` (Note [Names that resolve late] in resolve.cpp): `waiting` gets one line the first
// time. A name still unknown at the timeout, or one that fails otherwise, throws std::runtime_error
// naming it and `source` (where the name came from, e.g. "--master_addr").
struct AddrInfoDeleter {
  void operator()(addrinfo* a) const;
};
using AddrInfoPtr = std::unique_ptr<addrinfo, AddrInfoDeleter>;
AddrInfoPtr resolve_waiting(const std::string& host, uint16_t port, Millis timeout, const std::string& source,
                            const std::function<void(const std::string&)>& waiting);

// What the server allows in time and count; the defaults are the store's (tests lower them).
// How a peer without the secret is kept from using them: see Note [Store budgets] in server_guard.cpp.
struct ServerLimits {
  Millis handshake_timeout{5000};            // from accept to a proven secret (or, open, to the client's AUTH)
  Millis frame_timeout{60000};               // from a frame's first byte to its last
  Millis unread_reply_timeout{60000};        // replies queued for a client that reads none of them
  size_t max_connections = 0;                // authenticated ones; 0: what RLIMIT_NOFILE leaves room for, at most 16384
  size_t max_unauthenticated = 64;           // connections in the handshake: past it, the oldest is closed
  size_t max_unauthenticated_per_peer = 16;  // of them from one address: past it, its oldest out of its grace
  size_t memory_budget = 0;                  // bytes stored, queued and half-received, together; 0: 3 GiB
  size_t max_keys = size_t{1} << 20;
};

// Serves the store on host:port from a background thread. port 0 picks a free port. A non-empty
// `secret` requires it of every client. Throws std::runtime_error with a one-line message naming
// host:port when the address cannot be bound (e.g. "port 29500 on 127.0.0.1 is already in use").
class StoreServer {
 public:
  StoreServer(const std::string& host, uint16_t port, std::string secret = "", ServerLimits limits = {});
  ~StoreServer();  // stops the thread, closes every socket
  StoreServer(const StoreServer&) = delete;
  StoreServer& operator=(const StoreServer&) = delete;
  uint16_t port() const;
  const std::string& host() const;
  // Connections refused for not proving the secret (a wrong one, none, or no handshake in time).
  uint64_t rejected_connections() const;
  // Connections open now (test and diagnostics).
  size_t connections() const;
  // Bytes the store holds for its keys and its connections' buffers, as its memory budget counts
  // them, at the end of the last poll round (test and diagnostics).
  size_t held_bytes() const;
  // Connections whose unsent replies passed the high-water mark at the last poll round, so that
  // their requests are read no further until they drain (test and diagnostics).
  size_t throttled_connections() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// One blocking connection to a StoreServer. Not thread-safe: one caller at a time
// (the c10d adapter serializes with a mutex).
class StoreClient {
 public:
  // Connects, retrying refused connections until connect_timeout; then throws
  // std::runtime_error "cannot reach the rendezvous at HOST:PORT within Ns: <reason>". Then the
  // handshake: with a `secret`, the server must require and prove the same one; without, it must
  // require none. Either failing is one std::runtime_error line naming the store.
  // Every later call has a deadline: connect_timeout for a request, a GET's or WAIT's own timeout
  // plus a few seconds for those; a store that does not answer by then (its host stopped, or gone
  // without a FIN, which TCP keepalive notices) is a TimeoutError, and the connection is closed.
  // A `reply_timeout` > 0 bounds the handshake instead (a store host that accepts the connection but
  // is stopped answers nothing) and becomes the deadline of later requests (set_timeout): the
  // launcher's rendezvous, whose connect waits for node 0 but whose requests must be answered soon.
  StoreClient(const std::string& host, uint16_t port, Millis connect_timeout, std::string secret = "",
              Millis reply_timeout = Millis(0));
  ~StoreClient();
  StoreClient(const StoreClient&) = delete;
  StoreClient& operator=(const StoreClient&) = delete;

  void set(const std::string& key, const Bytes& value);
  Bytes get(const std::string& key, Millis timeout);  // waits for the key
  Bytes compare_set(const std::string& key, const Bytes& expected, const Bytes& desired);
  int64_t add(const std::string& key, int64_t delta);
  bool check(const std::vector<std::string>& keys);
  bool delete_key(const std::string& key);
  int64_t num_keys();
  void wait(const std::vector<std::string>& keys, Millis timeout);  // throws TimeoutError

  // The deadline of a request other than a GET's or WAIT's (c10d::Store::setTimeout): at first the
  // connect_timeout. A launcher polling node 0's store while workers run shortens it, so that a
  // node 0 that stopped answering is noticed in seconds (ScopedTimeout).
  void set_timeout(Millis timeout);
  Millis timeout() const;

  // The local IP address of this connection: the interface that routes to the master.
  // Ranks bind their Gloo device to it.
  std::string local_address() const;
  const std::string& host() const;
  uint16_t port() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// A client's request deadline for one scope; the old one is put back when it ends.
//
//   { ScopedTimeout quick(client, std::chrono::seconds(3)); client.check({"k"}); }
class ScopedTimeout {
 public:
  ScopedTimeout(StoreClient& client, Millis timeout) : client_(client), old_(client.timeout()) {
    client_.set_timeout(timeout);
  }
  ~ScopedTimeout() { client_.set_timeout(old_); }
  ScopedTimeout(const ScopedTimeout&) = delete;
  ScopedTimeout& operator=(const ScopedTimeout&) = delete;

 private:
  StoreClient& client_;
  Millis old_;
};

// Helpers for string values.
inline Bytes to_bytes(const std::string& s) { return Bytes(s.begin(), s.end()); }
inline std::string to_string(const Bytes& b) { return std::string(b.begin(), b.end()); }
// Whether `s` is a decimal int64 (what add() stores) as std::stoll reads it, into *out; trailing
// text or a number out of range is false.
inline bool parse_integer(const std::string& s, int64_t* out) {
  size_t used = 0;
  try {
    *out = std::stoll(s, &used);
  } catch (const std::exception&) {
    return false;
  }
  return used != 0 && used == s.size();
}

}  // namespace dtrain::store
