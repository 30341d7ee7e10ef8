#include "train_support.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>
#include <torch/serialize/archive.h>

#ifdef DTRAIN_HAVE_OPENSSL
#include <openssl/evp.h>
#endif

#include "dtrain/errors.h"

namespace train {

namespace {

std::string errno_text() { return std::strerror(errno); }

}  // namespace

// --- checkpoint ------------------------------------------------------------------------------------

void save_checkpoint(const std::string& path, const torch::nn::Module& model, const torch::optim::Optimizer& opt,
                     int64_t epoch) {
  torch::serialize::OutputArchive archive, model_archive, opt_archive;
  model.save(model_archive);
  opt.save(opt_archive);
  archive.write("model", model_archive);
  archive.write("optimizer", opt_archive);
  archive.write("epoch", at::scalar_tensor(epoch, at::kLong));
  std::ostringstream bytes_stream;
  archive.save_to(bytes_stream);
  const std::string bytes = bytes_stream.str();

  // 1. temporary file beside the target (same file system, so rename is atomic);
  // 2. write + fsync; 3. rename over the target; 4. fsync the folder so the rename is durable.
  const std::filesystem::path target(path);
  const std::filesystem::path dir = target.has_parent_path() ? target.parent_path() : ".";
  const std::string tmp = (dir / ("." + target.filename().string() + ".tmp." + std::to_string(::getpid()))).string();
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  DTRAIN_CHECK(fd >= 0, "cannot create checkpoint file ", tmp, ": ", errno_text());
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const std::string why = errno_text();
      ::close(fd);
      ::unlink(tmp.c_str());
      throw dtrain::Error("cannot write checkpoint file " + tmp + ": " + why);
    }
    done += static_cast<size_t>(n);
  }
  if (::fsync(fd) != 0 || ::close(fd) != 0) {
    const std::string why = errno_text();
    ::unlink(tmp.c_str());
    throw dtrain::Error("cannot write checkpoint file " + tmp + ": " + why);
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const std::string why = errno_text();
    ::unlink(tmp.c_str());
    throw dtrain::Error("cannot rename " + tmp + " to " + path + ": " + why);
  }
  const int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    ::fsync(dfd);
    ::close(dfd);
  }
}

// --- parameters ------------------------------------------------------------------------------------

std::string parameter_bytes(const std::vector<at::Tensor>& params) {
  std::string out;
  for (const auto& p : params) {
    const at::Tensor t = p.detach().to(at::kCPU, at::kFloat).contiguous();
    out.append(static_cast<const char*>(t.data_ptr()), t.numel() * sizeof(float));
  }
  return out;
}

std::string sha256_hex(const std::string& bytes) {
#ifdef DTRAIN_HAVE_OPENSSL
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  DTRAIN_CHECK(EVP_Digest(bytes.data(), bytes.size(), digest, &len, EVP_sha256(), nullptr) == 1,
               "OpenSSL EVP_Digest(sha256) failed");
  static const char* kHex = "0123456789abcdef";
  std::string hex;
  for (unsigned int i = 0; i < len; ++i) {
    hex += kHex[digest[i] >> 4];
    hex += kHex[digest[i] & 15];
  }
  return hex;
#else
  (void)bytes;
  return "";
#endif
}

void write_file(const std::string& path, const std::string& bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  DTRAIN_CHECK(f, "cannot create ", path, ": ", errno_text());
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  f.close();
  DTRAIN_CHECK(f, "cannot write ", path, ": ", errno_text());
}

}  // namespace train
