// One event file: its name, the records going into it, when they reach the disk, and what happens
// when they cannot (PyTorch's EventFileWriter, without its writer thread: framing an event costs
// microseconds, so add() writes on the caller's thread; the flush_secs timer is SummaryWriter's).
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>

namespace dtrain::tensorboard {

struct EventFileOptions {
  int max_queue = 10;       // events written since the last flush that trigger the next one
  double flush_secs = 120;  // ... or seconds since the last flush
  std::string filename_suffix;
  // Files with the same key warn once between them (a SummaryWriter's runs: one warning, not one per
  // add_scalars run, when its folder is gone). Empty: the file's own path.
  std::string warn_key;
};

// events.out.tfevents.<seconds, 10 digits>.<host>.<pid>.<n><suffix>: n counts the files this process
// opened, so two writers on one folder in the same second get distinct names (TensorBoard's scheme).
std::string event_file_name(double wall_time, const std::string& suffix);

class EventFile {
 public:
  // Creates the folder and the file and writes the file_version record. On failure: one warning,
  // and the file drops every event (ok() is false).
  EventFile(std::string dir, EventFileOptions options);
  ~EventFile();
  EventFile(const EventFile&) = delete;
  EventFile& operator=(const EventFile&) = delete;

  // One serialized Event, framed as a record; flushed by the queue / time policy.
  void add(const std::string& event);
  void flush();
  void close();

  bool ok() const { return file_ != nullptr; }
  const std::string& path() const { return path_; }

 private:
  void fail(const std::string& what, int err);
  std::string dir_, path_;
  EventFileOptions o_;
  std::FILE* file_ = nullptr;
  int pending_ = 0;
  int64_t last_flush_ns_ = 0;
};

// Seconds since the Unix epoch, as Python's time.time().
double wall_time_now();

}  // namespace dtrain::tensorboard
