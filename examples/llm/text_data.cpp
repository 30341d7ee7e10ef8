// Byte-level tokens, the corpus's preparation into token files, and their memory maps.
#include "llm/text_data.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "dtrain/errors.h"

namespace llm {
namespace fs = std::filesystem;

std::vector<int64_t> encode(const std::string& text) {
  std::vector<int64_t> out;
  out.reserve(text.size());
  for (unsigned char c : text) out.push_back(c);
  return out;
}

std::string decode(const std::vector<int64_t>& tokens) {
  std::string out;
  for (int64_t t : tokens)
    if (t >= 0 && t < 256) out.push_back(static_cast<char>(t));
  return out;
}

namespace {

std::string read_whole(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  DTRAIN_CHECK(in.good(), "data.corpus_dir: cannot read ", path.string());
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

void write_tokens(const fs::path& path, const std::vector<uint16_t>& tokens) {
  const fs::path tmp = path.string() + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    out.write(reinterpret_cast<const char*>(tokens.data()), static_cast<std::streamsize>(tokens.size() * 2));
    DTRAIN_CHECK(out.good(), "data.cache_dir: cannot write ", tmp.string());
  }
  fs::rename(tmp, path);
}

// FNV-1a over the documents' names and bytes: the cache's key.
uint64_t fnv1a(uint64_t h, const std::string& s) {
  for (unsigned char c : s) h = (h ^ c) * 1099511628211ull;
  return h;
}

}  // namespace

PreparedTokens prepare_tokens(const std::string& corpus_dir, const std::string& cache_dir, double val_fraction) {
  std::vector<fs::path> files;
  std::error_code ec;
  for (fs::directory_iterator it(corpus_dir, ec), end; !ec && it != end; it.increment(ec))
    if (it->path().extension() == ".txt") files.push_back(it->path());
  DTRAIN_CHECK(!ec && !files.empty(), "data.corpus_dir ", corpus_dir,
               ": no .txt files there (run scripts/setup.sh, which installs the Shakespeare corpus into "
               "data/shakespeare, or point data.corpus_dir at a folder of .txt files)");
  std::sort(files.begin(), files.end());
  std::vector<std::string> docs;
  uint64_t h = 1469598103934665603ull;
  for (const auto& f : files) {
    docs.push_back(read_whole(f));
    h = fnv1a(fnv1a(h, f.filename().string()), docs.back());
  }
  std::ostringstream meta;
  meta << "tokenizer bytes+bos+eos\ndocuments " << docs.size() << "\nfnv1a " << h << "\nval_fraction " << val_fraction
       << "\n";
  PreparedTokens out;
  out.train_path = (fs::path(cache_dir) / "train.bin").string();
  out.val_path = (fs::path(cache_dir) / "val.bin").string();
  out.documents = static_cast<int64_t>(docs.size());
  const fs::path meta_path = fs::path(cache_dir) / "tokens.meta";
  if (fs::exists(meta_path) && read_whole(meta_path) == meta.str() && fs::exists(out.train_path) &&
      fs::exists(out.val_path)) {
    out.reused = true;
    out.train_tokens = static_cast<int64_t>(fs::file_size(out.train_path) / 2);
    out.val_tokens = static_cast<int64_t>(fs::file_size(out.val_path) / 2);
    return out;
  }
  std::vector<uint16_t> train, val;
  for (const std::string& doc : docs) {
    std::vector<uint16_t> t{static_cast<uint16_t>(kBos)};
    for (unsigned char c : doc) t.push_back(c);
    t.push_back(static_cast<uint16_t>(kEos));
    const auto n_val = static_cast<size_t>(static_cast<double>(t.size()) * val_fraction);
    train.insert(train.end(), t.begin(), t.end() - static_cast<std::ptrdiff_t>(n_val));
    val.insert(val.end(), t.end() - static_cast<std::ptrdiff_t>(n_val), t.end());
  }
  fs::create_directories(cache_dir, ec);
  DTRAIN_CHECK(fs::is_directory(cache_dir), "data.cache_dir ", cache_dir, ": cannot create the folder");
  fs::remove(meta_path, ec);  // the files below are not the cache's until the new meta says so
  write_tokens(out.train_path, train);
  write_tokens(out.val_path, val);
  {
    std::ofstream m(meta_path.string() + ".tmp", std::ios::trunc);
    m << meta.str();
    DTRAIN_CHECK(m.good(), "data.cache_dir: cannot write ", meta_path.string());
  }
  fs::rename(meta_path.string() + ".tmp", meta_path);
  out.train_tokens = static_cast<int64_t>(train.size());
  out.val_tokens = static_cast<int64_t>(val.size());
  return out;
}

TokenFile::TokenFile(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  DTRAIN_CHECK(fd >= 0, "cannot open the token file ", path);
  struct stat st {};
  const bool ok = ::fstat(fd, &st) == 0 && st.st_size >= 2;
  if (!ok) ::close(fd);
  DTRAIN_CHECK(ok, "the token file ", path, " is empty (prepare it again: delete its folder)");
  bytes_ = static_cast<size_t>(st.st_size);
  void* p = ::mmap(nullptr, bytes_, PROT_READ, MAP_PRIVATE, fd, 0);
  ::close(fd);  // the mapping keeps the file
  DTRAIN_CHECK(p != MAP_FAILED, "cannot memory-map the token file ", path);
  data_ = static_cast<const uint16_t*>(p);
  size_ = static_cast<int64_t>(bytes_ / 2);
}

TokenFile::~TokenFile() {
  if (data_) ::munmap(const_cast<uint16_t*>(data_), bytes_);
}

at::Tensor TokenFile::window(int64_t i, int64_t seq_len) const {
  DTRAIN_CHECK(i >= 0 && i < num_windows(seq_len), "window ", i, " is outside the ", num_windows(seq_len),
               " windows of ", seq_len, " tokens");
  at::Tensor out = at::empty({seq_len + 1}, at::kLong);
  int64_t* o = out.data_ptr<int64_t>();
  const uint16_t* src = data_ + i * seq_len;
  for (int64_t k = 0; k <= seq_len; ++k) o[k] = src[k];
  return out;
}

}  // namespace llm
