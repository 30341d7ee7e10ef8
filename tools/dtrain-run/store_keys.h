// What the node rendezvous (rendezvous.cpp) and elastic membership (elastic.cpp) share about the
// store: its byte conversions, the clock their deadlines use, and key names under a prefix.
#pragma once

#include "store/store.h"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>

namespace dtrain::run {

using dtrain::store::to_bytes;
using dtrain::store::to_string;
using Clock = std::chrono::steady_clock;
using Millis = std::chrono::milliseconds;

// Keys under one prefix, numbered per node, arrival or attempt:
//   StoreKeys keys("dtrain-run/");  keys("arrivals") == "dtrain-run/arrivals",
//   keys("outcome", 2, 1) == "dtrain-run/outcome/2/1".
class StoreKeys {
 public:
  explicit StoreKeys(std::string prefix) : prefix_(std::move(prefix)) {}
  std::string operator()(const std::string& name) const { return prefix_ + name; }
  std::string operator()(const std::string& name, int64_t n) const { return prefix_ + name + "/" + std::to_string(n); }
  std::string operator()(const std::string& name, int64_t n, int64_t m) const {
    return (*this)(name, n) + "/" + std::to_string(m);
  }

 private:
  std::string prefix_;
};

// The integer a store key holds. Anyone who reaches an open store can write its keys: a value that
// is not an integer is an error naming the key and the value, never std::stoll's bare "stoll".
inline int64_t int_value(const std::string& key, const std::string& value) {
  int64_t v = 0;
  if (!dtrain::store::parse_integer(value, &v))
    throw std::runtime_error("the rendezvous store's key '" + key + "' holds '" + value.substr(0, 64) +
                             "', not an integer: another process wrote it (give the job a secret to keep others out)");
  return v;
}

// Waits up to `timeout` for `key` and returns its value (nothing at the timeout), asking with check()
// every `every`: each request has the client's own deadline (--rdzv_conf read_timeout), so a store
// that stops answering throws TimeoutError within that deadline instead of after `timeout`, and a
// TimeoutError from here always means no answer, never a key that did not come. 5 requests a second
// per waiting node (torchrun's c10d rendezvous syncs about once a second) keep node 0's store light
// while every node of a large job waits for its verdict.
inline std::optional<std::string> poll_key(dtrain::store::StoreClient& store, const std::string& key, Millis timeout,
                                           Millis every = Millis(200)) {
  const auto deadline = Clock::now() + timeout;
  for (;;) {
    if (store.check({key})) return to_string(store.get(key, Millis(10000)));
    const auto now = Clock::now();
    if (now >= deadline) return std::nullopt;
    std::this_thread::sleep_for(std::min(every, std::chrono::ceil<Millis>(deadline - now)));
  }
}

// Appends `line` and a newline to the list at `key` in one compare-and-set, retried while another
// writer comes first: a reader sees the line whole or not at all, whenever this process dies.
inline void append_line(dtrain::store::StoreClient& store, const std::string& key, const std::string& line) {
  std::string now = store.check({key}) ? to_string(store.get(key, Millis(10000))) : "";
  for (;;) {
    const std::string want = now + line + "\n";
    const std::string got = to_string(store.compare_set(key, to_bytes(now), to_bytes(want)));
    if (got == want) return;
    now = got;  // another node appended first (or, absent key, the store answered `expected`)
    if (!store.check({key})) now.clear();
  }
}

}  // namespace dtrain::run
