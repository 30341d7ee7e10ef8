// Zip entries' CRC-32 (zip_crc.h). The layout, from the zip specification (APPNOTE 6.3): the end of
// central directory record (EOCD, at most 64 KiB of comment after it) points at the central
// directory, whose entries give each record's CRC-32, sizes and local header offset; a zip64 EOCD
// (found through its locator just before the EOCD) and zip64 extra fields carry the 64-bit values
// where the 32-bit fields hold 0xFFFFFFFF.
#include "checkpoint/zip_crc.h"

#include <zlib.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>

#include "dtrain/errors.h"

namespace dtrain::ckpt {
namespace {

constexpr uint32_t kEocd = 0x06054b50, kZip64Locator = 0x07064b50, kZip64Eocd = 0x06064b50, kCentral = 0x02014b50,
                   kLocal = 0x04034b50;
constexpr size_t kEocdBytes = 22, kLocatorBytes = 20, kCentralBytes = 46, kLocalBytes = 30;

// A bounds-checked little-endian view of the archive.
struct ZipBytes {
  const unsigned char* p;
  size_t n;
  bool fits(uint64_t at, uint64_t len) const { return at <= n && len <= n - at; }
  uint64_t le(uint64_t at, int width) const {
    DTRAIN_CHECK(fits(at, static_cast<uint64_t>(width)), "the zip directory points past the archive's ", n,
                 " bytes (offset ", at, ")");
    uint64_t v = 0;
    for (int i = width - 1; i >= 0; --i) v = (v << 8) | p[at + static_cast<uint64_t>(i)];
    return v;
  }
};

std::string zip_hex(uint64_t v) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "0x%08llx", static_cast<unsigned long long>(v));
  return buf;
}

struct ZipDirectory {
  uint64_t entries = 0, offset = 0, size = 0;
};

ZipDirectory find_directory(const ZipBytes& b) {
  DTRAIN_CHECK(b.n >= kEocdBytes, "not a zip archive: ", b.n, " bytes, fewer than its end record's ", kEocdBytes);
  // The EOCD is the last record; a comment of up to 65535 bytes may follow it.
  const uint64_t lowest = b.n - kEocdBytes > 65535 ? b.n - kEocdBytes - 65535 : 0;
  for (uint64_t at = b.n - kEocdBytes + 1; at-- > lowest;) {
    if (b.le(at, 4) != kEocd) continue;
    ZipDirectory d{b.le(at + 10, 2), b.le(at + 16, 4), b.le(at + 12, 4)};
    if (at >= kLocatorBytes && b.le(at - kLocatorBytes, 4) == kZip64Locator) {
      const uint64_t z = b.le(at - kLocatorBytes + 8, 8);
      DTRAIN_CHECK(b.le(z, 4) == kZip64Eocd, "the zip64 end record at byte ", z, " has no signature");
      d = ZipDirectory{b.le(z + 32, 8), b.le(z + 48, 8), b.le(z + 40, 8)};
    }
    DTRAIN_CHECK(b.fits(d.offset, d.size), "the zip directory (bytes ", d.offset, " + ", d.size,
                 ") lies past the archive's ", b.n, " bytes");
    return d;
  }
  throw Error("not a zip archive: no end of central directory record");
}

// The 64-bit values of a zip64 extra field, in the order the specification gives them: each read
// only where its 32-bit field is 0xFFFFFFFF.
void read_zip64(const ZipBytes& b, uint64_t extra, uint64_t extra_len, uint64_t& uncomp, uint64_t& comp,
                uint64_t& local) {
  for (uint64_t at = extra; at + 4 <= extra + extra_len;) {
    const uint64_t id = b.le(at, 2), len = b.le(at + 2, 2);
    if (id == 1) {
      uint64_t v = at + 4;
      for (uint64_t* field : {&uncomp, &comp, &local})
        if (*field == 0xFFFFFFFFu && v + 8 <= at + 4 + len) {
          *field = b.le(v, 8);
          v += 8;
        }
      return;
    }
    at += 4 + len;
  }
}

}  // namespace

void check_zip_crcs(const char* data, size_t size) {
  const ZipBytes b{reinterpret_cast<const unsigned char*>(data), size};
  const ZipDirectory d = find_directory(b);
  uint64_t at = d.offset;
  for (uint64_t i = 0; i < d.entries; ++i) {
    DTRAIN_CHECK(b.le(at, 4) == kCentral, "zip directory entry ", i, " at byte ", at, " has no signature");
    const uint64_t method = b.le(at + 10, 2), crc = b.le(at + 16, 4), name_len = b.le(at + 28, 2),
                   extra_len = b.le(at + 30, 2), comment_len = b.le(at + 32, 2);
    uint64_t comp = b.le(at + 20, 4), uncomp = b.le(at + 24, 4), local = b.le(at + 42, 4);
    DTRAIN_CHECK(b.fits(at + kCentralBytes, name_len + extra_len + comment_len), "zip directory entry ", i,
                 " runs past the archive");
    const std::string name(reinterpret_cast<const char*>(b.p + at + kCentralBytes), name_len);
    read_zip64(b, at + kCentralBytes + name_len, extra_len, uncomp, comp, local);
    DTRAIN_CHECK(b.le(local, 4) == kLocal, "the zip entry '", name, "' has no local header at byte ", local);
    const uint64_t start = local + kLocalBytes + b.le(local + 26, 2) + b.le(local + 28, 2);
    DTRAIN_CHECK(b.fits(start, comp), "the zip entry '", name, "' (", comp, " bytes at ", start,
                 ") lies past the archive's ", b.n, " bytes");
    if (method == 0) {
      DTRAIN_CHECK(comp == uncomp, "the stored zip entry '", name, "' has ", comp, " bytes but says it holds ", uncomp);
      // zlib's crc32 takes a uInt length: feed it in pieces.
      uLong got = crc32(0L, Z_NULL, 0);
      for (uint64_t off = 0; off < comp;) {
        const uint64_t piece = std::min<uint64_t>(comp - off, 1u << 30);
        got = crc32(got, b.p + start + off, static_cast<uInt>(piece));
        off += piece;
      }
      DTRAIN_CHECK(got == crc, "the zip entry '", name, "' is damaged: its bytes have CRC-32 ", zip_hex(got),
                   ", the archive stored ", zip_hex(crc));
    }
    at += kCentralBytes + name_len + extra_len + comment_len;
  }
}

}  // namespace dtrain::ckpt
