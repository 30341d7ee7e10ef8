// dcp::save and dcp::load (dtrain/dcp.h): the folder layout of PyTorch's FileSystemWriter, its
// metadata through dcp_metadata.h, each item a torch.save archive (LibTorch's pickle_save writes
// the zip format torch.load reads, and pickle_load reads torch.save's).
#include "dtrain/dcp.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <algorithm>
#include <cstring>
#include <filesystem>
#include <map>
#include <random>
#include <sstream>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/csrc/jit/serialization/pickle.h>

#include "checkpoint/agree.h"
#include "checkpoint/dcp_metadata.h"
#include "checkpoint/dcp_phases.h"
#include "checkpoint/dcp_plan.h"
#include "checkpoint/file_io.h"
#include "checkpoint/zip_crc.h"
#include "dtrain/errors.h"

namespace dtrain::dcp {

using detail::Item;
using detail::Metadata;
using detail::PlanItem;
using detail::Shape;
using detail::StorageInfo;

namespace {

constexpr const char* kMetadataFile = ".metadata";

std::string data_file(int rank) { return "__" + std::to_string(rank) + "_0.distcp"; }

std::string random_id() {
  std::random_device rd;
  std::ostringstream s;
  s << std::hex << rd() << rd() << rd() << rd();
  return s.str();
}

// A tensor as its own torch.save archive: contiguous, on the CPU, and no more storage than it shows
// (pickle_save writes a view's whole storage).
std::vector<char> archive_of(const at::Tensor& t) {
  at::Tensor c = t.detach().to(at::kCPU).contiguous();
  if (c.storage_offset() != 0 || c.storage().nbytes() != static_cast<size_t>(c.numel() * c.element_size()))
    c = c.clone();
  return torch::jit::pickle_save(c);
}

// This rank's file: the items it was given, back to back; where each went.
std::vector<std::pair<size_t, StorageInfo>> write_items(const StateDict& sd, const std::vector<PlanItem>& plan,
                                                        const std::vector<size_t>& mine, const std::string& dir,
                                                        int rank) {
  std::vector<std::pair<size_t, StorageInfo>> where;
  if (mine.empty()) return where;
  std::string bytes;
  for (size_t k : mine) {
    const Entry& e = sd[static_cast<size_t>(plan[k].entry)];
    const std::vector<char> a = e.is_tensor() ? archive_of(e.tensor) : torch::jit::pickle_save(e.value);
    where.push_back(
        {k, StorageInfo{data_file(rank), static_cast<int64_t>(bytes.size()), static_cast<int64_t>(a.size())}});
    bytes.append(a.data(), a.size());
  }
  ckpt::write_atomic(dir + "/" + data_file(rank), bytes);
  return where;
}

std::string encode_written(const std::vector<std::pair<size_t, StorageInfo>>& w) {
  std::string out;
  for (const auto& [k, info] : w)
    out += std::to_string(k) + " " + std::to_string(info.offset) + " " + std::to_string(info.length) + "\n";
  return out;
}

std::vector<std::pair<size_t, StorageInfo>> decode_written(const std::string& text, int rank) {
  std::vector<std::pair<size_t, StorageInfo>> w;
  std::istringstream in(text);
  size_t k;
  int64_t offset, length;
  while (in >> k >> offset >> length) w.push_back({k, StorageInfo{data_file(rank), offset, length}});
  return w;
}

}  // namespace

}  // namespace dtrain::dcp

