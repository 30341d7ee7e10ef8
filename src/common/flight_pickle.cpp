// The pickle subset (see pickle.h). Opcodes and their encodings are those of CPython's
// Lib/pickletools.py; the writer uses protocol 2 without a memo (nothing is shared), which every
// Python 3 reads.
#include "common/flight_pickle.h"

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <map>
#include <stdexcept>
#include <vector>

namespace dtrain::flight::pickle {
namespace {

using json = nlohmann::json;

void put_u32(std::string& out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out += static_cast<char>((v >> (8 * i)) & 0xff);
}

void put_int(std::string& out, int64_t v) {
  if (v >= INT32_MIN && v <= INT32_MAX) {
    out += 'J';  // BININT: 4 bytes, little-endian, signed
    put_u32(out, static_cast<uint32_t>(static_cast<int32_t>(v)));
    return;
  }
  out += '\x8a';  // LONG1: n bytes, little-endian two's complement
  out += '\x08';
  for (int i = 0; i < 8; ++i) out += static_cast<char>((static_cast<uint64_t>(v) >> (8 * i)) & 0xff);
}

void put(std::string& out, const json& v) {
  switch (v.type()) {
    case json::value_t::null:
    case json::value_t::discarded:
      out += 'N';
      return;
    case json::value_t::boolean:
      out += v.get<bool>() ? '\x88' : '\x89';  // NEWTRUE, NEWFALSE
      return;
    case json::value_t::number_integer:
      put_int(out, v.get<int64_t>());
      return;
    case json::value_t::number_unsigned:
      put_int(out, static_cast<int64_t>(v.get<uint64_t>()));
      return;
    case json::value_t::number_float: {
      out += 'G';  // BINFLOAT: 8 bytes, big-endian
      const double d = v.get<double>();
      uint64_t bits;
      std::memcpy(&bits, &d, 8);
      for (int i = 7; i >= 0; --i) out += static_cast<char>((bits >> (8 * i)) & 0xff);
      return;
    }
    case json::value_t::string: {
      const auto& s = v.get_ref<const std::string&>();
      out += 'X';  // BINUNICODE: 4-byte length, UTF-8
      put_u32(out, static_cast<uint32_t>(s.size()));
      out += s;
      return;
    }
    case json::value_t::array:
      out += ']';  // EMPTY_LIST
      if (v.empty()) return;
      out += '(';  // MARK
      for (const auto& e : v) put(out, e);
      out += 'e';  // APPENDS
      return;
    case json::value_t::object:
      out += '}';  // EMPTY_DICT
      if (v.empty()) return;
      out += '(';
      for (auto it = v.begin(); it != v.end(); ++it) {
        put(out, it.key());
        put(out, it.value());
      }
      out += 'u';  // SETITEMS
      return;
    case json::value_t::binary:
      break;
  }
  throw std::runtime_error("pickle: cannot write a binary value");
}

// The reader: a stack machine over the opcodes above and their shorter or longer forms.
class Reader {
 public:
  explicit Reader(const std::string& b) : b_(b) {}

  json run() {
    for (;;) {
      const auto op = static_cast<unsigned char>(byte());
      if (op == '.') break;  // STOP
      step(op);
    }
    if (stack_.size() != 1)
      throw std::runtime_error("pickle: malformed data (stack holds " + std::to_string(stack_.size()) +
                               " values at STOP)");
    return std::move(stack_.back());
  }

 private:
  char byte() {
    if (pos_ >= b_.size()) throw std::runtime_error("pickle: the data is cut short");
    return b_[pos_++];
  }
  uint64_t le(int n) {
    if (pos_ + static_cast<size_t>(n) > b_.size()) throw std::runtime_error("pickle: the data is cut short");
    uint64_t v = 0;
    for (int i = 0; i < n; ++i) v |= static_cast<uint64_t>(static_cast<unsigned char>(b_[pos_ + i])) << (8 * i);
    pos_ += static_cast<size_t>(n);
    return v;
  }
  std::string take(uint64_t n) {
    if (n > b_.size() - pos_) throw std::runtime_error("pickle: the data is cut short");
    std::string s = b_.substr(pos_, n);
    pos_ += n;
    return s;
  }
  json pop() {
    if (stack_.empty() || is_mark_.back()) throw std::runtime_error("pickle: malformed data (empty stack)");
    json v = std::move(stack_.back());
    stack_.pop_back();
    is_mark_.pop_back();
    return v;
  }
  void push(json v) {
    stack_.push_back(std::move(v));
    is_mark_.push_back(false);
  }
  // The values above the last MARK, which is removed.
  std::vector<json> pop_mark() {
    size_t m = is_mark_.size();
    while (m > 0 && !is_mark_[m - 1]) --m;
    if (m == 0) throw std::runtime_error("pickle: malformed data (no MARK)");
    std::vector<json> items(std::make_move_iterator(stack_.begin() + static_cast<long>(m)),
                            std::make_move_iterator(stack_.end()));
    stack_.resize(m - 1);
    is_mark_.resize(m - 1);
    return items;
  }
  json& top() {
    if (stack_.empty() || is_mark_.back()) throw std::runtime_error("pickle: malformed data (empty stack)");
    return stack_.back();
  }
  static std::string key_of(const json& k) { return k.is_string() ? k.get<std::string>() : k.dump(); }
  void set_items(json& dict, std::vector<json>& kv) {
    if (!dict.is_object() || kv.size() % 2) throw std::runtime_error("pickle: malformed data (SETITEMS)");
    for (size_t i = 0; i < kv.size(); i += 2) dict[key_of(kv[i])] = std::move(kv[i + 1]);
  }
  void memo_put(uint64_t i) { memo_[i] = top(); }
  json memo_get(uint64_t i) {
    auto it = memo_.find(i);
    if (it == memo_.end()) throw std::runtime_error("pickle: malformed data (memo " + std::to_string(i) + ")");
    return it->second;
  }

