#include "sample_log.h"

#include <cerrno>
#include <cstring>
#include <filesystem>

#include "dtrain/errors.h"

namespace train {

SampleLog::SampleLog(const std::string& dir, int rank, int attempt) {
  if (dir.empty()) return;
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);  // every rank: the folder may be per node
  path_ = (std::filesystem::path(dir) /
           ("samples.rank" + std::to_string(rank) + ".attempt" + std::to_string(attempt) + ".txt"))
              .string();
  // Appended to: a run that starts again with the same attempt number (a new launch) adds its lines.
  file_ = std::fopen(path_.c_str(), "a");
  DTRAIN_CHECK(file_ != nullptr, "--sample_log: cannot open ", path_, " for appending: ", std::strerror(errno),
               ": choose a writable folder");
}

SampleLog::~SampleLog() {
  if (file_) std::fclose(file_);
}

void SampleLog::write(int64_t epoch, int64_t step, const std::vector<size_t>& indices) {
  if (!file_) return;
  for (size_t index : indices)
    std::fprintf(file_, "%lld %lld %zu\n", static_cast<long long>(epoch), static_cast<long long>(step), index);
  // Flushed per step: a rank killed in the next step has its trained samples on disk.
  DTRAIN_CHECK(std::fflush(file_) == 0 && !std::ferror(file_), "--sample_log: cannot write ", path_, ": ",
               std::strerror(errno), ": free space there or choose another folder");
}

}  // namespace train
