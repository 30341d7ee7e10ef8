// The pickle machine of pickle.h: a stack, a mark stack and a memo over values in an arena.
//
// Opcodes read (Python's names; pickletools documents each):
//   framing      PROTO FRAME STOP
//   the stack    MARK POP POP_MARK DUP
//   constants    NONE NEWTRUE NEWFALSE BININT BININT1 BININT2 LONG1 LONG4 (up to 8 bytes) BINFLOAT
//   text, bytes  SHORT_BINUNICODE BINUNICODE BINUNICODE8 SHORT_BINBYTES BINBYTES BINBYTES8
//   containers   EMPTY_TUPLE TUPLE1 TUPLE2 TUPLE3 TUPLE EMPTY_LIST APPEND APPENDS LIST EMPTY_DICT
//                SETITEM SETITEMS DICT
//   objects      GLOBAL STACK_GLOBAL NEWOBJ NEWOBJ_EX REDUCE BUILD
//   the memo     MEMOIZE BINPUT LONG_BINPUT BINGET LONG_BINGET
// Anything else (text protocol 0, persistent ids, extensions, sets, out-of-band buffers) is refused.
#include "common/pickle.h"

#include <algorithm>
#include <cstring>
#include <unordered_map>
#include <unordered_set>

#include "dtrain/errors.h"

namespace dtrain::pickle {

namespace {

using Kind = Value::Kind;

// Caps a hostile file cannot pass: the memo's size, a string's length, the nesting dump() follows.
constexpr size_t kMaxMemo = size_t{1} << 24;
constexpr int kMaxDumpDepth = 1000;

const char* kind_name(Kind k) {
  switch (k) {
    case Kind::kNone:
      return "None";
    case Kind::kBool:
      return "a bool";
    case Kind::kInt:
      return "an int";
    case Kind::kFloat:
      return "a float";
    case Kind::kStr:
      return "a str";
    case Kind::kBytes:
      return "bytes";
    case Kind::kTuple:
      return "a tuple";
    case Kind::kList:
      return "a list";
    case Kind::kDict:
      return "a dict";
    case Kind::kGlobal:
      return "a global";
    case Kind::kObject:
      return "an object";
  }
  return "a value";
}

class Machine {
 public:
  Machine(const std::string& bytes, Document& doc) : in_(bytes), doc_(doc) {}
  Value* run();

 private:
  [[noreturn]] void fail(const std::string& what) const { throw Error(what + " at byte " + std::to_string(op_at_)); }
  const uint8_t* take(size_t n) {
    if (n > in_.size() - pos_) fail("truncated pickle (" + std::to_string(n) + " more bytes expected)");
    const auto* p = reinterpret_cast<const uint8_t*>(in_.data() + pos_);
    pos_ += n;
    return p;
  }
  uint64_t le(size_t n) {
    const uint8_t* p = take(n);
    uint64_t v = 0;
    for (size_t k = 0; k < n; ++k) v |= uint64_t(p[k]) << (8 * k);
    return v;
  }
  std::string text(uint64_t n) {
    if (n > in_.size() - pos_) fail("truncated pickle (a string of " + std::to_string(n) + " bytes)");
    return std::string(reinterpret_cast<const char*>(take(static_cast<size_t>(n))), static_cast<size_t>(n));
  }
  std::string line() {
    const size_t nl = in_.find('\n', pos_);
    if (nl == std::string::npos) fail("truncated pickle (a line without its end)");
    std::string s = in_.substr(pos_, nl - pos_);
    pos_ = nl + 1;
    return s;
  }
  Value* pop() {
    if (stack_.size() <= floor()) fail("pickle pops an empty stack");
    Value* v = stack_.back();
    stack_.pop_back();
    return v;
  }
  Value* top() {
    if (stack_.size() <= floor()) fail("pickle reads an empty stack");
    return stack_.back();
  }
  size_t floor() const { return marks_.empty() ? 0 : marks_.back(); }
  // The values above the last mark, which goes.
  std::vector<Value*> pop_mark() {
    if (marks_.empty()) fail("pickle has no mark to pop to");
    const size_t m = marks_.back();
    marks_.pop_back();
    std::vector<Value*> items(stack_.begin() + static_cast<std::ptrdiff_t>(m), stack_.end());
    stack_.resize(m);
    return items;
  }
  Value* expect(Value* v, Kind k, const char* op) {
    if (v->kind != k) fail(std::string(op) + " on " + v->describe() + ", not " + kind_name(k));
    return v;
  }
  void put(uint64_t index) {
    if (memo_.size() >= kMaxMemo && !memo_.count(index)) fail("pickle memo past its limit");
    memo_[index] = top();
  }
  void get(uint64_t index) {
    auto it = memo_.find(index);
    if (it == memo_.end()) fail("pickle reads memo entry " + std::to_string(index) + ", never written");
    stack_.push_back(it->second);
  }
  void setitems(Value* dict, const std::vector<Value*>& kv) {
    if (kv.size() % 2) fail("SETITEMS with an odd number of values");
    expect(dict, Kind::kDict, "SETITEMS");
    for (size_t k = 0; k < kv.size(); k += 2) doc_.set(dict, kv[k], kv[k + 1]);
  }
  Value* make_long(size_t n) {
    if (n > 8) fail("an integer of " + std::to_string(n) + " bytes (more than 64 bits)");
    uint64_t v = le(n);
    if (n > 0 && n < 8 && (v >> (8 * n - 1)) & 1) v |= ~uint64_t{0} << (8 * n);  // sign-extend
    return doc_.integer(static_cast<int64_t>(v));
  }
  bool step(uint8_t op);
  bool step_containers(uint8_t op);
  bool step_objects(uint8_t op);

