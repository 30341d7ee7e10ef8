// save_safetensors and load_safetensors (dtrain/safetensors.h).
//
// Layout: [u64 little-endian N][N bytes of JSON, padded with spaces to a multiple of 8][data]. The
// JSON maps each name to {"dtype", "shape", "data_offsets": [begin, end]} (offsets into the data),
// and "__metadata__" to string pairs. Tensors are laid out as Python's writer lays them out (by
// safetensors' dtype order, widest first, then by name), so that each starts aligned to its element
// size and the same tensors make the same file. The reader checks what
// safetensors' own validation checks: the ranges tile the data exactly, each as long as its
// shape and dtype say.
#include "dtrain/safetensors.h"

#include <algorithm>
#include <cstring>
#include <fstream>
#include <iterator>
#include <set>

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/nn/module.h>

#include "checkpoint/dtypes.h"
#include "checkpoint/file_io.h"
#include "dtrain/errors.h"

namespace dtrain {

namespace {

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "safetensors' bytes are little-endian, as this host's");

// safetensors' own limit on the header (safetensors/src/tensor.rs: MAX_HEADER_SIZE).
constexpr uint64_t kMaxHeaderBytes = 100'000'000;

[[noreturn]] void corrupt(const std::string& path, uint64_t at, const std::string& what) {
  throw Error("load_safetensors: " + path + " is not a valid safetensors file: " + what + " at byte " +
              std::to_string(at) + " (a truncated copy, or not a safetensors file)");
}

NamedTensors named(const torch::nn::Module& module) {
  NamedTensors out;
  for (const auto& kv : module.named_parameters()) out.emplace_back(kv.key(), kv.value());
  for (const auto& kv : module.named_buffers()) out.emplace_back(kv.key(), kv.value());
  return out;
}

struct Parsed {
  SafetensorsFile file;
  uint64_t data_start = 0;
};

// One tensor's entry of the header, checked against the data that follows it.
at::Tensor read_entry(const std::string& path, const std::string& bytes, uint64_t at, uint64_t data_start,
                      const std::string& name, const nlohmann::json& e, std::pair<uint64_t, uint64_t>* range) {
  if (!e.is_object() || !e.contains("dtype") || !e.contains("shape") || !e.contains("data_offsets"))
    corrupt(path, at, "the entry of '" + name + "' lacks dtype, shape or data_offsets");
  if (!e["dtype"].is_string()) corrupt(path, at, "the dtype of '" + name + "' is not a string");
  const auto dtype = ckpt::dtype_of_safetensors_code(e["dtype"].get<std::string>());
  if (!dtype)
    corrupt(path, at, "'" + name + "' has the dtype " + e["dtype"].get<std::string>() + ", which this LibTorch lacks");
  std::vector<int64_t> shape;
  uint64_t numel = 1;
  if (!e["shape"].is_array()) corrupt(path, at, "the shape of '" + name + "' is not a list");
  for (const auto& d : e["shape"]) {
    if (!d.is_number_unsigned() || d.get<uint64_t>() > (uint64_t{1} << 48))
      corrupt(path, at, "the shape of '" + name + "' holds " + d.dump() + ", not a size");
    shape.push_back(d.get<int64_t>());
    numel = shape.back() == 0
                ? 0
                : (numel > (uint64_t{1} << 62) / d.get<uint64_t>() ? uint64_t{1} << 62 : numel * d.get<uint64_t>());
  }
  const auto& o = e["data_offsets"];
  if (!o.is_array() || o.size() != 2 || !o[0].is_number_unsigned() || !o[1].is_number_unsigned())
    corrupt(path, at, "the data_offsets of '" + name + "' are not two offsets");
  const uint64_t begin = o[0].get<uint64_t>(), end = o[1].get<uint64_t>();
  const uint64_t data_size = bytes.size() - data_start;
  const uint64_t want = numel * c10::elementSize(*dtype);
  if (begin > end || end > data_size || end - begin != want)
    corrupt(path, at,
            "'" + name + "' spans data bytes " + std::to_string(begin) + "-" + std::to_string(end) + " of " +
                std::to_string(data_size) + ", but its shape and dtype take " + std::to_string(want));
  *range = {begin, end};
  at::Tensor t = at::empty(shape, at::TensorOptions().dtype(*dtype));
  if (want) std::memcpy(t.data_ptr(), bytes.data() + data_start + begin, want);
  return t;
}

Parsed parse(const std::string& path, const std::string& bytes) {
  if (bytes.size() < 8)
    corrupt(path, 0, "the file is " + std::to_string(bytes.size()) + " bytes, less than its 8-byte header length");
  uint64_t n = 0;
  for (int k = 7; k >= 0; --k) n = n << 8 | static_cast<uint8_t>(bytes[static_cast<size_t>(k)]);
  if (n > kMaxHeaderBytes || n > bytes.size() - 8)
    corrupt(
        path, 0,
        "the header length " + std::to_string(n) + " runs past the file's " + std::to_string(bytes.size()) + " bytes");
  const std::string header = bytes.substr(8, n);
  if (header.empty() || header[0] != '{') corrupt(path, 8, "the header does not start with '{'");
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(header);
  } catch (const nlohmann::json::parse_error& e) {
    corrupt(path, 8 + (e.byte > 0 ? e.byte - 1 : 0), std::string("its JSON header does not parse (") + e.what() + ")");
  }
  Parsed p;
  p.data_start = 8 + n;
  std::vector<std::tuple<uint64_t, uint64_t, std::string, at::Tensor>> found;
  for (auto it = j.begin(); it != j.end(); ++it) {
    const uint64_t at = 8 + std::min<size_t>(header.find("\"" + it.key() + "\""), n);
    if (it.key() == "__metadata__") {
      if (!it->is_object()) corrupt(path, at, "__metadata__ is not an object");
      for (auto m = it->begin(); m != it->end(); ++m) {
        if (!m->is_string()) corrupt(path, at, "__metadata__['" + m.key() + "'] is not a string");
        p.file.metadata[m.key()] = m->get<std::string>();
      }
      continue;
    }
    std::pair<uint64_t, uint64_t> range;
    at::Tensor t = read_entry(path, bytes, at, p.data_start, it.key(), *it, &range);
    found.emplace_back(range.first, range.second, it.key(), t);
  }
  std::sort(found.begin(), found.end(), [](const auto& a, const auto& b) {
    return std::make_pair(std::get<0>(a), std::get<1>(a)) < std::make_pair(std::get<0>(b), std::get<1>(b));
  });
  uint64_t end = 0;
  for (auto& [b, e, name, t] : found) {
    if (b != end)
      corrupt(path, p.data_start + std::min(b, end),
              "'" + name + "' starts at data byte " + std::to_string(b) + " where " + std::to_string(end) +
                  " was expected (the tensors' bytes must follow each other without gaps or overlaps)");
    end = e;
    p.file.tensors.emplace_back(name, t);
  }
  if (end != bytes.size() - p.data_start)
    corrupt(path, p.data_start + end,
            std::to_string(bytes.size() - p.data_start - end) + " bytes follow the last tensor's data");
  return p;
}

}  // namespace

