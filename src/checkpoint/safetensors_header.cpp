// The safetensors header, read and checked (safetensors_header.h).
#include "checkpoint/safetensors_header.h"

#include <algorithm>
#include <cstdio>
#include <tuple>
#include <unordered_map>

#include <nlohmann/json.hpp>

#include "dtrain/errors.h"

namespace dtrain::ckpt {

namespace {

// safetensors' own limit on the header (safetensors/src/tensor.rs: MAX_HEADER_SIZE).
constexpr uint64_t kMaxSafetensorsHeader = 100'000'000;

[[noreturn]] void corrupt(const std::string& path, uint64_t at, const std::string& what) {
  throw Error("load_safetensors: " + path + " is not a valid safetensors file: " + what + " at byte " +
              std::to_string(at) + " (a truncated copy, or not a safetensors file)");
}

// A JSON value of the file for a message: its kind when it holds others (never dump()ed whole: that
// recurses once per level and copies all of it), else a bounded excerpt of its text.
std::string shown_value(const nlohmann::json& v) {
  if (v.is_array()) return "a list of " + std::to_string(v.size());
  if (v.is_object()) return "an object of " + std::to_string(v.size()) + " keys";
  return excerpt(v.dump());
}

// One pass over the header's JSON text, before the parser: how deep it nests, refused past
// kMaxSafetensorsDepth (at the bracket that goes too deep), and where each top-level key starts,
// for messages (the first place of a key given twice). One search of the header per key made
// reading 40,000 tensors take 42 s, and 80,000 173 s.
std::unordered_map<std::string, size_t> scan_header(const std::string& path, const std::string& header) {
  std::unordered_map<std::string, size_t> key_at;
  int depth = 0;
  bool expect_key = false;  // at depth 1, after '{' or ','
  for (size_t i = 0; i < header.size(); ++i) {
    const char c = header[i];
    if (c == '"') {
      size_t j = i + 1;
      while (j < header.size() && header[j] != '"') j += header[j] == '\\' ? 2 : 1;
      if (j >= header.size()) break;  // unterminated: the parser says where
      if (depth == 1 && expect_key) {
        std::string key = header.substr(i + 1, j - i - 1);
        if (key.find('\\') != std::string::npos) {
          try {
            key = nlohmann::json::parse(header.substr(i, j - i + 1)).get<std::string>();
          } catch (const nlohmann::json::exception&) {  // the parser says where
          }
        }
        key_at.emplace(std::move(key), i);
      }
      expect_key = false;
      i = j;
    } else if (c == '{' || c == '[') {
      if (++depth > kMaxSafetensorsDepth)
        corrupt(path, 8 + i,
                "the header nests deeper than " + std::to_string(kMaxSafetensorsDepth) +
                    " levels (a safetensors header nests 3)");
      expect_key = depth == 1;
    } else if (c == '}' || c == ']') {
      --depth;
    } else if (c == ',') {
      expect_key = depth == 1;
    } else if (c == ':') {
      expect_key = false;
    }
  }
  return key_at;
}

// One tensor's entry, checked against the size of the data that follows the header.
SafetensorsEntry read_entry(const std::string& path, uint64_t at, uint64_t data_size, const std::string& name,
                            const nlohmann::json& e, const ElementSize& element_size) {
  const std::string who = "'" + excerpt(name) + "'";
  if (!e.is_object() || !e.contains("dtype") || !e.contains("shape") || !e.contains("data_offsets"))
    corrupt(path, at, "the entry of " + who + " lacks dtype, shape or data_offsets");
  SafetensorsEntry out;
  out.name = name;
  if (!e["dtype"].is_string()) corrupt(path, at, "the dtype of " + who + " is not a string");
  out.dtype = e["dtype"].get<std::string>();
  const size_t esize = element_size(out.dtype);
  if (esize == 0) corrupt(path, at, who + " has the dtype " + excerpt(out.dtype) + ", which this LibTorch lacks");
  if (!e["shape"].is_array()) corrupt(path, at, "the shape of " + who + " is not a list");
  // The element count, saturating at 2^62 (each size is at most 2^48): no product wraps around.
  uint64_t numel = 1;
  for (const auto& d : e["shape"]) {
    if (!d.is_number_unsigned() || d.get<uint64_t>() > (uint64_t{1} << 48))
      corrupt(path, at, "the shape of " + who + " holds " + shown_value(d) + ", not a size");
    const uint64_t n = d.get<uint64_t>();
    out.shape.push_back(static_cast<int64_t>(n));
    numel = n == 0 ? 0 : (numel > (uint64_t{1} << 62) / n ? uint64_t{1} << 62 : numel * n);
  }
  const auto& o = e["data_offsets"];
  if (!o.is_array() || o.size() != 2 || !o[0].is_number_unsigned() || !o[1].is_number_unsigned())
    corrupt(path, at, "the data_offsets of " + who + " are not two offsets");
  out.begin = o[0].get<uint64_t>();
  out.end = o[1].get<uint64_t>();
  const std::string spans = who + " spans data bytes " + std::to_string(out.begin) + "-" + std::to_string(out.end) +
                            " of " + std::to_string(data_size);
  // numel * esize only once it is known to fit the data: it could wrap around to 0 bytes.
  if (numel > data_size / esize)
    corrupt(
        path, at,
        spans + ", but its shape and dtype take more than the file's " + std::to_string(data_size) + " bytes of data");
  const uint64_t want = numel * esize;
  if (out.begin > out.end || out.end > data_size || out.end - out.begin != want)
    corrupt(path, at, spans + ", but its shape and dtype take " + std::to_string(want));
  return out;
}

}  // namespace

std::string excerpt(const std::string& s, size_t max) {
  std::string out;
  for (size_t k = 0; k < s.size() && k < max; ++k) {
    const auto c = static_cast<unsigned char>(s[k]);
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '\n') {
      out += "\\n";
    } else if (c < 0x20 || c == 0x7f) {
      char hex[8];
      std::snprintf(hex, sizeof hex, "\\x%02x", c);
      out += hex;
    } else {
      out += static_cast<char>(c);
    }
  }
  if (s.size() > max) out += "... (" + std::to_string(s.size()) + " bytes)";
  return out;
}