  const std::string& in_;
  Document& doc_;
  size_t pos_ = 0, op_at_ = 0;
  std::vector<Value*> stack_;
  std::vector<size_t> marks_;
  std::unordered_map<uint64_t, Value*> memo_;
};

Value* Machine::run() {
  for (;;) {
    op_at_ = pos_;
    const uint8_t op = *take(1);
    if (op == '.') {  // STOP
      if (stack_.size() != 1 || !marks_.empty()) fail("pickle ends with " + std::to_string(stack_.size()) + " values");
      return stack_.back();
    }
    if (!step(op) && !step_containers(op) && !step_objects(op)) {
      char hex[8];
      snprintf(hex, sizeof hex, "0x%02x", op);
      fail(std::string("unsupported pickle opcode ") + hex);
    }
  }
}

// Constants, strings, the stack and the memo.
bool Machine::step(uint8_t op) {
  switch (op) {
    case 0x80:
      take(1);
      return true;  // PROTO
    case 0x95:
      take(8);
      return true;  // FRAME: only a read-ahead hint
    case '(':
      marks_.push_back(stack_.size());
      return true;
    case '0':
      pop();
      return true;
    case '1':
      pop_mark();
      return true;
    case '2':
      stack_.push_back(top());
      return true;
    case 'N':
      stack_.push_back(doc_.none());
      return true;
    case 0x88:
      stack_.push_back(doc_.boolean(true));
      return true;
    case 0x89:
      stack_.push_back(doc_.boolean(false));
      return true;
    case 'J':
      stack_.push_back(doc_.integer(static_cast<int32_t>(le(4))));
      return true;
    case 'K':
      stack_.push_back(doc_.integer(static_cast<int64_t>(le(1))));
      return true;
    case 'M':
      stack_.push_back(doc_.integer(static_cast<int64_t>(le(2))));
      return true;
    case 0x8a:
      stack_.push_back(make_long(static_cast<size_t>(le(1))));
      return true;
    case 0x8b:
      stack_.push_back(make_long(static_cast<size_t>(le(4))));
      return true;
    case 'G': {  // BINFLOAT: big-endian IEEE 754
      const uint8_t* p = take(8);
      uint64_t bits = 0;
      for (int k = 0; k < 8; ++k) bits = bits << 8 | p[k];
      double f;
      std::memcpy(&f, &bits, sizeof f);
      stack_.push_back(doc_.real(f));
      return true;
    }
    case 0x8c:
      stack_.push_back(doc_.str(text(le(1))));
      return true;
    case 'X':
      stack_.push_back(doc_.str(text(le(4))));
      return true;
    case 0x8d:
      stack_.push_back(doc_.str(text(le(8))));
      return true;
    case 'C':
    case 'B':
    case 0x8e: {
      Value* v = doc_.make(Kind::kBytes);
      v->s = text(le(op == 'C' ? 1 : op == 'B' ? 4 : 8));
      stack_.push_back(v);
      return true;
    }
    case 0x94:
      put(memo_.size());
      return true;  // MEMOIZE
    case 'q':
      put(le(1));
      return true;
    case 'r':
      put(le(4));
      return true;
    case 'h':
      get(le(1));
      return true;
    case 'j':
      get(le(4));
      return true;
    default:
      return false;
  }
}

bool Machine::step_containers(uint8_t op) {
  switch (op) {
    case ')':
      stack_.push_back(doc_.tuple({}));
      return true;
    case 0x85:
    case 0x86:
    case 0x87: {
      std::vector<Value*> items(op - 0x84);
      for (size_t k = items.size(); k-- > 0;) items[k] = pop();
      stack_.push_back(doc_.tuple(std::move(items)));
      return true;
    }
    case 't':
      stack_.push_back(doc_.tuple(pop_mark()));
      return true;
    case ']':
      stack_.push_back(doc_.list());
      return true;
    case 'l':
      stack_.push_back(doc_.list(pop_mark()));
      return true;
    case 'a': {
      Value* v = pop();
      expect(top(), Kind::kList, "APPEND")->items.push_back(v);
      return true;
    }
    case 'e': {
      std::vector<Value*> items = pop_mark();
      Value* l = expect(top(), Kind::kList, "APPENDS");
      l->items.insert(l->items.end(), items.begin(), items.end());
      return true;
    }
    case '}':
      stack_.push_back(doc_.dict());
      return true;
    case 'd': {
      Value* d = doc_.dict();
      setitems(d, pop_mark());
      stack_.push_back(d);
      return true;
    }
    case 's': {
      Value* v = pop();
      Value* k = pop();
      setitems(top(), {k, v});
      return true;
    }
    case 'u': {
      std::vector<Value*> kv = pop_mark();
      setitems(top(), kv);
      return true;
    }
    default:
      return false;
  }
}

bool Machine::step_objects(uint8_t op) {
  switch (op) {
    case 'c': {  // GLOBAL "module\nname\n"
      std::string module = line();
      stack_.push_back(doc_.global(module, line()));
      return true;
    }
    case 0x93: {  // STACK_GLOBAL
      Value* name = expect(pop(), Kind::kStr, "STACK_GLOBAL");
      Value* module = expect(pop(), Kind::kStr, "STACK_GLOBAL");
      stack_.push_back(doc_.global(module->s, name->s));
      return true;
    }
    case 0x81:    // NEWOBJ: cls, args
    case 0x92: {  // NEWOBJ_EX: cls, args, kwargs (kept only when empty)
      if (op == 0x92 && !expect(pop(), Kind::kDict, "NEWOBJ_EX")->items.empty())
        fail("NEWOBJ_EX with keyword arguments");
      Value* args = expect(pop(), Kind::kTuple, "NEWOBJ");
      Value* o = doc_.make(Kind::kObject);
      o->callable = expect(pop(), Kind::kGlobal, "NEWOBJ");
      o->args = args;
      o->b = true;  // NEWOBJ
      stack_.push_back(o);
      return true;
    }
    case 'R': {  // REDUCE: callable, args
      Value* args = expect(pop(), Kind::kTuple, "REDUCE");
      Value* o = doc_.make(Kind::kObject);
      o->callable = expect(pop(), Kind::kGlobal, "REDUCE");
      o->args = args;
      stack_.push_back(o);
      return true;
    }
    case 'b': {  // BUILD: obj, state
      Value* state = pop();
      Value* o = expect(top(), Kind::kObject, "BUILD");
      if (o->state) fail("BUILD twice on one object");
      o->state = state;
      return true;
    }
    default:
      return false;
  }
}

// ---- the writer ------------------------------------------------------------------------------------

class Writer {
 public:
  std::string out;
  void value(const Value* v, int depth);

