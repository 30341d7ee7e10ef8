// The checkpoint file's framing: its header line and CRC-32 (dtrain/checkpoint.h, "File format").
// Torch-free, so that the fuzz target of unframe (tests/fuzz/) builds without LibTorch.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace dtrain::ckpt {

// The newest format version unframe() reads: dtrain/checkpoint.h's kCheckpointFormatVersion, which
// this header cannot include (LibTorch); file_io.cpp asserts that the two agree.
constexpr int kNewestFrameVersion = 4;
// The header line is at most this long, newline included.
constexpr size_t kMaxHeaderBytes = 96;

// "DTRAIN-CHECKPOINT <version> <length> <crc32> <write stamp>\n" + payload. The version is the
// lowest that reads the payload (dtrain/checkpoint.h): 1, or 4 for a sharded model's.
std::string frame(const std::string& payload, int64_t write_stamp, int version = 1);
// zlib's CRC-32 of `bytes`.
uint32_t crc32_of(const std::string& bytes);
// The write stamp in the header line at the start of `head` (the payload need not follow): 0 for a
// file written before stamps existed (four fields). Throws dtrain::Error with the unframe() reasons
// that concern the header line.
int64_t header_write_stamp(const std::string& head);
// The payload of a framed file. Throws dtrain::Error with the reason only (the caller names the
// file): not a dtrain checkpoint, an unsupported version, truncated (fewer bytes than the header
// says), trailing bytes, or a CRC-32 mismatch (corrupt).
std::string unframe(const std::string& file_bytes);

}  // namespace dtrain::ckpt
