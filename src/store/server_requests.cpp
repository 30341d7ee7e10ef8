// StoreServer's operations (protocol.h), with the limits in size that keep one client from making
// the server hold without bound (see server_impl.h).
#include <algorithm>
#include <string>

#include "store/server_impl.h"

namespace dtrain::store {

using namespace detail;

namespace {

// A key as an error shows it: its first 64 bytes.
std::string shown(std::string_view key) {
  return "'" + std::string(key.substr(0, 64)) + (key.size() > 64 ? "...'" : "'");
}

void check_key(std::string_view key) {
  if (key.size() > kMaxKeyBytes)
    throw std::runtime_error("a key of " + std::to_string(key.size()) + " bytes (" + shown(key) +
                             "): the store takes keys of at most " + std::to_string(kMaxKeyBytes));
}

int64_t key_count(Reader& r) {
  const int64_t n = r.i64();
  if (n < 0 || n > kMaxKeysPerRequest)
    throw std::runtime_error("a request for " + std::to_string(n) + " keys: the store takes 0 to " +
                             std::to_string(kMaxKeysPerRequest) + " in one");
  return n;
}

KeyList read_keys(Reader& r, int64_t n) {
  KeyList keys;
  for (int64_t i = 0; i < n; ++i) {
    const std::string_view k = r.view();
    check_key(k);
    keys.add(k);
  }
  return keys;
}

}  // namespace

bool StoreServer::Impl::all_present(const KeyList& keys) const {
  for (size_t i = 0; i < keys.size(); ++i)
    if (data.find(keys[i]) == data.end()) return false;
  return true;
}

void StoreServer::Impl::put(const std::string& key, Bytes value) {
  check_key(key);
  if (value.size() > kMaxValueBytes)
    throw std::runtime_error("a value of " + std::to_string(value.size()) + " bytes for key " + shown(key) +
                             ": the store takes values of at most " + std::to_string(kMaxValueBytes));
  auto it = data.find(key);
  const size_t before = it == data.end() ? 0 : key.size() + it->second.size();
  if (it == data.end() && data.size() >= limits.max_keys)
    throw std::runtime_error("the store holds " + std::to_string(data.size()) + " keys, its limit: key " + shown(key) +
                             " was not added (delete keys the job no longer needs)");
  const size_t after = stored_bytes - before + key.size() + value.size();
  if (after > kMaxStoredBytes)
    throw std::runtime_error("key " + shown(key) + " would make the store hold " + std::to_string(after) +
                             " bytes, over its limit of " + std::to_string(kMaxStoredBytes));
  if (after + buffered > limits.memory_budget)
    throw std::runtime_error("key " + shown(key) + " would take the store past its memory budget of " +
                             std::to_string(limits.memory_budget >> 20) + " MiB (what it stores and what its " +
                             "connections hold): delete keys the job no longer needs");
  stored_bytes = after;
  if (it == data.end())
    data.emplace(key, std::move(value));
  else
    it->second = std::move(value);
  changed = true;
}

void StoreServer::Impl::handle(Connection& c, Reader& r) {
  const Op op = static_cast<Op>(r.head());
  Writer ok{uint8_t(Status::kOk)};
  switch (op) {
    case Op::kSet: {
      std::string key = r.str();
      put(key, r.blob());
      reply(c, ok);
      return;
    }
    case Op::kGet:
    case Op::kWait: {
      Waiter w{c.fd, op, {}, false, {}};
      if (op == Op::kGet) w.keys = read_keys(r, 1);
      const int64_t timeout_ms = r.i64();
      if (op == Op::kWait) w.keys = read_keys(r, key_count(r));
      if (all_present(w.keys)) {
        if (op == Op::kGet) ok.blob(data.find(w.keys[0])->second);
        reply(c, ok);
        return;
      }
      w.has_deadline = timeout_ms > 0;
      // Capped at about 30 years: a larger timeout is forever, never a deadline that overflows.
      w.deadline = Clock::now() + std::chrono::milliseconds(std::min<int64_t>(timeout_ms, int64_t{1} << 40));
      c.waiting = true;
      waiters.push_back(std::move(w));
      return;
    }
    case Op::kCompareSet: {
      std::string key = r.str();
      Bytes expected = r.blob(), desired = r.blob();
      auto it = data.find(key);
      if (it == data.end()) {
        if (expected.empty()) {
          put(key, desired);
          reply(c, ok.blob(desired));
        } else {
          reply(c, ok.blob(expected));  // c10d semantics: absent key, non-empty expected
        }
      } else {
        if (it->second == expected) put(key, std::move(desired));
        reply(c, ok.blob(data.find(key)->second));
      }
      return;
    }
    case Op::kAdd: {
      std::string key = r.str();
      const int64_t delta = r.i64();
      int64_t value = 0;
      auto it = data.find(key);
      if (it != data.end()) {
        const std::string s = to_string(it->second);
        if (!parse_integer(s, &value))
          throw std::runtime_error("add(): key " + shown(key) + " holds '" + s.substr(0, 64) + "', not an integer");
      }
      // Wraps as two's complement, never undefined: a hostile delta cannot crash the server.
      value = static_cast<int64_t>(static_cast<uint64_t>(value) + static_cast<uint64_t>(delta));
      put(key, to_bytes(std::to_string(value)));
      reply(c, ok.i64(value));
      return;
    }
    case Op::kCheck: {
      const KeyList keys = read_keys(r, key_count(r));
      reply(c, ok.i64(all_present(keys) ? 1 : 0));
      return;
    }
    case Op::kDelete: {
      const std::string key = r.str();
      auto it = data.find(key);
      const bool found = it != data.end();
      if (found) {
        stored_bytes -= key.size() + it->second.size();
        data.erase(it);
      }
      reply(c, ok.i64(found ? 1 : 0));
      return;
    }
    case Op::kNumKeys:
      reply(c, ok.i64(static_cast<int64_t>(data.size())));
      return;
    case Op::kAuth:
      break;
  }
  throw std::runtime_error("unknown store request " + std::to_string(int(op)));
}

void StoreServer::Impl::answer_ready_waiters() {
  for (auto it = waiters.begin(); it != waiters.end();) {
    if (!all_present(it->keys)) {
      ++it;
      continue;
    }
    auto c = conns.find(it->fd);
    if (c != conns.end()) {
      Writer ok{uint8_t(Status::kOk)};
      if (it->op == Op::kGet) ok.blob(data.find(it->keys[0])->second);
      c->second.waiting = false;
      reply(c->second, ok);
      ready.push_back(it->fd);  // it may have pipelined more requests
    }
    it = waiters.erase(it);
  }
}

}  // namespace dtrain::store
