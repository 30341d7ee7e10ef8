// Reading IDX files (the MNIST / Fashion-MNIST format), gzipped or plain. Torch-free.
//
// Format (big-endian): magic = 0x00 0x00 <type> <ndims>, then ndims uint32 sizes, then the values
// row-major. dtrain reads unsigned bytes (type 0x08) only: images have magic 2051 (3 dims: N, rows,
// cols), labels 2049 (1 dim: N).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace dtrain::data {

constexpr uint32_t kIdxImagesMagic = 2051;  // 0x00000803: ubyte, 3 dims
constexpr uint32_t kIdxLabelsMagic = 2049;  // 0x00000801: ubyte, 1 dim

struct IdxArray {
  std::vector<uint32_t> dims;  // dims[0] = number of items as stored in the header
  std::vector<uint8_t> data;   // min(dims[0], max_items) items, row-major
  size_t items = 0;            // items in data
};

// Reads `path` (gzip or plain, detected by zlib). Checks the magic number against
// `expected_magic`, and that the file holds every byte the header promises (with max_items, only
// the first max_items items are read, and only their bytes are checked). `what` names the values
// in messages ("pixels", "labels"). Throws dtrain::Error, one line starting with the path:
//   "/x/train-images-idx3-ubyte.gz: truncated: expected 47040000 bytes of pixels, got 1234"
IdxArray read_idx(const std::string& path, uint32_t expected_magic, const char* what,
                  std::optional<size_t> max_items = std::nullopt);

}  // namespace dtrain::data