namespace dtrain::dcp::detail {

SaveInProgress::SaveInProgress(StateDict state_dict, std::string dir, Group group)
    : sd_(std::move(state_dict)), dir_(std::move(dir)), group_(std::move(group)) {
  const int me = group_.rank();
  // 1.
  ckpt::throw_first_failure(me == 0 ? ckpt::failure_of([&] {
                              std::filesystem::create_directories(dir_);
                              std::filesystem::remove(dir_ + "/" + kMetadataFile);
                            })
                                    : "",
                            group_, "dcp::save: preparing " + dir_ + ": ");
  // 2.
  ckpt::throw_first_failure(ckpt::failure_of([&] { plan_ = plan_of(sd_); }), group_, "dcp::save: ");
  for (const std::string& p : all_gather_bytes(encode_plan(plan_), group_)) plans_.push_back(decode_plan(p));
  drop_overlapping_chunks(plans_);  // the same answer, or the same error, everywhere
  mine_ = assign_writers(plans_)[static_cast<size_t>(me)];
}

void SaveInProgress::write() noexcept {
  // 3.
  error_ = ckpt::failure_of([&] { written_ = write_items(sd_, plan_, mine_, dir_, group_.rank()); });
}

void SaveInProgress::finish() {
  ckpt::throw_first_failure(error_, group_, "dcp::save: ");
  const auto all_written = gather_bytes(encode_written(written_), group_.ranks()[0], group_);
  std::string failure;
  if (group_.rank() == 0) {
    failure = ckpt::failure_of([&] {
      std::vector<std::vector<std::pair<size_t, StorageInfo>>> w;
      for (size_t r = 0; r < all_written.size(); ++r) w.push_back(decode_written(all_written[r], static_cast<int>(r)));
      Metadata m = metadata_of(plans_, w);
      m.checkpoint_id = dir_;
      m.save_id = random_id();
      ckpt::write_atomic(dir_ + "/" + kMetadataFile, encode(m));
    });
  }
  // 4.
  ckpt::throw_first_failure(failure, group_, "dcp::save: ");
}

}  // namespace dtrain::dcp::detail

namespace dtrain::dcp {

void save(const StateDict& state_dict, const std::string& dir, const Group& group) {
  detail::SaveInProgress save(state_dict, dir, group);
  save.write();
  save.finish();
}

namespace {

// The stored items a load reads: one open file per name, each item's bytes checked against the file.
class Reader {
 public:
  explicit Reader(std::string dir) : dir_(std::move(dir)) {}
  ~Reader() {
    for (auto& [name, fd] : fds_) close(fd);
  }
  std::vector<char> bytes(const Item& item) {
    const std::string& name = item.storage.relative_path;
    DTRAIN_CHECK(!name.empty() && name.find('/') == std::string::npos && name != "." && name != "..", "the item '",
                 item.fqn, "' is stored in '", name, "', not a file of the checkpoint's folder");
    const std::string path = dir_ + "/" + name;
    auto it = fds_.find(name);
    if (it == fds_.end()) it = fds_.emplace(name, ckpt::open_regular(path, "it holds '" + item.fqn + "'")).first;
    struct stat st {};
    fstat(it->second, &st);
    // decode() keeps offset + length from overflowing.
    DTRAIN_CHECK(item.storage.offset + item.storage.length <= st.st_size, path, " is truncated: '", item.fqn,
                 "' is stored at bytes ", item.storage.offset, "-", item.storage.offset + item.storage.length,
                 " but the file has ", st.st_size);
    std::vector<char> out(static_cast<size_t>(item.storage.length));
    size_t got = 0;
    while (got < out.size()) {
      const ssize_t n =
          pread(it->second, out.data() + got, out.size() - got, item.storage.offset + static_cast<off_t>(got));
      DTRAIN_CHECK(n > 0, "cannot read ", path, ": ", n < 0 ? std::strerror(errno) : "end of file");
      got += static_cast<size_t>(n);
    }
    return out;
  }
  c10::IValue ivalue(const Item& item) {
    const std::string where = "the item '" + item.fqn + "' in " + dir_ + "/" + item.storage.relative_path +
                              " at byte " + std::to_string(item.storage.offset);
    const std::vector<char> b = bytes(item);
    // LibTorch's zip reader skips the CRC-32s (a flipped byte would load as a wrong number).
    try {
      ckpt::check_zip_crcs(b.data(), b.size());
    } catch (const Error& e) {
      throw Error(where + " is damaged (" + e.what() +
                  "): the file changed after it was written; load another checkpoint or restore this one from a copy");
    }
    try {
      return torch::jit::pickle_load(b);
    } catch (const c10::Error& e) {
      throw Error(where + " is not a torch.save archive: " + e.what_without_backtrace());
    }
  }

