// Sharded checkpoints, the load side: which rows each saved shard file holds (the layout it
// records), which files a rank reads its target rows from, and the reading of those files
// (Note [Sharded checkpoints] in sharded.cpp).
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/serialize/archive.h>

namespace dtrain::ckpt {

// Rows [lo, hi) of the sharded dimension that group rank g of n holds of a parameter of `rows` rows
// along it (FSDP2's and DTensor's layout: chunks of ceil(rows / n); the ranks past the end hold none).
// "Rows" below are indices along the parameter's sharded dimension: dim 0 under fully_shard, dim 0 or
// 1 under tensor parallelism.
std::pair<int64_t, int64_t> rows_of(int64_t rows, int64_t g, int64_t n);

// Which rows a shard holds: the rank inside the group its parameter is sharded over, the group's
// size and the sharded dimension (a model without shards: rank 0 of 1, all rows).
struct ShardGroup {
  int64_t rank = 0, size = 1, dim = 0;
  bool operator==(const ShardGroup& o) const { return rank == o.rank && size == o.size && dim == o.dim; }
  bool operator!=(const ShardGroup& o) const { return !(*this == o); }
};
// A shard file's group per sharded parameter, in the order of the save's sharded parameters.
using FileLayout = std::vector<ShardGroup>;
// Runs of parameters alike, "<rank>/<size>[@<dim>]*<count>", space-separated: "0/2*9" (nine
// parameters, each rank 0's rows of a group of 2), "1/2@1*1" (rank 1's columns: dim 1; format 3).
std::string encode_layout(const FileLayout& layout);
// Throws naming `file` when `text` is not encode_layout's.
FileLayout decode_layout(const std::string& text, const std::string& file);

at::Tensor read_tensor(torch::serialize::InputArchive& a, const std::string& key, const std::string& file);
std::string read_string(torch::serialize::InputArchive& a, const std::string& key, const std::string& file);

// Per optimizer parameter (in param_groups order), its state's values by name; empty: no state.
using SavedState = std::vector<std::map<std::string, c10::IValue>>;

// One saved rank's shard file.
struct SavedShard {
  std::string file;
  std::map<std::string, at::Tensor> rows;  // parameter name -> the rows it held
  std::vector<std::string> opt_names;      // per optimizer parameter: its model name ("" if none)
  std::optional<torch::serialize::InputArchive> optimizer;
  SavedState opt_state;
};

// The shard files of one save, as its main file records them; each is read on first use.
class SavedShards {
 public:
  // From the main file's archive: "shards" (each file's header line), "shard_layouts" (each file's
  // encode_layout) and "shard_names" (the sharded parameters). A file saved before layouts were
  // recorded (over the world only) has none of the last two: file r holds rank r's rows of the
  // saved world, and the names come from file 0.
  SavedShards(torch::serialize::InputArchive& main, const std::string& main_path);
  int64_t count() const { return static_cast<int64_t>(files_.size()); }
  // The save's sharded parameters.
  const std::vector<std::string>& names() const { return names_; }
  // Which rows file k holds of the save's sharded parameter number p (in names()).
  const ShardGroup& group(int64_t k, size_t p) const { return files_[static_cast<size_t>(k)].layout[p]; }
  SavedShard& at(int64_t k);
  // The lowest-numbered file read so far; file 0 if none was.
  SavedShard& any_read();

 private:
  struct File {
    std::string path, header;
    FileLayout layout;
    bool recorded = false;  // the main file recorded its layout (the file then records it too)
  };
  SavedShard read(const File& f);
  std::vector<File> files_;
  std::vector<std::string> names_;
  std::vector<std::unique_ptr<SavedShard>> cache_;
};

// This rank's target rows of a parameter: its own under fully_shard or tensor parallelism (over its
// own group), all of them otherwise (counted along the dimension the save sharded).
struct Target {
  std::string name;
  std::vector<int64_t> shape;  // whole (a 0-dim parameter as one row)
  ShardGroup group;            // group.dim: the dimension of the rows
  int64_t lo = 0, hi = 0;
};

// Rows [lo, hi) of the whole parameter, taken from saved file `file`, which holds rows
// [file_lo, file_hi).
struct Piece {
  int64_t file = 0, lo = 0, hi = 0, file_lo = 0, file_hi = 0;
};

// The files to read t's rows from (t is the save's sharded parameter number p): a file that holds
// the same rows by the same group (this rank's own file `own` first, else the lowest), or else the
// rows covered left to right, each time from the file whose rows reach furthest (the lowest on a
// tie): files that hold the same rows (replicas) are read once. No rows: none.
std::vector<Piece> plan_pieces(const SavedShards& saved, size_t p, const Target& t, int64_t own);

// t's rows assembled from `pieces`; `of` picks the tensor out of a saved file (its rows, or a state
// tensor of their shape). No pieces: an empty tensor of `options`.
at::Tensor assemble(SavedShards& saved, const Target& t, const std::vector<Piece>& pieces,
                    const at::TensorOptions& options, const std::function<at::Tensor(SavedShard&)>& of);

}  // namespace dtrain::ckpt
