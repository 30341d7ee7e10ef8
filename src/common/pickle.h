// The one small pickle reader and writer: for the metadata of PyTorch's distributed checkpoints
// (DCP's `.metadata` file is a pickle of its dataclasses) and for flight-record dumps (JSON values
// through common/flight_pickle.h). Torch-free, so that the launcher reads dumps with it and its fuzz
// target (tests/fuzz/) builds without LibTorch.
//
// The reader runs the pickle machine over the opcodes Python's pickle writes for plain data and
// dataclasses (protocols 2 to 5: strings, numbers, tuples, lists, dicts, globals, NEWOBJ, REDUCE,
// BUILD, the memo, frames). It never imports or calls anything: a global is a name, and NEWOBJ or
// REDUCE of it is an Object that holds the callable's name and its arguments, BUILD its state. A
// file that uses anything else (persistent ids, extension codes, out-of-band buffers) is refused.
// Every value lives in the Document's arena, so a cyclic or deeply nested input costs no recursion.
//
//   pickle::Document doc = pickle::parse(bytes);        // throws dtrain::Error naming the offset
//   const pickle::Value& root = doc.root();
//   if (root.is_object("torch.distributed.checkpoint.metadata", "Metadata")) ...
//
// The writer builds values in a Document and serializes them as protocol 2, which every Python 3
// reads:
//   pickle::Document doc;
//   pickle::Value* d = doc.dict();
//   doc.set(d, doc.str("version"), doc.str("1.0.0"));
//   std::string bytes = pickle::dump(d);
#pragma once

#include <cstdint>
#include <deque>
#include <string>
#include <vector>

namespace dtrain::pickle {

struct Value {
  enum class Kind { kNone, kBool, kInt, kFloat, kStr, kBytes, kTuple, kList, kDict, kGlobal, kObject };
  Kind kind = Kind::kNone;
  bool b = false;
  int64_t i = 0;
  double f = 0;
  std::string s;                    // kStr, kBytes; kGlobal: the module
  std::string name;                 // kGlobal: the attribute
  std::vector<Value*> items;        // kTuple, kList; kDict: key, value, key, value, ...
  const Value* callable = nullptr;  // kObject: the global NEWOBJ or REDUCE called
  const Value* args = nullptr;      // kObject: its argument tuple
  const Value* state = nullptr;     // kObject: what BUILD gave it (null: none)

  bool is_global(const std::string& module, const std::string& attr) const {
    return kind == Kind::kGlobal && s == module && name == attr;
  }
  // An Object made by calling (or NEWOBJ of) module.attr.
  bool is_object(const std::string& module, const std::string& attr) const {
    return kind == Kind::kObject && callable && callable->is_global(module, attr);
  }
  // A dict's value under the string key `key`, or null.
  const Value* get(const std::string& key) const;
  // "an int", "a dict", "torch.Size(...)": what the value is, for error messages.
  std::string describe() const;
};

class Document {
 public:
  Document() = default;
  Document(const Document&) = delete;
  Document& operator=(const Document&) = delete;
  Document(Document&&) = default;
  Document& operator=(Document&&) = default;

  const Value& root() const { return *root_; }

  // Builders (the writer's, and the reader's own).
  Value* make(Value::Kind kind);
  Value* none() { return make(Value::Kind::kNone); }
  Value* boolean(bool b);
  Value* integer(int64_t i);
  Value* real(double f);
  Value* str(const std::string& s);
  Value* global(const std::string& module, const std::string& attr);
  Value* tuple(std::vector<Value*> items);
  Value* list(std::vector<Value*> items = {});
  Value* dict();
  void set(Value* dict, Value* key, Value* value);
  // cls() with no arguments (NEWOBJ), its state given by BUILD.
  Value* object(Value* cls, Value* state);
  // callable(*args) (REDUCE).
  Value* call(Value* callable, std::vector<Value*> args);

 private:
  friend Document parse(const std::string& bytes);
  std::deque<Value> arena_;
  Value* root_ = nullptr;
};

// What a full copy of a value makes when every shared reference (the memo's, DUP's) is copied
// where it is used, as a decoder that turns values into its own structures does: values, and bytes
// of text (str, bytes, globals' names). A cycle counts as one value where it closes (a decoder that
// follows cycles stops at its own depth limit). Counting stops once either passes its cap.
struct Expansion {
  uint64_t values = 0, text_bytes = 0;
};
Expansion expansion(const Value& root, uint64_t max_values, uint64_t max_text_bytes);

// Note [Pickle budget]: what parse() lets a pickle of n bytes expand to.
constexpr uint64_t kBudgetPerByte = 16;
constexpr uint64_t kBudgetSlack = 1 << 16;
inline uint64_t budget_for(size_t bytes) { return kBudgetPerByte * bytes + kBudgetSlack; }

// Parses a pickle. Throws dtrain::Error "<what> at byte <offset>" for a truncated or malformed
// pickle or an opcode outside the subset above, and a plain reason for a pickle whose expansion
// passes its budget (budget_for: values and text alike); the caller names the file.
Document parse(const std::string& bytes);
// Serializes `root` (a value of some Document) as a protocol-2 pickle. Values reachable twice are
// written twice; a cycle is an error.
std::string dump(const Value* root);

}  // namespace dtrain::pickle
