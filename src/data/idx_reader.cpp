// IDX reader over zlib: gzread reads gzipped and plain files alike (zlib detects which).
#include "data/idx_reader.h"

#include <sys/stat.h>
#include <zlib.h>

#include <cerrno>
#include <cstring>
#include <memory>

#include "dtrain/errors.h"

namespace dtrain::data {

namespace {

// Largest value count accepted from a header (guards against absurd sizes in a corrupt file).
constexpr uint64_t kMaxIdxBytes = uint64_t{1} << 40;
// gzread takes an unsigned int length: read in chunks.
constexpr size_t kChunkBytes = size_t{1} << 24;

struct GzCloser {
  void operator()(gzFile_s* f) const { gzclose(f); }
};
using GzFile = std::unique_ptr<gzFile_s, GzCloser>;

class Reader {
 public:
  explicit Reader(const std::string& path) : path_(path) {
    struct stat st {};
    DTRAIN_CHECK(::stat(path.c_str(), &st) == 0, path, ": cannot open: ", std::strerror(errno));
    DTRAIN_CHECK(S_ISREG(st.st_mode), path, ": not a regular file");
    file_.reset(gzopen(path.c_str(), "rb"));
    DTRAIN_CHECK(file_ != nullptr, path, ": cannot open: ", std::strerror(errno));
    gzbuffer(file_.get(), 1 << 20);
  }

  // Reads up to n bytes into out; returns how many were read (fewer only at the end of the data).
  // A gzip stream that is corrupt (not merely cut short) throws.
  size_t read(uint8_t* out, size_t n) {
    size_t got = 0;
    while (got < n) {
      const auto want = static_cast<unsigned>(std::min(n - got, kChunkBytes));
      const int r = gzread(file_.get(), out + got, want);
      if (r < 0) {
        int code = 0;
        const char* msg = gzerror(file_.get(), &code);
        if (code == Z_BUF_ERROR) break;  // ends in the middle of the gzip stream: truncated
        throw Error(detail::cat(path_, ": corrupt gzip data: ", msg));
      }
      got += static_cast<size_t>(r);
      if (static_cast<unsigned>(r) < want) {
        int code = 0;
        const char* msg = gzerror(file_.get(), &code);
        if (code != Z_OK && code != Z_BUF_ERROR) {
          throw Error(detail::cat(path_, ": corrupt gzip data: ", msg));
        }
        break;
      }
    }
    return got;
  }

  // "(the gzip stream ends early)" when zlib saw a cut-short stream, else "".
  std::string gzip_note() {
    int code = 0;
    gzerror(file_.get(), &code);
    return code == Z_BUF_ERROR ? " (the gzip stream ends early)" : "";
  }

 private:
  std::string path_;
  GzFile file_;
};

uint32_t big_endian(const uint8_t* p) {
  return (uint32_t{p[0]} << 24) | (uint32_t{p[1]} << 16) | (uint32_t{p[2]} << 8) | uint32_t{p[3]};
}

std::string describe_magic(uint32_t magic) {
  if (magic == kIdxImagesMagic) return "2051 (an IDX images file)";
  if (magic == kIdxLabelsMagic) return "2049 (an IDX labels file)";
  return std::to_string(magic);
}

}  // namespace

IdxArray read_idx(const std::string& path, uint32_t expected_magic, const char* what, std::optional<size_t> max_items) {
  Reader in(path);

  // Header: magic, then one uint32 per dimension.
  uint8_t head[4];
  const size_t got_head = in.read(head, 4);
  DTRAIN_CHECK(got_head == 4, path, ": truncated: expected a 4-byte IDX header, got ", got_head, " bytes",
               in.gzip_note());
  const uint32_t magic = big_endian(head);
  DTRAIN_CHECK(magic == expected_magic, path, ": not an IDX file of the expected kind: magic number ",
               describe_magic(magic), ", expected ", describe_magic(expected_magic));
  const size_t ndims = head[3];

  IdxArray out;
  std::vector<uint8_t> dims_raw(4 * ndims);
  const size_t got_dims = in.read(dims_raw.data(), dims_raw.size());
  DTRAIN_CHECK(got_dims == dims_raw.size(), path, ": truncated: expected ", dims_raw.size(),
               " bytes of dimensions, got ", got_dims, in.gzip_note());
  uint64_t item_bytes = 1;
  for (size_t d = 0; d < ndims; ++d) {
    out.dims.push_back(big_endian(&dims_raw[4 * d]));
    if (d > 0) {
      DTRAIN_CHECK(out.dims[d] > 0, path, ": corrupt header: dimension ", d, " is 0");
      item_bytes *= out.dims[d];
      DTRAIN_CHECK(item_bytes <= kMaxIdxBytes, path, ": corrupt header: items of ", item_bytes, "+ bytes");
    }
  }
  const uint64_t count = out.dims[0];
  DTRAIN_CHECK(count * item_bytes <= kMaxIdxBytes, path, ": corrupt header: ", count, " items of ", item_bytes,
               " bytes");

  // Values: all of them, or the first max_items items.
  out.items = max_items ? std::min<size_t>(*max_items, count) : count;
  const size_t want = out.items * item_bytes;
  out.data.resize(want);
  const size_t got = in.read(out.data.data(), want);
  DTRAIN_CHECK(got == want, path, ": truncated: expected ", want, " bytes of ", what, ", got ", got, in.gzip_note());
  if (out.items == count) {
    uint8_t extra[4096];
    const size_t more = in.read(extra, sizeof(extra));
    DTRAIN_CHECK(more == 0, path, ": corrupt: ", more == sizeof(extra) ? "4096+" : std::to_string(more),
                 " unexpected bytes after the ", count, " items the header announces");
  }
  return out;
}

}  // namespace dtrain::data