 private:
  void u32(uint32_t n) {
    for (int k = 0; k < 4; ++k) out.push_back(static_cast<char>(n >> (8 * k)));
  }
  void sequence(const std::vector<Value*>& items, int depth) {
    for (const Value* item : items) value(item, depth + 1);
  }
};

void Writer::value(const Value* v, int depth) {
  if (depth > kMaxDumpDepth) throw Error("pickle::dump: values nested deeper than 1000 (a cycle?)");
  switch (v->kind) {
    case Kind::kNone:
      out += 'N';
      return;
    case Kind::kBool:
      out += static_cast<char>(v->b ? 0x88 : 0x89);
      return;
    case Kind::kInt:
      if (v->i >= INT32_MIN && v->i <= INT32_MAX) {
        out += 'J';
        u32(static_cast<uint32_t>(v->i));
      } else {
        out += static_cast<char>(0x8a);
        out += static_cast<char>(8);
        for (int k = 0; k < 8; ++k) out.push_back(static_cast<char>(static_cast<uint64_t>(v->i) >> (8 * k)));
      }
      return;
    case Kind::kFloat: {
      uint64_t bits;
      std::memcpy(&bits, &v->f, sizeof bits);
      out += 'G';
      for (int k = 7; k >= 0; --k) out.push_back(static_cast<char>(bits >> (8 * k)));
      return;
    }
    case Kind::kStr:
    case Kind::kBytes:
      out += v->kind == Kind::kStr ? 'X' : 'B';
      u32(static_cast<uint32_t>(v->s.size()));
      out += v->s;
      return;
    case Kind::kGlobal:
      out += "c" + v->s + "\n" + v->name + "\n";
      return;
    case Kind::kTuple:
      if (v->items.empty()) {
        out += ')';
      } else if (v->items.size() <= 3) {
        sequence(v->items, depth);
        out += static_cast<char>(0x84 + v->items.size());
      } else {
        out += '(';
        sequence(v->items, depth);
        out += 't';
      }
      return;
    case Kind::kList:
    case Kind::kDict:
      out += v->kind == Kind::kList ? ']' : '}';
      if (!v->items.empty()) {
        out += '(';
        sequence(v->items, depth);
        out += v->kind == Kind::kList ? 'e' : 'u';
      }
      return;
    case Kind::kObject:
      value(v->callable, depth + 1);
      value(v->args, depth + 1);
      out += v->b ? static_cast<char>(0x81) : 'R';  // NEWOBJ : REDUCE
      if (v->state) {
        value(v->state, depth + 1);
        out += 'b';
      }
      return;
  }
}

}  // namespace

const Value* Value::get(const std::string& key) const {
  if (kind != Kind::kDict) return nullptr;
  for (size_t k = items.size() / 2; k-- > 0;)
    if (items[2 * k]->kind == Kind::kStr && items[2 * k]->s == key) return items[2 * k + 1];
  return nullptr;
}

std::string Value::describe() const {
  if (kind == Kind::kGlobal) return "the global " + s + "." + name;
  if (kind == Kind::kObject && callable && callable->kind == Kind::kGlobal)
    return callable->s + "." + callable->name + "(...)";
  return kind_name(kind);
}

Value* Document::make(Value::Kind kind) {
  arena_.emplace_back();
  arena_.back().kind = kind;
  return &arena_.back();
}
Value* Document::boolean(bool b) {
  Value* v = make(Kind::kBool);
  v->b = b;
  return v;
}
Value* Document::integer(int64_t i) {
  Value* v = make(Kind::kInt);
  v->i = i;
  return v;
}
Value* Document::real(double f) {
  Value* v = make(Kind::kFloat);
  v->f = f;
  return v;
}
Value* Document::str(const std::string& s) {
  Value* v = make(Kind::kStr);
  v->s = s;
  return v;
}
Value* Document::global(const std::string& module, const std::string& attr) {
  Value* v = make(Kind::kGlobal);
  v->s = module;
  v->name = attr;
  return v;
}
Value* Document::tuple(std::vector<Value*> items) {
  Value* v = make(Kind::kTuple);
  v->items = std::move(items);
  return v;
}
Value* Document::list(std::vector<Value*> items) {
  Value* v = make(Kind::kList);
  v->items = std::move(items);
  return v;
}
Value* Document::dict() { return make(Kind::kDict); }
void Document::set(Value* dict, Value* key, Value* value) {
  dict->items.push_back(key);  // a repeated key stays: get() finds the last one, as Python keeps it
  dict->items.push_back(value);
}
Value* Document::object(Value* cls, Value* state) {
  Value* v = make(Kind::kObject);
  v->callable = cls;
  v->args = tuple({});
  v->state = state;
  v->b = true;  // NEWOBJ
  return v;
}
Value* Document::call(Value* callable, std::vector<Value*> args) {
  Value* v = make(Kind::kObject);
  v->callable = callable;
  v->args = tuple(std::move(args));
  return v;
}

Expansion expansion(const Value& root, uint64_t max_values, uint64_t max_text_bytes) {
  // Depth first without recursion, each value's expansion computed once and added wherever it is
  // referenced, saturating just past the caps: time and memory in proportion to the values.
  struct Frame {
    const Value* v;
    size_t next;  // the next child: items, then callable, args, state
    Expansion sum;
  };
  const auto add = [&](Expansion& to, const Expansion& e) {
    to.values = std::min(to.values + e.values, max_values + 1);
    to.text_bytes = std::min(to.text_bytes + e.text_bytes, max_text_bytes + 1);
  };
  const auto own = [](const Value* v) { return Expansion{1, v->s.size() + v->name.size()}; };
  std::unordered_map<const Value*, Expansion> done;
  std::unordered_set<const Value*> open{&root};
  std::vector<Frame> stack{{&root, 0, own(&root)}};
  while (!stack.empty()) {
    Frame& f = stack.back();
    const Value* child = nullptr;
    const size_t n = f.v->items.size();
    for (; !child && f.next < n + 3; ++f.next)
      child = f.next < n ? f.v->items[f.next] : f.next == n ? f.v->callable : f.next == n + 1 ? f.v->args : f.v->state;
    if (child) {
      if (auto it = done.find(child); it != done.end())
        add(f.sum, it->second);
      else if (open.count(child))
        add(f.sum, {1, 0});  // a cycle closes here
      else {
        open.insert(child);
        stack.push_back({child, 0, own(child)});
      }
      continue;
    }
    const Frame finished = f;
    stack.pop_back();
    open.erase(finished.v);
    done.emplace(finished.v, finished.sum);
    if (finished.sum.values > max_values || finished.sum.text_bytes > max_text_bytes) return finished.sum;
    if (!stack.empty()) add(stack.back().sum, finished.sum);
  }
  return done.at(&root);
}

Document parse(const std::string& bytes) {
  Document doc;
  doc.root_ = Machine(bytes, doc).run();
  // Note [Pickle budget]: the memo lets a few bytes stand for a value of any size, used anywhere
  // (a list of two references to the list before it doubles with every 6 bytes), and the decoders
  // over this reader copy values where they are used. What a pickle may expand to is therefore
  // bounded by its size: a multiple of its bytes, in values and in bytes of text, far above what
  // real files reach (DCP's metadata as PyTorch pickles it, shared names and sizes included: about
  // 0.25 values and 2 bytes of text per byte), so that a decoder's work is linear in the file
  // whatever the file shares.
  const uint64_t budget = budget_for(bytes.size());
  const Expansion e = expansion(*doc.root_, budget, budget);
  if (e.values > budget || e.text_bytes > budget)
    throw Error("pickle of " + std::to_string(bytes.size()) + " bytes shares values past its budget: copied where " +
                "they are used they would be more than " + std::to_string(budget) +
                (e.values > budget ? " values" : " bytes of text") + " (" + std::to_string(kBudgetPerByte) +
                " per byte of the pickle): a hostile or damaged file");
  return doc;
}

std::string dump(const Value* root) {
  Writer w;
  w.out = std::string("\x80\x02", 2);
  w.value(root, 0);
  w.out += '.';
  return w.out;
}

}  // namespace dtrain::pickle
