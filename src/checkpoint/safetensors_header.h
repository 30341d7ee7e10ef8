// The header of a safetensors file (dtrain/safetensors.h), read and checked without LibTorch, so that
// its fuzz target (tests/fuzz/) builds alone: what load_safetensors trusts before it allocates a
// tensor or copies a byte.
//
// Layout: [u64 little-endian N][N bytes of JSON][data]. The JSON maps each name to {"dtype", "shape",
// "data_offsets": [begin, end]} (offsets into the data), and "__metadata__" to string pairs. The
// checks are safetensors' own validation: every entry complete, its range as long as its shape and
// dtype say, and the ranges tiling the data exactly. Every refusal is one line that names the file
// and the byte, and shows what the file holds only as a bounded excerpt.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

namespace dtrain::ckpt {

struct SafetensorsEntry {
  std::string name;
  std::string dtype;  // safetensors' code: "F32", "BF16", ...
  std::vector<int64_t> shape;
  uint64_t begin = 0, end = 0;  // its bytes in the data
};

struct SafetensorsHeader {
  std::vector<SafetensorsEntry> entries;  // in the order of their data
  std::map<std::string, std::string> metadata;
  uint64_t data_start = 0;  // 8 + N
};

// The bytes one element of a dtype code takes, or 0 where this build has no such dtype.
using ElementSize = std::function<size_t(const std::string& code)>;

// No header nests deeper (its entries' lists nest 3 levels): checked in one pass before the JSON
// parser runs, so that nothing after it walks a deeper value.
constexpr int kMaxSafetensorsDepth = 64;

// Reads and checks the header of `bytes`, the whole file at `path` (named in the messages). Throws
// dtrain::Error "load_safetensors: <path> is not a valid safetensors file: <what> at byte <n> (...)".
// Time and memory are linear in the file.
SafetensorsHeader parse_safetensors_header(const std::string& path, const std::string& bytes,
                                           const ElementSize& element_size);

// `s` for a message: at most `max` bytes of it, control characters and backslashes escaped, then
// "... (N bytes)" when it is longer, so that a file's text stays one short line.
std::string excerpt(const std::string& s, size_t max = 64);

}  // namespace dtrain::ckpt
