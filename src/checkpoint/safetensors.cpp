// save_safetensors and load_safetensors (dtrain/safetensors.h).
//
// Layout: [u64 little-endian N][N bytes of JSON, padded with spaces to a multiple of 8][data]. The
// JSON maps each name to {"dtype", "shape", "data_offsets": [begin, end]} (offsets into the data),
// and "__metadata__" to string pairs. Tensors are laid out as Python's writer lays them out (by
// safetensors' dtype order, widest first, then by name), so that each starts aligned to its element
// size and the same tensors make the same file. The reader checks what safetensors' own validation
// checks (safetensors_header.h, torch-free): the ranges tile the data exactly, each as long as its
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
#include "checkpoint/safetensors_header.h"
#include "dtrain/errors.h"

namespace dtrain {

namespace {

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "safetensors' bytes are little-endian, as this host's");

NamedTensors named(const torch::nn::Module& module) {
  NamedTensors out;
  for (const auto& kv : module.named_parameters()) out.emplace_back(kv.key(), kv.value());
  for (const auto& kv : module.named_buffers()) out.emplace_back(kv.key(), kv.value());
  return out;
}

// The file's tensors, in the order of their data, once its header has passed every check
// (safetensors_header.h): each range is inside the data and as long as its shape and dtype say.
SafetensorsFile parse(const std::string& path, const std::string& bytes) {
  const ckpt::SafetensorsHeader h = ckpt::parse_safetensors_header(path, bytes, [](const std::string& code) {
    const auto dtype = ckpt::dtype_of_safetensors_code(code);
    return dtype ? c10::elementSize(*dtype) : size_t{0};
  });
  SafetensorsFile file;
  file.metadata = h.metadata;
  for (const ckpt::SafetensorsEntry& e : h.entries) {
    at::Tensor t = at::empty(e.shape, at::TensorOptions().dtype(*ckpt::dtype_of_safetensors_code(e.dtype)));
    if (e.end > e.begin) std::memcpy(t.data_ptr(), bytes.data() + h.data_start + e.begin, e.end - e.begin);
    file.tensors.emplace_back(e.name, t);
  }
  return file;
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
  // The header's text entry by entry, as ordered_json's dump() writes it: its operator[] searches
  // the keys before it, which made writing 80,000 tensors take 10 s.
  std::string h = "{";
  if (!metadata.empty()) h += "\"__metadata__\":" + nlohmann::ordered_json(metadata).dump();
  uint64_t offset = 0;
  for (const auto& [name, t] : order) {
    const uint64_t n = static_cast<uint64_t>(t.numel()) * t.element_size();
    const nlohmann::ordered_json entry = {{"dtype", *ckpt::safetensors_code(t.scalar_type())},
                                          {"shape", t.sizes().vec()},
                                          {"data_offsets", {offset, offset + n}}};
    h += (h.size() > 1 ? "," : "") + nlohmann::ordered_json(name).dump() + ":" + entry.dump();
    offset += n;
  }
  h += "}";
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
  return parse(path, bytes);
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
