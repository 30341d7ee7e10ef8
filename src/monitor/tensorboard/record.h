// TFRecord framing, the container of TensorBoard's event files, and its checksum.
//
// A file is a sequence of records, each:
//   uint64  length           little-endian, bytes of data
//   uint32  masked_crc32c(length's 8 bytes)
//   byte    data[length]     here a serialized Event
//   uint32  masked_crc32c(data)
// A reader that finds a record cut short (a crash mid-write) stops there and keeps the records before
// it, which is why each record goes out whole or not at all.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace dtrain::tensorboard {

// CRC-32C (Castagnoli, reflected polynomial 0x82F63B78), as SSE4.2's crc32 instruction and
// TensorFlow compute it: crc32c("123456789") == 0xE3069283.
uint32_t crc32c(const void* data, size_t n);
// The record format's mask, so that a CRC of data that itself holds CRCs stays a good checksum:
// rotate right by 15 bits and add 0xa282ead8.
uint32_t masked_crc32c(const void* data, size_t n);

// data framed as one record.
std::string tfrecord(const std::string& data);

}  // namespace dtrain::tensorboard