SafetensorsHeader parse_safetensors_header(const std::string& path, const std::string& bytes,
                                           const ElementSize& element_size) {
  if (bytes.size() < 8)
    corrupt(path, 0, "the file is " + std::to_string(bytes.size()) + " bytes, less than its 8-byte header length");
  uint64_t n = 0;
  for (int k = 7; k >= 0; --k) n = n << 8 | static_cast<uint8_t>(bytes[static_cast<size_t>(k)]);
  if (n > kMaxSafetensorsHeader || n > bytes.size() - 8)
    corrupt(
        path, 0,
        "the header length " + std::to_string(n) + " runs past the file's " + std::to_string(bytes.size()) + " bytes");
  const std::string header = bytes.substr(8, n);
  if (header.empty() || header[0] != '{') corrupt(path, 8, "the header does not start with '{'");
  const std::unordered_map<std::string, size_t> key_at = scan_header(path, header);
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(header);
  } catch (const nlohmann::json::parse_error& e) {
    corrupt(path, 8 + (e.byte > 0 ? e.byte - 1 : 0), "its JSON header does not parse (" + excerpt(e.what(), 200) + ")");
  } catch (const nlohmann::json::exception& e) {  // a number out of range ("1e999"): no byte, the header's
    corrupt(path, 8, "its JSON header does not parse (" + excerpt(e.what(), 200) + ")");
  }
  SafetensorsHeader h;
  h.data_start = 8 + n;
  const uint64_t data_size = bytes.size() - h.data_start;
  for (auto it = j.begin(); it != j.end(); ++it) {
    const auto place = key_at.find(it.key());
    const uint64_t at = 8 + (place == key_at.end() ? 0 : place->second);
    if (it.key() == "__metadata__") {
      if (!it->is_object()) corrupt(path, at, "__metadata__ is not an object");
      for (auto m = it->begin(); m != it->end(); ++m) {
        if (!m->is_string()) corrupt(path, at, "__metadata__['" + excerpt(m.key()) + "'] is not a string");
        h.metadata[m.key()] = m->get<std::string>();
      }
      continue;
    }
    h.entries.push_back(read_entry(path, at, data_size, it.key(), *it, element_size));
  }
  std::sort(h.entries.begin(), h.entries.end(), [](const SafetensorsEntry& a, const SafetensorsEntry& b) {
    return std::tie(a.begin, a.end) < std::tie(b.begin, b.end);
  });
  uint64_t end = 0;
  for (const SafetensorsEntry& e : h.entries) {
    if (e.begin != end)
      corrupt(path, h.data_start + std::min(e.begin, end),
              "'" + excerpt(e.name) + "' starts at data byte " + std::to_string(e.begin) + " where " +
                  std::to_string(end) +
                  " was expected (the tensors' bytes must follow each other without gaps or overlaps)");
    end = e.end;
  }
  if (end != data_size)
    corrupt(path, h.data_start + end, std::to_string(data_size - end) + " bytes follow the last tensor's data");
  return h;
}

}  // namespace dtrain::ckpt
