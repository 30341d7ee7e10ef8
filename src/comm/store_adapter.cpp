#include "comm/store_adapter.h"

namespace dtrain::comm {

ClientStore::ClientStore(const std::string& host, uint16_t port, std::chrono::milliseconds timeout, std::string secret)
    : c10d::Store(timeout), secret_(std::move(secret)), client_(host, port, timeout, secret_) {}

#if DTRAIN_C10D_STORE_CLONE
c10::intrusive_ptr<c10d::Store> ClientStore::clone() {
  return c10::make_intrusive<ClientStore>(client_.host(), client_.port(), timeout_, secret_);
}
#endif

void ClientStore::set(const std::string& key, const std::vector<uint8_t>& value) {
  std::lock_guard<std::mutex> g(mu_);
  client_.set(key, value);
}

std::vector<uint8_t> ClientStore::compareSet(const std::string& key, const std::vector<uint8_t>& expected,
                                             const std::vector<uint8_t>& desired) {
  std::lock_guard<std::mutex> g(mu_);
  return client_.compare_set(key, expected, desired);
}

std::vector<uint8_t> ClientStore::get(const std::string& key) {
  std::lock_guard<std::mutex> g(mu_);
  return client_.get(key, timeout_);
}

int64_t ClientStore::add(const std::string& key, int64_t value) {
  std::lock_guard<std::mutex> g(mu_);
  return client_.add(key, value);
}

bool ClientStore::deleteKey(const std::string& key) {
  std::lock_guard<std::mutex> g(mu_);
  return client_.delete_key(key);
}

bool ClientStore::check(const std::vector<std::string>& keys) {
  std::lock_guard<std::mutex> g(mu_);
  return client_.check(keys);
}

int64_t ClientStore::getNumKeys() {
  std::lock_guard<std::mutex> g(mu_);
  return client_.num_keys();
}

void ClientStore::wait(const std::vector<std::string>& keys) { wait(keys, timeout_); }

void ClientStore::wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) {
  std::lock_guard<std::mutex> g(mu_);
  client_.wait(keys, timeout);
}

}  // namespace dtrain::comm
