// DCP's metadata dataclasses <-> pickle values (pickle.h), written as Python 2.15's pickle.dump of
// them reads back equal (tests/dist/test_dcp.py compares them in Python), and read from what Python
// writes, checking each field's type on the way.
#include "checkpoint/dcp_metadata.h"

#include <algorithm>
#include <limits>
#include <set>
#include <tuple>

#include "common/pickle.h"
#include "dtrain/errors.h"

namespace dtrain::dcp::detail {

namespace {

using pickle::Document;
using pickle::Value;
using Kind = Value::Kind;

const char* const kModule = "torch.distributed.checkpoint.metadata";
const char* const kFilesystem = "torch.distributed.checkpoint.filesystem";

// ---- writing ---------------------------------------------------------------------------------------

struct Encoder {
  Document doc;

  Value* size(const Shape& s) {
    std::vector<Value*> ints;
    for (int64_t d : s) ints.push_back(doc.integer(d));
    return doc.call(doc.global("torch", "Size"), {doc.tuple(ints)});
  }
  Value* dataclass(const char* module, const char* cls, std::vector<std::pair<const char*, Value*>> fields) {
    Value* state = doc.dict();
    for (auto& [k, v] : fields) doc.set(state, doc.str(k), v);
    return doc.object(doc.global(module, cls), fields.empty() ? nullptr : state);
  }
  // TensorProperties.__getstate__'s 5-tuple (the 6th, strides, is optional in 2.x's __setstate__ and
  // unknown to 1.x's): dtype, layout, requires_grad, memory format, pin_memory.
  Value* properties(const TensorMeta& t) {
    Value* layout = doc.call(doc.global("torch.serialization", "_get_layout"), {doc.str("torch.strided")});
    Value* format = doc.call(doc.global("builtins", "getattr"),
                             {doc.global(kModule, "_MEM_FORMAT_ENCODING"), doc.str("TORCH_CONTIGUOUS_FORMAT")});
    Value* state =
        doc.tuple({doc.global("torch", t.dtype), layout, doc.boolean(t.requires_grad), format, doc.boolean(false)});
    return doc.object(doc.global(kModule, "TensorProperties"), state);
  }
  Value* tensor(const TensorMeta& t) {
    Value* chunks = doc.list();
    for (const Chunk& c : t.chunks)
      chunks->items.push_back(
          dataclass(kModule, "ChunkStorageMetadata", {{"offsets", size(c.offsets)}, {"sizes", size(c.sizes)}}));
    return dataclass(kModule, "TensorStorageMetadata",
                     {{"properties", properties(t)}, {"size", size(t.size)}, {"chunks", chunks}});
  }
  Value* path(const Path& p) {
    std::vector<Value*> elems;
    for (const PathElem& e : p) elems.push_back(e.is_int ? doc.integer(e.i) : doc.str(e.s));
    return doc.tuple(elems);
  }
  Value* index(const Item& item, int64_t chunk_index) {
    // MetadataIndex's __init__ leaves `offset` out of the instance when it is None.
    std::vector<std::pair<const char*, Value*>> f{{"fqn", doc.str(item.fqn)}};
    if (item.offsets) f.push_back({"offset", size(*item.offsets)});
    f.push_back({"index", item.offsets ? doc.integer(chunk_index) : doc.none()});
    return dataclass(kModule, "MetadataIndex", f);
  }
};

// ---- reading ---------------------------------------------------------------------------------------

[[noreturn]] void bad(const std::string& where, const Value* v, const std::string& want) {
  throw Error("not a distributed checkpoint's metadata: " + where + " is " + (v ? v->describe() : "missing") +
              ", not " + want);
}

const Value* field(const Value& obj, const char* name, const std::string& where) {
  if (!obj.state || obj.state->kind != Kind::kDict) bad(where, obj.state, "a dataclass's fields");
  return obj.state->get(name);
}

const Value& object_of(const Value* v, const char* module, const char* cls, const std::string& where) {
  if (!v || !v->is_object(module, cls)) bad(where, v, cls);
  return *v;
}

const std::string& str_of(const Value* v, const std::string& where) {
  if (!v || v->kind != Kind::kStr) bad(where, v, "a str");
  return v->s;
}

int64_t int_of(const Value* v, const std::string& where) {
  if (!v || v->kind != Kind::kInt) bad(where, v, "an int");
  return v->i;
}

Shape size_of(const Value* v, const std::string& where) {
  if (!v || !v->is_object("torch", "Size") || v->args->items.size() != 1 || v->args->items[0]->kind != Kind::kTuple)
    bad(where, v, "a torch.Size");
  Shape s;
  for (const Value* d : v->args->items[0]->items) s.push_back(int_of(d, where));
  return s;
}

[[noreturn]] void inconsistent(const std::string& what) {
  throw Error(what + " (a damaged or hand-made file: load another checkpoint or restore this one from a copy)");
}

// Every chunk inside its tensor, once: the planner indexes a chunk's offsets by the tensor's
// dimensions and adds offset and size, and a load reads each chunk it lists.
void check_chunks(const TensorMeta& m, const std::string& where) {
  for (int64_t d : m.size)
    if (d < 0) inconsistent(where + ".size is " + dims_text(m.size) + ", a negative size");
  std::set<Shape> seen;
  for (size_t k = 0; k < m.chunks.size(); ++k) {
    const Chunk& c = m.chunks[k];
    const std::string at = where + ".chunks[" + std::to_string(k) + "]";
    bool fits = c.offsets.size() == m.size.size() && c.sizes.size() == m.size.size();
    for (size_t d = 0; fits && d < m.size.size(); ++d)  // overflow-free: 0 <= o <= dim, 0 <= s <= dim - o
      fits =
          c.offsets[d] >= 0 && c.sizes[d] >= 0 && c.offsets[d] <= m.size[d] && c.sizes[d] <= m.size[d] - c.offsets[d];
    if (!fits)
      inconsistent(at + " has offsets " + dims_text(c.offsets) + " and sizes " + dims_text(c.sizes) +
                   " for a tensor of size " + dims_text(m.size) +
                   ": a chunk needs one offset and one size per dimension, with 0 <= offset and offset + size <= "
                   "the dimension");
    if (!seen.insert(c.offsets).second) inconsistent(at + " repeats the chunk at offsets " + dims_text(c.offsets));
  }
}

// Every stored item within what a file can hold, and none in another's bytes (a writer puts them
// back to back; a load would read shared bytes once per item).
void check_storage(const std::vector<Item>& items) {
  constexpr int64_t kMaxOffset = std::numeric_limits<int64_t>::max();
  std::vector<const Item*> by_place;
  for (const Item& item : items) {
    const StorageInfo& s = item.storage;
    if (s.offset < 0 || s.length < 0) inconsistent("the item '" + item.fqn + "' has a negative offset or length");
    if (s.length > kMaxOffset - s.offset)
      inconsistent("the item '" + item.fqn + "' is stored at bytes " + std::to_string(s.offset) + " + " +
                   std::to_string(s.length) + ", past the largest offset a file can have");
    if (s.length > 0) by_place.push_back(&item);
  }
  std::sort(by_place.begin(), by_place.end(), [](const Item* a, const Item* b) {
    return std::tie(a->storage.relative_path, a->storage.offset) <
           std::tie(b->storage.relative_path, b->storage.offset);
  });
  const Item* reach = nullptr;  // of the items so far in this file, the one that ends last
  for (const Item* item : by_place) {
    const StorageInfo& s = item->storage;
    if (reach && reach->storage.relative_path == s.relative_path &&
        s.offset < reach->storage.offset + reach->storage.length) {
      const auto span = [](const StorageInfo& i) {
        return "bytes " + std::to_string(i.offset) + "-" + std::to_string(i.offset + i.length);
      };
      inconsistent("the items '" + reach->fqn + "' and '" + item->fqn + "' overlap in " + s.relative_path + " (" +
                   span(reach->storage) + " and " + span(s) + "): each item has bytes of its own");
    }
    if (!reach || reach->storage.relative_path != s.relative_path ||
        s.offset + s.length > reach->storage.offset + reach->storage.length)
      reach = item;
  }
}

TensorMeta tensor_of(const Value& t, const std::string& where) {
  TensorMeta m;
  const Value& props = object_of(field(t, "properties", where), kModule, "TensorProperties", where + ".properties");
  if (!props.state || props.state->kind != Kind::kTuple || props.state->items.size() < 5)
    bad(where + ".properties", props.state, "TensorProperties' state tuple");
  const Value* dtype = props.state->items[0];
  if (dtype->kind != Kind::kGlobal || dtype->s != "torch") bad(where + ".properties.dtype", dtype, "a torch dtype");
  m.dtype = dtype->name;
  m.requires_grad = props.state->items[2]->kind == Kind::kBool && props.state->items[2]->b;
  m.size = size_of(field(t, "size", where), where + ".size");
  const Value* chunks = field(t, "chunks", where);
  if (!chunks || chunks->kind != Kind::kList) bad(where + ".chunks", chunks, "a list");
  for (const Value* c : chunks->items) {
    const Value& chunk = object_of(c, kModule, "ChunkStorageMetadata", where + ".chunks[]");
    m.chunks.push_back({size_of(field(chunk, "offsets", where), where + ".chunks[].offsets"),
                        size_of(field(chunk, "sizes", where), where + ".chunks[].sizes")});
  }
  check_chunks(m, where);
  return m;
}

void read_entries(const Value& root, Metadata& m) {
  const Value* sdm = field(root, "state_dict_metadata", "Metadata");
  if (!sdm || sdm->kind != Kind::kDict) bad("state_dict_metadata", sdm, "a dict");
  for (size_t k = 0; k + 1 < sdm->items.size(); k += 2) {
    const std::string& key = str_of(sdm->items[k], "a key of state_dict_metadata");
    const std::string where = "state_dict_metadata['" + key + "']";
    const Value* v = sdm->items[k + 1];
    if (v->is_object(kModule, "BytesStorageMetadata"))
      m.values.push_back(key);
    else if (v->is_object(kModule, "TensorStorageMetadata"))
      m.tensors[key] = tensor_of(*v, where);
    else
      bad(where, v, "TensorStorageMetadata or BytesStorageMetadata");
  }
}

void read_paths(const Value& root, Metadata& m) {
  const Value* pd = field(root, "planner_data", "Metadata");
  if (!pd || pd->kind != Kind::kDict) return;  // another planner's data: the keys still name the items
  for (size_t k = 0; k + 1 < pd->items.size(); k += 2) {
    const std::string& key = str_of(pd->items[k], "a key of planner_data");
    const Value* t = pd->items[k + 1];
    if (t->kind != Kind::kTuple && t->kind != Kind::kList) bad("planner_data['" + key + "']", t, "a tuple");
    Path p;
    for (const Value* e : t->items) {
      PathElem pe;
      pe.is_int = e->kind == Kind::kInt;
      if (pe.is_int)
        pe.i = e->i;
      else
        pe.s = str_of(e, "planner_data['" + key + "'][]");
      p.push_back(pe);
    }
    m.paths[key] = p;
  }
}

void read_items(const Value& root, Metadata& m) {
  const Value* sd = field(root, "storage_data", "Metadata");
  if (!sd || sd->kind != Kind::kDict) bad("storage_data", sd, "a dict");
  for (size_t k = 0; k + 1 < sd->items.size(); k += 2) {
    const Value& index = object_of(sd->items[k], kModule, "MetadataIndex", "a key of storage_data");
    Item item;
    item.fqn = str_of(field(index, "fqn", "MetadataIndex"), "MetadataIndex.fqn");
    const Value* offset = field(index, "offset", "MetadataIndex");
    if (offset && offset->kind != Kind::kNone)
      item.offsets = size_of(offset, "MetadataIndex('" + item.fqn + "').offset");
    const std::string where = "storage_data[MetadataIndex('" + item.fqn + "')]";
    const Value& info = object_of(sd->items[k + 1], kFilesystem, "_StorageInfo", where);
    item.storage.relative_path = str_of(field(info, "relative_path", where), where + ".relative_path");
    item.storage.offset = int_of(field(info, "offset", where), where + ".offset");
    item.storage.length = int_of(field(info, "length", where), where + ".length");
    const Value* transforms = field(info, "transform_descriptors", where);
    if (transforms && transforms->kind != Kind::kNone && !transforms->items.empty())
      throw Error("the item '" + item.fqn + "' is stored through transforms (" + transforms->items[0]->describe() +
                  "...), which dtrain does not read: save without them");
    m.items.push_back(item);
  }
}

}  // namespace

std::string dims_text(const Shape& s) {
  constexpr size_t kShown = 8;
  std::string out = "[";
  for (size_t d = 0; d < s.size() && d < kShown; ++d) out += (d ? ", " : "") + std::to_string(s[d]);
  if (s.size() > kShown) out += ", ... (" + std::to_string(s.size()) + " dimensions)";
  return out + "]";
}

std::string join(const Path& path) {
  std::string s;
  for (const PathElem& e : path) s += (s.empty() ? "" : ".") + (e.is_int ? std::to_string(e.i) : e.s);
  return s;
}

std::optional<std::pair<Shape, Shape>> overlap(const Chunk& c, const Shape& offsets, const Shape& sizes) {
  DTRAIN_ASSERT(c.offsets.size() == sizes.size() && c.sizes.size() == sizes.size() && offsets.size() == sizes.size());
  Shape lo(sizes.size()), hi(sizes.size());
  for (size_t d = 0; d < sizes.size(); ++d) {
    lo[d] = std::max(offsets[d], c.offsets[d]);
    hi[d] = std::min(offsets[d] + sizes[d], c.offsets[d] + c.sizes[d]);
    if (hi[d] <= lo[d]) return std::nullopt;
  }
  return std::make_pair(std::move(lo), std::move(hi));
}

std::string encode(const Metadata& m) {
  Encoder e;
  Document& d = e.doc;
  Value* sdm = d.dict();
  for (const auto& [key, t] : m.tensors) d.set(sdm, d.str(key), e.tensor(t));
  for (const std::string& key : m.values) d.set(sdm, d.str(key), e.dataclass(kModule, "BytesStorageMetadata", {}));
  Value* planner = d.dict();
  for (const auto& [key, p] : m.paths) d.set(planner, d.str(key), e.path(p));
  Value* storage = d.dict();
  for (const Item& item : m.items) {
    int64_t index = 0;
    if (item.offsets) {  // the chunk's place in its tensor's list: DCP's lookup hint
      const auto& chunks = m.tensors.at(item.fqn).chunks;
      while (index < static_cast<int64_t>(chunks.size()) && chunks[static_cast<size_t>(index)].offsets != *item.offsets)
        ++index;
    }
    Value* info = e.dataclass(kFilesystem, "_StorageInfo",
                              {{"relative_path", d.str(item.storage.relative_path)},
                               {"offset", d.integer(item.storage.offset)},
                               {"length", d.integer(item.storage.length)}});
    d.set(storage, e.index(item, index), info);
  }
  Value* meta = e.dataclass(kModule, "StorageMeta",
                            {{"checkpoint_id", d.str(m.checkpoint_id)},
                             {"save_id", d.str(m.save_id)},
                             {"load_id", d.none()},
                             {"modules", d.list()}});
  Value* root = e.dataclass(kModule, "Metadata",
                            {{"state_dict_metadata", sdm},
                             {"planner_data", planner},
                             {"storage_data", storage},
                             {"storage_meta", meta},
                             {"version", d.str(m.version)}});
  return pickle::dump(root);
}

Metadata decode(const std::string& bytes) {
  const pickle::Document doc = pickle::parse(bytes);
  const Value& root = object_of(&doc.root(), kModule, "Metadata", "the pickled object");
  Metadata m;
  read_entries(root, m);
  read_paths(root, m);
  read_items(root, m);
  check_storage(m.items);
  if (const Value* v = field(root, "version", "Metadata"); v && v->kind == Kind::kStr) m.version = v->s;
  for (const Item& item : m.items) {
    if (!item.offsets) continue;
    auto it = m.tensors.find(item.fqn);
    if (it == m.tensors.end())
      throw Error("the stored chunk of '" + item.fqn + "' has no entry in state_dict_metadata");
  }
  return m;
}

}  // namespace dtrain::dcp::detail