void save_safetensors(const NamedTensors& tensors, const std::string& path,
                      const std::map<std::string, std::string>& metadata) {
  std::vector<std::pair<std::string, at::Tensor>> order;
  std::set<std::string> names;
  for (const auto& [name, t] : tensors) {
    DTRAIN_CHECK(t.defined(), "save_safetensors: the tensor '", name, "' is undefined");
    DTRAIN_CHECK(ckpt::safetensors_code(t.scalar_type()), "save_safetensors: '", name, "' is ", t.scalar_type(),
                 ", which safetensors has no code for (it has ", ckpt::safetensors_codes_text(), "): convert it first");
    DTRAIN_CHECK(name != "__metadata__" && names.insert(name).second, "save_safetensors: the name '", name,
                 "' is given twice or is reserved");
    order.emplace_back(name, t.detach().to(at::kCPU).contiguous());
  }
  std::stable_sort(order.begin(), order.end(), [](const auto& a, const auto& b) {
    const int oa = ckpt::safetensors_order(*ckpt::safetensors_code(a.second.scalar_type()));
    const int ob = ckpt::safetensors_order(*ckpt::safetensors_code(b.second.scalar_type()));
    return oa != ob ? oa > ob : a.first < b.first;
  });
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  uint64_t offset = 0;
  for (const auto& [name, t] : order) {
    const uint64_t n = static_cast<uint64_t>(t.numel()) * t.element_size();
    header[name] = {{"dtype", *ckpt::safetensors_code(t.scalar_type())},
                    {"shape", t.sizes().vec()},
                    {"data_offsets", {offset, offset + n}}};
    offset += n;
  }
  std::string h = header.dump();
  h.append((8 - h.size() % 8) % 8, ' ');
  std::string bytes(8, '\0');
  for (int k = 0; k < 8; ++k) bytes[static_cast<size_t>(k)] = static_cast<char>(uint64_t(h.size()) >> (8 * k));
  bytes.reserve(8 + h.size() + offset);
  bytes += h;
  for (const auto& [name, t] : order)
    bytes.append(static_cast<const char*>(t.data_ptr()), static_cast<size_t>(t.numel()) * t.element_size());
  ckpt::write_atomic(path, bytes);
}

void save_safetensors(const torch::nn::Module& module, const std::string& path,
                      const std::map<std::string, std::string>& metadata) {
  save_safetensors(named(module), path, metadata);
}

SafetensorsFile load_safetensors(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  DTRAIN_CHECK(f, "load_safetensors: cannot open ", path, ": ", std::strerror(errno));
  const std::string bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  return parse(path, bytes).file;
}

void load_safetensors(torch::nn::Module& module, const std::string& path) {
  SafetensorsFile file = load_safetensors(path);
  std::map<std::string, at::Tensor> in_file(file.tensors.begin(), file.tensors.end());
  std::vector<std::string> missing, unexpected, wrong;
  NamedTensors mine = named(module);
  std::set<std::string> mine_names;
  for (const auto& [name, t] : mine) {
    mine_names.insert(name);
    auto it = in_file.find(name);
    if (it == in_file.end())
      missing.push_back(name);
    else if (it->second.sizes() != t.sizes())
      wrong.push_back(name + " (" + c10::str(it->second.sizes()) + " in the file, " + c10::str(t.sizes()) + " here)");
  }
  for (const auto& [name, t] : file.tensors)
    if (!mine_names.count(name)) unexpected.push_back(name);
  auto list = [](const std::vector<std::string>& v) {
    std::string s;
    for (size_t k = 0; k < v.size() && k < 5; ++k) s += (k ? ", " : "") + v[k];
    return v.size() > 5 ? s + ", ... (" + std::to_string(v.size()) + ")" : s;
  };
  DTRAIN_CHECK(missing.empty() && unexpected.empty() && wrong.empty(), "load_safetensors: ", path,
               " does not fit the module:", missing.empty() ? "" : " missing in the file: " + list(missing) + ";",
               unexpected.empty() ? "" : " not in the module: " + list(unexpected) + ";",
               wrong.empty() ? "" : " other shapes: " + list(wrong) + ";", " save it from the same architecture");
  at::NoGradGuard no_grad;
  for (auto& [name, t] : mine) t.copy_(in_file.at(name));
}

}  // namespace dtrain
