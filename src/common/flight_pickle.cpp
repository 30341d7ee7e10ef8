// Flight records as JSON over the one pickle reader and writer (common/pickle.h): JSON's types map
// onto pickle's plain data both ways, and anything else a file holds (a global, an object, bytes, a
// dict keyed by other than text) is refused.
#include "common/flight_pickle.h"

#include <stdexcept>

#include "common/pickle.h"

namespace dtrain::flight::pickle {
namespace {

using json = nlohmann::json;
using dtrain::pickle::Document;
using dtrain::pickle::Value;
using Kind = Value::Kind;

// Far deeper than a dump nests (4 levels); a cyclic or hostile file stops here, not in the stack.
constexpr int kMaxDepth = 100;

Value* to_value(Document& doc, const json& v, int depth) {
  if (depth > kMaxDepth) throw std::runtime_error("pickle: JSON nested deeper than 100 levels");
  switch (v.type()) {
    case json::value_t::boolean:
      return doc.boolean(v.get<bool>());
    case json::value_t::number_integer:
      return doc.integer(v.get<int64_t>());
    case json::value_t::number_unsigned:
      return doc.integer(static_cast<int64_t>(v.get<uint64_t>()));
    case json::value_t::number_float:
      return doc.real(v.get<double>());
    case json::value_t::string:
      return doc.str(v.get_ref<const std::string&>());
    case json::value_t::array: {
      Value* list = doc.list();
      for (const auto& item : v) list->items.push_back(to_value(doc, item, depth + 1));
      return list;
    }
    case json::value_t::object: {
      Value* dict = doc.dict();
      for (const auto& [key, item] : v.items()) doc.set(dict, doc.str(key), to_value(doc, item, depth + 1));
      return dict;
    }
    default:  // null, binary, discarded
      return doc.none();
  }
}

json to_json(const Value& v, int depth) {
  if (depth > kMaxDepth) throw std::runtime_error("pickle: values nested deeper than 100 levels (a cycle?)");
  switch (v.kind) {
    case Kind::kNone:
      return nullptr;
    case Kind::kBool:
      return v.b;
    case Kind::kInt:
      return v.i;
    case Kind::kFloat:
      return v.f;
    case Kind::kStr:
      return v.s;
    case Kind::kTuple:
    case Kind::kList: {
      json out = json::array();
      for (const Value* item : v.items) out.push_back(to_json(*item, depth + 1));
      return out;
    }
    case Kind::kDict: {
      json out = json::object();
      for (size_t k = 0; k + 1 < v.items.size(); k += 2) {
        if (v.items[k]->kind != Kind::kStr)
          throw std::runtime_error("pickle: a dict keyed by " + v.items[k]->describe() + ", not text");
        out[v.items[k]->s] = to_json(*v.items[k + 1], depth + 1);
      }
      return out;
    }
    default:  // bytes, a global, an object
      throw std::runtime_error("pickle: " + v.describe() + " is not plain data (a flight record holds none)");
  }
}

}  // namespace

std::string dumps(const json& value) {
  Document doc;
  return dtrain::pickle::dump(to_value(doc, value, 0));
}

json loads(const std::string& bytes) {
  try {
    const Document doc = dtrain::pickle::parse(bytes);
    return to_json(doc.root(), 0);
  } catch (const std::runtime_error& e) {
    const std::string what = e.what();
    throw std::runtime_error(what.rfind("pickle", 0) == 0 ? what : "pickle: " + what);
  }
}

}  // namespace dtrain::flight::pickle
