// The `.metadata` file of PyTorch's distributed checkpoint (DCP) format, as plain structs, and its
// pickle of torch.distributed.checkpoint.metadata's dataclasses both ways (pickle.h). Torch-free, so
// that the fuzz target of decode() builds without LibTorch.
//
// A checkpoint folder holds `.metadata` and one `__<rank>_0.distcp` per rank that wrote. Each stored
// item is a torch.save archive at (offset, length) in one of those files: a tensor chunk, or any
// other value (BytesStorageMetadata). A tensor is known by its whole size and its chunks (offsets
// and sizes within the whole); MetadataIndex(fqn, chunk offsets) finds a chunk's storage.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace dtrain::dcp::detail {

using Shape = std::vector<int64_t>;

// One element of a key's path in the nested state dict: ('optim', 'param_groups', 0, 'lr').
struct PathElem {
  bool is_int = false;
  int64_t i = 0;
  std::string s;
};
using Path = std::vector<PathElem>;
// The flattened key: the elements joined by '.' ("optim.param_groups.0.lr"), as DCP flattens.
std::string join(const Path& path);

// "[4, 6]", for a message: at most 8 sizes, then "... (450 dimensions)", so that a file's shape of any
// rank stays a short line.
std::string dims_text(const Shape& s);

struct Chunk {
  Shape offsets, sizes;
};

struct TensorMeta {
  std::string dtype;  // torch's attribute name: "float32", "bfloat16", "int64", ...
  bool requires_grad = false;
  Shape size;
  std::vector<Chunk> chunks;
};

struct StorageInfo {
  std::string relative_path;  // "__<rank>_0.distcp"
  int64_t offset = 0, length = 0;
};

// Where one stored item is: the key, the chunk's offsets (tensors only), and its storage.
struct Item {
  std::string fqn;
  std::optional<Shape> offsets;  // none: a non-tensor value
  StorageInfo storage;
};

struct Metadata {
  std::map<std::string, TensorMeta> tensors;  // by key
  std::vector<std::string> values;            // keys of non-tensor values
  std::map<std::string, Path> paths;          // planner_data: each key's path
  std::vector<Item> items;
  std::string version = "1.0.0";
  std::string checkpoint_id, save_id;  // StorageMeta's (the folder; a random id per save)
};

// The part of the chunk `c` inside the box of `sizes` at `offsets` (a tensor entry a load fills):
// [first, second) per dimension, or nullopt when it holds none of the box's elements (a
// 0-dimensional chunk and box share their one element). Both must have the rank of the tensor and
// lie inside it (decode() checks every chunk of a file so), which keeps the sums from overflowing.
std::optional<std::pair<Shape, Shape>> overlap(const Chunk& c, const Shape& offsets, const Shape& sizes);

// The pickle of `m` (protocol 2), as torch.distributed.checkpoint's FileSystemWriter writes it.
std::string encode(const Metadata& m);
// Reads a `.metadata` pickle. Throws dtrain::Error with the reason (the caller names the file): not
// a pickle, or a pickle that is not DCP's metadata ("state_dict_metadata['fc.weight'] is a list,
// not TensorStorageMetadata"), or geometry no writer makes: a chunk of another rank than its tensor
// or outside it, a chunk listed twice, a stored item whose end is past the largest file offset, or
// two items in the same bytes of a file: a load computes with what it returns as it is.
Metadata decode(const std::string& bytes);

}  // namespace dtrain::dcp::detail
