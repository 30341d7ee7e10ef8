// Checkpoint framing: the header line and the CRC-32 (see frame.h).
#include "checkpoint/frame.h"

#include <zlib.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <sstream>

#include "dtrain/errors.h"

namespace dtrain::ckpt {

uint32_t crc32_of(const std::string& bytes) {
  uLong crc = crc32(0L, Z_NULL, 0);
  const auto* p = reinterpret_cast<const Bytef*>(bytes.data());
  size_t left = bytes.size();
  while (left > 0) {  // zlib's length is a uInt: feed it in chunks
    const uInt n = static_cast<uInt>(std::min<size_t>(left, 1u << 30));
    crc = crc32(crc, p, n);
    p += n;
    left -= n;
  }
  return static_cast<uint32_t>(crc);
}

namespace {

constexpr const char* kMagic = "DTRAIN-CHECKPOINT";

struct Header {
  size_t eol = 0;  // where its newline is
  size_t length = 0;
  std::string crc_hex;
  int64_t write_stamp = 0;  // 0: written before stamps existed
};

// Throws dtrain::Error with the reason for a header line that cannot be read. Readers of the four
// fields of format version 1 skip the fifth (the write stamp), so files stay version 1 both ways.
Header parse_header(const std::string& bytes) {
  Header h;
  h.eol = bytes.find('\n');
  DTRAIN_CHECK(
      bytes.compare(0, std::strlen(kMagic), kMagic) == 0 && h.eol != std::string::npos && h.eol < kMaxHeaderBytes,
      "not a dtrain checkpoint (no \"", kMagic, "\" header line)");
  std::istringstream header(bytes.substr(std::strlen(kMagic), h.eol - std::strlen(kMagic)));
  int version = 0;
  header >> version >> h.length >> h.crc_hex;
  DTRAIN_CHECK(!header.fail() && h.crc_hex.size() == 8, "malformed header line");
  DTRAIN_CHECK(version >= 1 && version <= kNewestFrameVersion, "format version ", version,
               " is not supported (this dtrain reads versions 1 to ", kNewestFrameVersion, ")");
  long long stamp = 0;
  if (header >> stamp) h.write_stamp = stamp;
  DTRAIN_CHECK(h.write_stamp >= 0, "malformed header line (write stamp ", h.write_stamp, ")");
  return h;
}

}  // namespace

int64_t header_write_stamp(const std::string& head) { return parse_header(head).write_stamp; }

std::string frame(const std::string& payload, int64_t write_stamp, int version) {
  char header[kMaxHeaderBytes];
  std::snprintf(header, sizeof header, "%s %d %zu %08x %lld\n", kMagic, version, payload.size(), crc32_of(payload),
                static_cast<long long>(write_stamp));
  return header + payload;
}

std::string unframe(const std::string& file_bytes) {
  const Header h = parse_header(file_bytes);
  const size_t eol = h.eol;
  const size_t length = h.length;
  const std::string& crc_hex = h.crc_hex;
  const size_t have = file_bytes.size() - eol - 1;
  DTRAIN_CHECK(have >= length, "truncated: ", have, " of ", length, " payload bytes");
  DTRAIN_CHECK(have == length, "has ", have - length, " bytes after the payload's ", length);
  std::string payload = file_bytes.substr(eol + 1);
  char actual[16];
  std::snprintf(actual, sizeof actual, "%08x", crc32_of(payload));
  DTRAIN_CHECK(crc_hex == actual, "corrupt: CRC-32 of the payload is ", actual, ", the header says ", crc_hex);
  return payload;
}

}  // namespace dtrain::ckpt
