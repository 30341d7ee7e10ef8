// A POSIX shared-memory segment shared by the ranks of one host (torch-free).
//
// Layout (every part 64-byte aligned, the data 4096-byte aligned):
//   Header    magic, version, rank count, slot size, attach count, abort flag + message
//   RankCtl   per rank: three step counters (scatter / reduce / gather), each on its own cache line
//             with a sleeper count for futex wake-ups (and, beside the scatter counter, the last two
//             op descriptors); the pid
//   slots     per rank: two buffers of slot_bytes (double buffering: step s uses buffer s % 2)
//   bells     per rank: a counter that every peer bumps (and futex-wakes) when a point-to-point
//             channel to or from that rank changes, so one futex covers all of a rank's channels
//   channels  per ordered pair (src, dst): ChanCtl (bytes written, bytes read, broken flag and
//             message) and a byte ring of chan_bytes (p2p.h)
//
// Note [Segment lifetime]: the creator (the host's lowest rank) creates the name with O_EXCL and a
// random per-job id, reserves the memory (posix_fallocate: a full /dev/shm fails here with a clear
// error, not with SIGBUS later), and unlinks the name as soon as every rank has attached. From then
// on the memory lives only in the mappings, so a crash or SIGKILL leaves nothing in /dev/shm. Only a
// crash inside the attach window (milliseconds at startup) could leave a name behind.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>

namespace dtrain::shm {

// 24 bytes, so that two fit beside a counter in one cache line (Counter::desc).
struct OpDesc {
  uint64_t op_id = 0;
  uint64_t count = 0;  // elements (all_reduce) or bytes (broadcast, all_gather)
  uint8_t op = 0;      // OpKind
  uint8_t dtype = 0;   // DType for all_reduce
  uint8_t redop = 0;   // RedOp for all_reduce
  int32_t root = -1;   // broadcast
};
static_assert(sizeof(OpDesc) == 24, "two OpDescs and a counter share one cache line");

struct alignas(64) Counter {
  std::atomic<uint32_t> value{0};
  std::atomic<uint32_t> sleepers{0};
  // Phase A's counter only: the last two op descriptors (desc[op_id % 2]), written before the signal
  // that releases them. On the counter's line, a peer that has just seen the signal reads them from
  // the line it already holds, instead of missing the cache once more on every call.
  OpDesc desc[2];
};
static_assert(sizeof(Counter) == 64, "a counter (and its descriptors) is one cache line");

struct alignas(64) RankCtl {
  Counter phase[3];
  std::atomic<int32_t> pid{0};
  uint64_t pid_namespace = 0;  // pid checks only make sense between ranks of one pid namespace
};

// One direction of a point-to-point channel: the sender advances `head`, the receiver `tail` (both
// count bytes since the start, so head - tail bytes of the ring are unread). A broken channel (a
// mismatched message) fails every later operation on it with `message`.
struct alignas(64) ChanCtl {
  alignas(64) std::atomic<uint64_t> head{0};
  alignas(64) std::atomic<uint64_t> tail{0};
  alignas(64) std::atomic<uint32_t> broken{0};  // 0 ok, 1 being written, 2 message readable
  char message[440] = {0};
};

struct alignas(64) Header {
  uint64_t magic = 0;
  uint32_t version = 0;
  uint32_t nranks = 0;
  uint64_t slot_bytes = 0;
  uint64_t total_bytes = 0;
  std::atomic<uint32_t> attached{0};
  std::atomic<uint32_t> aborted{0};
  char abort_message[512] = {0};
};

class Segment {
 public:
  // Creates and maps a new segment; throws dtrain::Error naming the name and the remedy.
  static Segment create(const std::string& name, int nranks, size_t slot_bytes);
  // Maps an existing segment and checks its magic, version, rank count and size.
  static Segment attach(const std::string& name, int nranks, size_t slot_bytes);
  // A fresh name: "/dtrain-<pid>-<random 64-bit hex>-<tag>".
  static std::string unique_name(const std::string& tag);

  Segment() = default;
  Segment(Segment&& o) noexcept;
  Segment& operator=(Segment&& o) noexcept;
  Segment(const Segment&) = delete;
  Segment& operator=(const Segment&) = delete;
  ~Segment();

  // Removes the name (idempotent); the mappings stay valid.
  void unlink();

  Header& header() const { return *reinterpret_cast<Header*>(base_); }
  RankCtl& ctl(int rank) const;
  char* slot(int rank, int buffer) const;
  size_t slot_bytes() const { return slot_bytes_; }
  Counter& bell(int rank) const;
  ChanCtl& chan(int src, int dst) const;
  char* ring(int src, int dst) const;
  size_t chan_bytes() const { return chan_bytes_; }
  int nranks() const { return nranks_; }
  const std::string& name() const { return name_; }
  // Touches this rank's slots so that their pages are resident before the first collective.
  void prefault(int rank) const;

 private:
  void release();
  std::string name_;
  char* base_ = nullptr;
  size_t total_ = 0;
  size_t slot_bytes_ = 0;
  size_t chan_bytes_ = 0;
  int nranks_ = 0;
  bool owner_ = false;
  bool unlinked_ = false;
};

// Bytes of the segment for `nranks` ranks with slots of `slot_bytes`.
size_t segment_bytes(int nranks, size_t slot_bytes);
// Bytes of each point-to-point ring: slot_bytes, shrunk (to no less than 4 KiB) so that all the
// rings of a host take at most 64 MiB of /dev/shm however many ranks it has.
size_t channel_bytes(int nranks, size_t slot_bytes);

}  // namespace dtrain::shm
