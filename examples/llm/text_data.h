// train_llm's data: a byte-level tokenizer, the token files a corpus of .txt files is prepared into
// (uint16, train and validation), and a memory-mapped view of one of them cut into windows.
//
//   llm::prepare_tokens("data/shakespeare", "data/shakespeare/tokens", 0.05);  // once, on rank 0
//   llm::TokenFile train("data/shakespeare/tokens/train.bin");
//   at::Tensor w = train.window(i, 256);   // int64 [257]: inputs w[:-1], next-token targets w[1:]
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <ATen/ATen.h>

namespace llm {

// Byte-level tokens: 0..255 are the bytes, then one document's start and end.
constexpr int64_t kBos = 256, kEos = 257, kByteVocab = 258;
std::vector<int64_t> encode(const std::string& text);
std::string decode(const std::vector<int64_t>& tokens);  // specials dropped

struct PreparedTokens {
  std::string train_path, val_path;
  int64_t train_tokens = 0, val_tokens = 0, documents = 0;
  bool reused = false;  // the cache matched the corpus: nothing written
};

// Writes <cache_dir>/train.bin and val.bin (uint16, native byte order) from every *.txt of corpus_dir
// in name order, each document BOS + bytes + EOS; the last val_fraction of every document is held out
// for validation, so both splits see every play. Reuses the files when <cache_dir>/tokens.meta says
// they came from this very corpus (its size and checksum) and split. Each file is written under a
// temporary name and renamed: a killed preparation leaves no half file. Throws naming the folder.
PreparedTokens prepare_tokens(const std::string& corpus_dir, const std::string& cache_dir, double val_fraction);

// A read-only memory map of a uint16 token file.
class TokenFile {
 public:
  explicit TokenFile(const std::string& path);
  ~TokenFile();
  TokenFile(const TokenFile&) = delete;
  TokenFile& operator=(const TokenFile&) = delete;
  int64_t size() const { return size_; }
  // Non-overlapping windows of seq_len + 1 tokens (inputs and their next tokens share all but one).
  int64_t num_windows(int64_t seq_len) const { return size_ > seq_len ? (size_ - 1) / seq_len : 0; }
  // Window i: tokens [i * seq_len, i * seq_len + seq_len + 1) as int64.
  at::Tensor window(int64_t i, int64_t seq_len) const;

 private:
  const uint16_t* data_ = nullptr;
  int64_t size_ = 0;
  size_t bytes_ = 0;
};

}  // namespace llm