  void step(unsigned char op);

  const std::string& b_;
  size_t pos_ = 0;
  std::vector<json> stack_;
  std::vector<bool> is_mark_;
  std::map<uint64_t, json> memo_;
};

void Reader::step(unsigned char op) {
  switch (op) {
    case 0x80:
      byte();
      return;  // PROTO
    case 0x95:
      le(8);
      return;  // FRAME
    case 'N':
      push(nullptr);
      return;  // NONE
    case 0x88:
      push(true);
      return;  // NEWTRUE
    case 0x89:
      push(false);
      return;  // NEWFALSE
    case 'J':
      push(static_cast<int64_t>(static_cast<int32_t>(le(4))));
      return;  // BININT
    case 'K':
      push(static_cast<int64_t>(le(1)));
      return;  // BININT1
    case 'M':
      push(static_cast<int64_t>(le(2)));
      return;     // BININT2
    case 0x8a: {  // LONG1
      const int n = static_cast<unsigned char>(byte());
      if (n > 8) throw std::runtime_error("pickle: an integer of " + std::to_string(n) + " bytes does not fit 64 bits");
      uint64_t v = n ? le(n) : 0;
      if (n > 0 && n < 8 && (v >> (8 * n - 1)) & 1) v |= ~uint64_t{0} << (8 * n);  // sign-extend
      push(static_cast<int64_t>(v));
      return;
    }
    case 'G': {  // BINFLOAT, big-endian
      const std::string s = take(8);
      uint64_t bits = 0;
      for (char c : s) bits = (bits << 8) | static_cast<unsigned char>(c);
      double d;
      std::memcpy(&d, &bits, 8);
      push(d);
      return;
    }
    case 0x8c:
      push(take(le(1)));
      return;  // SHORT_BINUNICODE
    case 'X':
      push(take(le(4)));
      return;  // BINUNICODE
    case 0x8d:
      push(take(le(8)));
      return;  // BINUNICODE8
    case ']':
      push(json::array());
      return;  // EMPTY_LIST
    case ')':
      push(json::array());
      return;  // EMPTY_TUPLE
    case '}':
      push(json::object());
      return;  // EMPTY_DICT
    case '(':  // MARK
      stack_.emplace_back();
      is_mark_.push_back(true);
      return;
    case 'a': {  // APPEND
      json v = pop();
      top().push_back(std::move(v));
      return;
    }
    case 'e': {  // APPENDS
      auto items = pop_mark();
      for (auto& v : items) top().push_back(std::move(v));
      return;
    }
    case 's': {  // SETITEM
      json v = pop(), k = pop();
      std::vector<json> kv{std::move(k), std::move(v)};
      set_items(top(), kv);
      return;
    }
    case 'u': {  // SETITEMS
      auto kv = pop_mark();
      set_items(top(), kv);
      return;
    }
    case 't':
      push(json(pop_mark()));
      return;  // TUPLE
    case 0x85:
      push(json::array({pop()}));
      return;     // TUPLE1
    case 0x86: {  // TUPLE2
      json b = pop(), a = pop();
      push(json::array({std::move(a), std::move(b)}));
      return;
    }
    case 0x87: {  // TUPLE3
      json c = pop(), b = pop(), a = pop();
      push(json::array({std::move(a), std::move(b), std::move(c)}));
      return;
    }
    case 'q':
      memo_put(le(1));
      return;  // BINPUT
    case 'r':
      memo_put(le(4));
      return;  // LONG_BINPUT
    case 0x94:
      memo_put(memo_.size());
      return;  // MEMOIZE
    case 'h':
      push(memo_get(le(1)));
      return;  // BINGET
    case 'j':
      push(memo_get(le(4)));
      return;  // LONG_BINGET
    default:
      break;
  }
  char hex[8];
  std::snprintf(hex, sizeof(hex), "0x%02x", op);
  throw std::runtime_error(std::string("pickle: opcode ") + hex + " at byte " + std::to_string(pos_ - 1) +
                           " is outside the subset dtrain reads (None, bool, int, float, str, list, tuple, dict)");
}

}  // namespace

std::string dumps(const json& value) {
  std::string out = "\x80\x02";  // PROTO 2
  put(out, value);
  out += '.';
  return out;
}

json loads(const std::string& bytes) { return Reader(bytes).run(); }

}  // namespace dtrain::flight::pickle
