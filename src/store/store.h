// Torch-free key-value rendezvous store: a server bound to ONE address and a blocking client.
//
// Used by the launcher (dtrain-run hosts the store on node 0) and by the library (rank 0 hosts it
// when no launcher does; every rank talks to it through comm/store_adapter, a c10d::Store).
//
// Note [Why our own store]: LibTorch 1.13's c10d::TCPStore listens on all interfaces and has no
// option against it. dtrain's rendezvous listens only on the master address (loopback for
// single-node runs), see README "Trust model".
//
// Semantics follow c10d::Store: get() and wait() block until the keys exist or the timeout passes;
// add() creates the key at 0; compare_set() sets `desired` when the current value equals
// `expected` (or the key is absent and `expected` is empty) and returns the value now stored.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace dtrain::store {

using Bytes = std::vector<uint8_t>;
using Millis = std::chrono::milliseconds;

// Thrown when a wait/get outlives its timeout. The message names the keys and the timeout.
struct TimeoutError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Serves the store on host:port from a background thread. port 0 picks a free port.
// Throws std::runtime_error with a one-line message naming host:port when the address
// cannot be bound (e.g. "port 29500 on 127.0.0.1 is already in use").
class StoreServer {
 public:
  StoreServer(const std::string& host, uint16_t port);
  ~StoreServer();  // stops the thread, closes every socket
  StoreServer(const StoreServer&) = delete;
  StoreServer& operator=(const StoreServer&) = delete;
  uint16_t port() const;
  const std::string& host() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// One blocking connection to a StoreServer. Not thread-safe: one caller at a time
// (the c10d adapter serializes with a mutex).
class StoreClient {
 public:
  // Connects, retrying refused connections until connect_timeout; then throws
  // std::runtime_error "cannot reach the rendezvous at HOST:PORT within Ns: <reason>".
  StoreClient(const std::string& host, uint16_t port, Millis connect_timeout);
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

  // The local IP address of this connection: the interface that routes to the master.
  // Ranks bind their Gloo device to it.
  std::string local_address() const;
  const std::string& host() const;
  uint16_t port() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Helpers for string values.
inline Bytes to_bytes(const std::string& s) { return Bytes(s.begin(), s.end()); }
inline std::string to_string(const Bytes& b) { return std::string(b.begin(), b.end()); }

}  // namespace dtrain::store
