// The order of a checkpoint folder's writes (Note [Write order]): each file's write stamp, read
// from its header, orders the folder's checkpoints by when they were written, not by their steps.
//
//   std::vector<ckpt::Found> files = ckpt::scan(dir, "checkpoint");  // oldest write first
//   int64_t stamp = ckpt::next_write_stamp(files);                   // the next write's
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace dtrain::ckpt {

struct Found {
  std::string path;
  int64_t step = 0;
  std::optional<int64_t> stamp;  // nullopt: the header cannot be read (why says why)
  std::string why;
};

// `dir`'s <prefix>_<10 digits>.pt regular files, oldest write first; a file whose stamp cannot be read,
// or lies more than a week ahead of this host's clock, has none and comes first.
std::vector<Found> scan(const std::string& dir, const std::string& prefix);
// The stamp of a write into a folder that holds `found`.
int64_t next_write_stamp(const std::vector<Found>& found);
// The file of the highest step among `found` (older writes) other than `path`, when that step is
// above `step`; null otherwise.
const Found* later_step(const std::vector<Found>& found, const std::string& path, int64_t step);

}  // namespace dtrain::ckpt
