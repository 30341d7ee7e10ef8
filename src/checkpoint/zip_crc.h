// The CRC-32 of every entry of a zip archive in memory: a torch.save archive (a DCP item) stores
// each record with the CRC-32 of its bytes, which LibTorch's reader does not check, so a flipped
// byte in a tensor's data would load as a wrong number. Torch-free (zlib only), and hostile input
// stays inside the buffer: every offset and size is checked before it is used.
#pragma once

#include <cstddef>
#include <string>

namespace dtrain::ckpt {

// Throws dtrain::Error naming the first entry whose bytes do not match its stored CRC-32, or what
// is malformed in the archive's directory. Entries stored uncompressed (method 0, as torch.save
// writes them) are checked; compressed ones (method 8) are only bounds-checked, their CRC covers
// the inflated bytes, which LibTorch's reader checks as it inflates.
void check_zip_crcs(const char* data, size_t size);

}  // namespace dtrain::ckpt
