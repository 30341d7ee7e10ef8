// ClientStore: a c10d::Store over dtrain's own rendezvous client (src/store), so Gloo, NCCL and
// PrefixStore use the store that binds to one address. Thread-safe (one request at a time).
// `secret` is the job's (DTRAIN_JOB_SECRET), or "" for an open store (store.h).
#pragma once

#include <memory>
#include <mutex>

#include <torch/csrc/distributed/c10d/Store.hpp>

#include "compat/c10d_compat.h"
#include "store/store.h"

namespace dtrain::comm {

class ClientStore : public c10d::Store {
 public:
  ClientStore(const std::string& host, uint16_t port, std::chrono::milliseconds timeout, std::string secret);

  void set(const std::string& key, const std::vector<uint8_t>& value) override;
  std::vector<uint8_t> compareSet(const std::string& key, const std::vector<uint8_t>& expected,
                                  const std::vector<uint8_t>& desired) override;
  std::vector<uint8_t> get(const std::string& key) override;
  int64_t add(const std::string& key, int64_t value) override;
  bool deleteKey(const std::string& key) override;
  bool check(const std::vector<std::string>& keys) override;
  int64_t getNumKeys() override;
  void wait(const std::vector<std::string>& keys) override;
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) override;

#if DTRAIN_C10D_STORE_CLONE
  // A second connection to the same store, for another thread.
  c10::intrusive_ptr<c10d::Store> clone() override;
#endif

  std::string local_address() const { return client_.local_address(); }

 private:
  std::mutex mu_;
  std::string secret_;
  dtrain::store::StoreClient client_;
};

}  // namespace dtrain::comm
