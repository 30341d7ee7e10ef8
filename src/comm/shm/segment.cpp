#include "comm/shm/segment.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <new>
#include <random>
#include <utility>

#include "dtrain/errors.h"

namespace dtrain::shm {
namespace {

constexpr uint64_t kMagic = 0x6474726e73686d31ULL;  // "dtrnshm1"
constexpr uint32_t kVersion = 3;  // 2: point-to-point bells and channels; 3: descriptors beside counter A

size_t align_up(size_t v, size_t a) { return (v + a - 1) / a * a; }
size_t ctl_offset() { return align_up(sizeof(Header), 4096); }
size_t data_offset(int nranks) { return align_up(ctl_offset() + sizeof(RankCtl) * nranks, 4096); }
size_t bells_offset(int nranks, size_t slot_bytes) {
  return data_offset(nranks) + static_cast<size_t>(nranks) * 2 * slot_bytes;
}
size_t chans_offset(int nranks, size_t slot_bytes) {
  return bells_offset(nranks, slot_bytes) + sizeof(Counter) * nranks;
}
size_t rings_offset(int nranks, size_t slot_bytes) {
  return align_up(chans_offset(nranks, slot_bytes) + sizeof(ChanCtl) * nranks * nranks, 4096);
}
constexpr size_t kRingBudget = size_t{64} << 20;

std::string errno_text(int e) { return std::strerror(e); }

// `bytes` in MiB with one decimal, rounded up (a size needed) or down (a size available).
std::string mib(uint64_t bytes, bool up) {
  const uint64_t tenths = (bytes * 10 + (up ? (uint64_t{1} << 20) - 1 : 0)) >> 20;
  return detail::cat(tenths / 10, ".", tenths % 10, " MiB");
}

// Why a reservation failed with ENOSPC, and the remedy: the file system's free space (read after the
// failure, which gives back what it had reserved) and how a container gets a larger /dev/shm.
std::string too_small(int fd, int nranks) {
  std::string has;
  struct statvfs fs {};
  if (fstatvfs(fd, &fs) == 0)
    has = detail::cat(" (", mib(uint64_t{fs.f_bavail} * fs.f_frsize, false), " free of ",
                      mib(uint64_t{fs.f_blocks} * fs.f_frsize, false), ")");
  return detail::cat("/dev/shm is too small", has, " for the segment of ", nranks,
                     " ranks: enlarge it (Kubernetes: mount a Memory emptyDir at /dev/shm; Docker: --shm-size) "
                     "or lower DTRAIN_SHM_SLOT_BYTES");
}

// Why the object behind `fd` is not one create() made for this user ("" when it is): a regular shm
// object, owned by this process's user, owner-only (0600). Fills `st`.
std::string why_not_ours(int fd, struct stat& st) {
  if (fstat(fd, &st) != 0) return "cannot be inspected: " + errno_text(errno);
  if (!S_ISREG(st.st_mode)) return "is not a regular shared-memory object";
  if (st.st_uid != geteuid()) return detail::cat("is owned by uid ", st.st_uid, ", not this process's ", geteuid());
  if ((st.st_mode & 07777) != 0600) {
    char mode[16];
    std::snprintf(mode, sizeof mode, "%04o", static_cast<unsigned>(st.st_mode & 07777));
    return detail::cat("has mode ", mode, ", not 0600");
  }
  return "";
}

}  // namespace

size_t channel_bytes(int nranks, size_t slot_bytes) {
  const size_t pairs = static_cast<size_t>(nranks) * nranks;
  size_t b = std::min(slot_bytes, kRingBudget / pairs) / 4096 * 4096;
  return std::max<size_t>(b, 4096);
}

size_t segment_bytes(int nranks, size_t slot_bytes) {
  return rings_offset(nranks, slot_bytes) + static_cast<size_t>(nranks) * nranks * channel_bytes(nranks, slot_bytes);
}

std::string Segment::unique_name(const std::string& tag) {
  std::random_device rd;
  uint64_t id = (static_cast<uint64_t>(rd()) << 32) ^ rd();
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%016llx", static_cast<unsigned long long>(id));
  return "/dtrain-" + std::to_string(getpid()) + "-" + buf + "-" + tag;
}

Segment Segment::create(const std::string& name, int nranks, size_t slot_bytes) {
  DTRAIN_ASSERT(nranks >= 1 && slot_bytes % 64 == 0);
  const size_t total = segment_bytes(nranks, slot_bytes);
  int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  DTRAIN_CHECK(fd >= 0, "creating the shared-memory segment ", name, " failed: ", errno_text(errno),
               ": check that /dev/shm is mounted and writable, or set DTRAIN_SHM=0 to use Gloo only");
  Segment s;
  s.name_ = name;
  s.owner_ = true;
  s.nranks_ = nranks;
  s.slot_bytes_ = slot_bytes;
  s.total_ = total;
  // From here on, s's destructor unlinks the name if anything fails.
  if (ftruncate(fd, static_cast<off_t>(total)) != 0) {
    int e = errno;
    close(fd);
    throw Error(detail::cat("sizing the shared-memory segment ", name, " to ", total, " bytes failed: ", errno_text(e),
                            ": free space in /dev/shm or set DTRAIN_SHM=0"));
  }
  // Reserve every page now: a store into a page that a full tmpfs cannot back is SIGBUS, in
  // whichever rank touches it first, collective or point-to-point ring alike (Note [Segment lifetime]).
  int e = 0;
  do e = posix_fallocate(fd, 0, static_cast<off_t>(total));
  while (e == EINTR);
  if (e != 0) {
    const std::string why = e == ENOSPC ? too_small(fd, nranks) : errno_text(e);
    close(fd);
    throw Error(detail::cat("reserving ", mib(total, true), " (", total,
                            " bytes) of /dev/shm for the shared-memory segment ", name, " failed: ", why,
                            "; set DTRAIN_SHM=0 to use Gloo only"));
  }
  void* p = mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  e = errno;
  close(fd);
  DTRAIN_CHECK(p != MAP_FAILED, "mapping the shared-memory segment ", name, " failed: ", errno_text(e),
               ": set DTRAIN_SHM=0 to use Gloo only");
  s.base_ = static_cast<char*>(p);
  Header* h = new (s.base_) Header();
  s.chan_bytes_ = channel_bytes(nranks, slot_bytes);
  for (int r = 0; r < nranks; ++r) new (&s.ctl(r)) RankCtl();
  for (int r = 0; r < nranks; ++r) new (&s.bell(r)) Counter();
  for (int a = 0; a < nranks; ++a)
    for (int b = 0; b < nranks; ++b) new (&s.chan(a, b)) ChanCtl();
  h->nranks = static_cast<uint32_t>(nranks);
  h->slot_bytes = slot_bytes;
  h->total_bytes = total;
  h->version = kVersion;
  reinterpret_cast<std::atomic<uint64_t>*>(&h->magic)->store(kMagic, std::memory_order_release);
  return s;
}

Segment Segment::attach(const std::string& name, int nranks, size_t slot_bytes) {
  const size_t total = segment_bytes(nranks, slot_bytes);
  DTRAIN_CHECK(name.rfind("/dtrain-", 0) == 0 && name.find('/', 1) == std::string::npos && name.size() < 240,
               "the shared-memory segment name '", name,
               "' is not one unique_name() makes: the store that "
               "published it was written by something else; set DTRAIN_SHM=0 to use Gloo only");
  int fd = shm_open(name.c_str(), O_RDWR, 0600);
  DTRAIN_CHECK(fd >= 0, "opening the shared-memory segment ", name, " failed: ", errno_text(errno),
               ": the ranks that share this host must see the same /dev/shm (same container); "
               "set DTRAIN_SHM=0 to use Gloo only");
  struct stat st {};
  // The name comes from the store, which anyone who reaches it can write: map only a segment that
  // this job's creator could have made, before reading anything in it.
  const std::string not_ours = why_not_ours(fd, st);
  if (!not_ours.empty()) {
    close(fd);
    throw Error(detail::cat("the shared-memory segment ", name, " ", not_ours,
                            ": it is not one this job's ranks created (planted, or another user's); set "
                            "DTRAIN_SHM=0 to use Gloo only"));
  }
  if (static_cast<size_t>(st.st_size) != total) {
    close(fd);
    throw Error(detail::cat("the shared-memory segment ", name, " has ", st.st_size, " bytes, expected ", total, " (",
                            nranks, " ranks, ", slot_bytes,
                            "-byte slots): another job "
                            "reused the name, or the ranks disagree on the group; set DTRAIN_SHM=0"));
  }
  void* p = mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  int e = errno;
  close(fd);
  DTRAIN_CHECK(p != MAP_FAILED, "mapping the shared-memory segment ", name, " failed: ", errno_text(e),
               ": set DTRAIN_SHM=0 to use Gloo only");
  Segment s;
  s.name_ = name;
  s.base_ = static_cast<char*>(p);
  s.total_ = total;
  s.nranks_ = nranks;
  s.slot_bytes_ = slot_bytes;
  s.chan_bytes_ = channel_bytes(nranks, slot_bytes);
  s.unlinked_ = true;  // only the creator unlinks
  const Header& h = s.header();
  uint64_t magic = reinterpret_cast<const std::atomic<uint64_t>*>(&h.magic)->load(std::memory_order_acquire);
  DTRAIN_CHECK(magic == kMagic && h.version == kVersion && h.nranks == static_cast<uint32_t>(nranks) &&
                   h.slot_bytes == slot_bytes && h.total_bytes == total,
               "the shared-memory segment ", name, " is not a dtrain segment for ", nranks,
               " ranks (magic/version/size differ): set DTRAIN_SHM=0");
  return s;
}

Segment::Segment(Segment&& o) noexcept { *this = std::move(o); }

Segment& Segment::operator=(Segment&& o) noexcept {
  if (this != &o) {
    release();
    name_ = std::move(o.name_);
    base_ = std::exchange(o.base_, nullptr);
    total_ = o.total_;
    slot_bytes_ = o.slot_bytes_;
    chan_bytes_ = o.chan_bytes_;
    nranks_ = o.nranks_;
    owner_ = std::exchange(o.owner_, false);
    unlinked_ = std::exchange(o.unlinked_, true);
  }
  return *this;
}

Segment::~Segment() { release(); }

void Segment::release() {
  unlink();
  if (base_) munmap(base_, total_);
  base_ = nullptr;
}

void Segment::unlink() {
  if (owner_ && !unlinked_ && !name_.empty()) shm_unlink(name_.c_str());
  unlinked_ = true;
}

RankCtl& Segment::ctl(int rank) const { return reinterpret_cast<RankCtl*>(base_ + ctl_offset())[rank]; }

char* Segment::slot(int rank, int buffer) const {
  return base_ + data_offset(nranks_) + (static_cast<size_t>(rank) * 2 + buffer) * slot_bytes_;
}

Counter& Segment::bell(int rank) const {
  return reinterpret_cast<Counter*>(base_ + bells_offset(nranks_, slot_bytes_))[rank];
}

ChanCtl& Segment::chan(int src, int dst) const {
  return reinterpret_cast<ChanCtl*>(base_ + chans_offset(nranks_, slot_bytes_))[src * nranks_ + dst];
}

char* Segment::ring(int src, int dst) const {
  return base_ + rings_offset(nranks_, slot_bytes_) + (static_cast<size_t>(src) * nranks_ + dst) * chan_bytes_;
}

void Segment::prefault(int rank) const { std::memset(slot(rank, 0), 0, 2 * slot_bytes_); }

}  // namespace dtrain::shm
