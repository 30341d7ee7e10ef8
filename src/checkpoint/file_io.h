// Checkpoint files: the header line of a file on disk and the atomic write; the framing itself
// (frame, unframe, crc32_of) is frame.h's, included here for the callers.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "checkpoint/frame.h"

namespace dtrain::ckpt {

// The write stamp in the header line of the file at `path` (read alone: the first bytes only): 0 for a
// file written before stamps existed (four fields), nullopt when the header line cannot be read,
// with the reason in *why (the unframe() reasons, or the file's).
std::optional<int64_t> read_write_stamp(const std::string& path, std::string* why);

// Opens `path`, one of a checkpoint's own files, for reading: never through a symbolic link
// (O_NOFOLLOW), never waiting for a FIFO's writer (O_NONBLOCK, cleared once the file is known to be
// regular), and a regular file only. Throws dtrain::Error naming the file, what it is and `what` it
// holds ("... is a FIFO (it holds 'fc.weight'), not a regular file: ..."). The caller closes it.
int open_regular(const std::string& path, const std::string& what);

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
