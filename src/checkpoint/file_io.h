// The checkpoint file's framing and its atomic write (dtrain/checkpoint.h, "File format").
#pragma once

#include <cstdint>
#include <optional>
#include <string>

namespace dtrain::ckpt {

// "DTRAIN-CHECKPOINT <version> <length> <crc32> <write stamp>\n" + payload. The version is the
// lowest that reads the payload (dtrain/checkpoint.h): 1, or 2 for a sharded save over subgroups.
std::string frame(const std::string& payload, int64_t write_stamp, int version = 1);
// zlib's CRC-32 of `bytes`.
uint32_t crc32_of(const std::string& bytes);
// The write stamp in the header line of the file at `path` (read alone: the first bytes only): 0 for a
// file written before stamps existed (four fields), nullopt when the header line cannot be read,
// with the reason in *why (the unframe() reasons, or the file's).
std::optional<int64_t> read_write_stamp(const std::string& path, std::string* why);
// The payload of a framed file. Throws dtrain::Error with the reason only (the caller names the
// file): not a dtrain checkpoint, an unsupported version, truncated (fewer bytes than the header
// says), trailing bytes, or a CRC-32 mismatch (corrupt).
std::string unframe(const std::string& file_bytes);

// Writes `bytes` to `path` atomically: a fresh temporary file beside it (a random name, created with
// O_EXCL | O_NOFOLLOW, so nothing planted there is written through), write, fsync, rename, fsync of
// the folder (a failure of that last one is a warning: the data is in place). On failure the
// temporary file is removed, `path` (if it existed) is untouched, and a dtrain::Error names the file,
// the reason (strerror) and the remedy.
void write_atomic(const std::string& path, const std::string& bytes);

// Removes, from `dir`, the temporary files of write_atomic for targets whose names start with
// `name_prefix` (those a save killed mid-write leaves behind); links are removed, not followed.
// Call it only where no write of those targets is under way. Returns how many went.
int sweep_temp_files(const std::string& dir, const std::string& name_prefix);

}  // namespace dtrain::ckpt