 private:
  std::string dir_;
  std::map<std::string, int> fds_;
};

Metadata read_metadata(const std::string& dir) {
  const std::string path = dir + "/" + kMetadataFile;
  struct stat st {};
  DTRAIN_CHECK(lstat(path.c_str(), &st) == 0 || errno != ENOENT, "no checkpoint at ", dir, ": ", path,
               " is missing (a save that did not finish, or another folder)");
  const int fd = ckpt::open_regular(path, "the checkpoint's metadata");
  std::string bytes;
  char buf[1 << 16];
  for (ssize_t n; (n = read(fd, buf, sizeof buf)) != 0;) {
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const int err = errno;
      close(fd);
      throw Error("cannot read " + path + ": " + std::strerror(err));
    }
    bytes.append(buf, static_cast<size_t>(n));
  }
  close(fd);
  try {
    return detail::decode(bytes);
  } catch (const Error& e) {
    throw Error(path + ": " + e.what());
  }
}

// One copy a load makes: `from`'s overlap into `to`'s, both views.
struct Copy {
  at::Tensor to, from;
};

// The copies that fill one tensor entry from the stored chunks overlapping it.
void plan_copies(const Entry& e, const detail::TensorMeta& t,
                 const std::map<std::pair<std::string, Shape>, const Item*>& index, Reader& reader,
                 std::vector<Copy>& copies) {
  const std::string key = e.key();
  const Shape sizes = e.tensor.sizes().vec();
  const Shape offsets = e.global_shape.empty() ? Shape(sizes.size(), 0) : e.offsets;
  int64_t covered = 0;
  for (const auto& c : t.chunks) {
    // The chunk fits the tensor (decode checked it), and so does this entry (prepare_load).
    const auto part = detail::overlap(c, offsets, sizes);
    if (!part) continue;
    const auto& [lo, hi] = *part;
    int64_t volume = 1;
    for (size_t d = 0; d < sizes.size(); ++d) volume *= hi[d] - lo[d];
    // Chunks that overlap would be read beyond what this entry holds; stop before reading more.
    covered += volume;
    DTRAIN_CHECK(covered <= e.tensor.numel(), "the stored chunks of '", key, "' overlap: those up to the one at ",
                 detail::dims_text(c.offsets), " cover ", covered, " of the ", e.tensor.numel(),
                 " elements this rank loads");
    auto it = index.find({key, c.offsets});
    DTRAIN_CHECK(it != index.end(), "the chunk of '", key, "' at ", detail::dims_text(c.offsets),
                 " has no stored item");
    const c10::IValue v = reader.ivalue(*it->second);
    DTRAIN_CHECK(v.isTensor() && v.toTensor().sizes().vec() == c.sizes, "the stored chunk of '", key, "' at ",
                 detail::dims_text(c.offsets), " is not a tensor of sizes ", detail::dims_text(c.sizes));
    at::Tensor from = v.toTensor(), to = e.tensor;
    for (size_t d = 0; d < sizes.size(); ++d) {
      from = from.narrow(static_cast<int64_t>(d), lo[d] - c.offsets[d], hi[d] - lo[d]);
      to = to.narrow(static_cast<int64_t>(d), lo[d] - offsets[d], hi[d] - lo[d]);
    }
    copies.push_back({to, from});
  }
  DTRAIN_CHECK(covered == e.tensor.numel(), "the stored chunks of '", key, "' cover ", covered, " of the ",
               e.tensor.numel(), " elements this rank loads");
}

// What a load changes, read in full before any of it is applied.
struct Prepared {
  std::vector<Copy> copies;
  std::vector<std::pair<Entry*, c10::IValue>> values;
};

Prepared prepare_load(StateDict& sd, const std::string& dir) {
  const Metadata m = read_metadata(dir);
  // Every key first: present, of the same kind and whole shape, before anything changes.
  for (const Entry& e : sd) {
    const std::string key = e.key();
    if (!e.is_tensor()) {
      DTRAIN_CHECK(std::find(m.values.begin(), m.values.end(), key) != m.values.end(), "'", key,
                   "' is not a value in the checkpoint at ", dir,
                   m.tensors.count(key) ? " (it is a tensor there)" : " (no such key there)");
      continue;
    }
    auto t = m.tensors.find(key);
    DTRAIN_CHECK(t != m.tensors.end(), "'", key, "' is not a tensor in the checkpoint at ", dir, " (", m.tensors.size(),
                 " tensors there", m.tensors.empty() ? "" : ", e.g. '" + m.tensors.begin()->first + "'", ")");
    const Shape whole = e.global_shape.empty() ? e.tensor.sizes().vec() : e.global_shape;
    DTRAIN_CHECK(whole == t->second.size, "'", key, "' is ", detail::dims_text(t->second.size),
                 " in the checkpoint at ", dir, " but ", detail::dims_text(whole), " here");
    if (!e.global_shape.empty()) {  // a chunk (Entry::chunk): inside its whole, as a stored chunk is
      const Shape sizes = e.tensor.sizes().vec();
      bool fits = e.offsets.size() == whole.size() && sizes.size() == whole.size();
      for (size_t d = 0; fits && d < whole.size(); ++d)
        fits = e.offsets[d] >= 0 && e.offsets[d] <= whole[d] && sizes[d] <= whole[d] - e.offsets[d];
      DTRAIN_CHECK(fits, "the entry '", key, "' is a chunk of sizes ", detail::dims_text(sizes), " at offsets ",
                   detail::dims_text(e.offsets), " of ", detail::dims_text(whole),
                   ", which does not fit: give one offset per dimension, with offset + size <= the dimension");
    }
  }
  std::map<std::pair<std::string, Shape>, const Item*> chunk_index;
  std::map<std::string, const Item*> value_index;
  for (const Item& item : m.items) {
    if (item.offsets)
      chunk_index[{item.fqn, *item.offsets}] = &item;
    else
      value_index[item.fqn] = &item;
  }
  // Then every piece read; load() copies them once every rank has read its own.
  Reader reader(dir);
  Prepared p;
  for (Entry& e : sd) {
    const std::string key = e.key();
    if (e.is_tensor()) {
      plan_copies(e, m.tensors.at(key), chunk_index, reader, p.copies);
    } else {
      auto it = value_index.find(key);
      DTRAIN_CHECK(it != value_index.end(), "the value '", key, "' has no stored item in ", dir);
      p.values.push_back({&e, reader.ivalue(*it->second)});
    }
  }
  return p;
}

}  // namespace

void load(StateDict& state_dict, const std::string& dir, const Group& group) {
  // All or nothing on every rank: a failure anywhere leaves every rank's state dict as it was.
  Prepared p;
  ckpt::throw_first_failure(ckpt::failure_of([&] { p = prepare_load(state_dict, dir); }), group, "dcp::load: ");
  at::NoGradGuard no_grad;
  for (Copy& c : p.copies) c.to.copy_(c.from);
  for (auto& [e, v] : p.values) e->value = std::move(v);
}

std::string flat_key(const Path& path) {
  std::string s;
  for (const auto& e : path)
    s += (s.empty() ? "" : ".") +
         (std::holds_alternative<int64_t>(e) ? std::to_string(std::get<int64_t>(e)) : std::get<std::string>(e));
  return s;
}

Entry Entry::whole(Path path, at::Tensor tensor) {
  Entry e;
  e.path = std::move(path);
  e.tensor = std::move(tensor);
  return e;
}

Entry Entry::chunk(Path path, at::Tensor tensor, std::vector<int64_t> global_shape, std::vector<int64_t> offsets) {
  Entry e = whole(std::move(path), std::move(tensor));
  e.global_shape = std::move(global_shape);
  e.offsets = std::move(offsets);
  return e;
}

Entry Entry::of_value(Path path, c10::IValue value) {
  Entry e;
  e.path = std::move(path);
  e.value = std::move(value);
  return e;
}

}  // namespace dtrain::dcp
