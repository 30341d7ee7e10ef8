#include "checkpoint/write_order.h"

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <tuple>

#include "checkpoint/file_io.h"
#include "common/util.h"
#include "dtrain/errors.h"

namespace dtrain::ckpt {

namespace fs = std::filesystem;

// Note [Write order]: which checkpoint of a folder is the latest is the order they were written in,
// not their steps: a run restarted from an older checkpoint (or with its step counter reset) writes
// lower steps than files an abandoned timeline left, and its own newest write is what it must
// resume from and what rotation must keep. Each file's header carries a write stamp: nanoseconds
// since the epoch at the write, raised above every stamp already in the folder when the clock says
// less (set back, or another host's), so stamps order writes even where mtime (whole seconds on some
// file systems) or clocks would not. Files from before stamps (0) are older than any stamped one,
// ordered by step among themselves; a file whose header cannot be read has no known age and comes
// first (oldest): load_latest never picks it, and rotation removes it before any readable file. So
// does a file stamped more than kMaxStampLead ahead of this host's clock: no writer made it (a
// writer's stamp passes its clock only by the folder's newest stamp, and clocks are not a week
// apart), and taken as it is, it would stay the newest write for good (INT64_MAX: forever, and
// stamp + 1 overflowed), so that rotation deleted the real checkpoints and load_latest resumed from
// it. Every stamp a scan keeps is therefore below now + a week, far from overflowing.
constexpr std::chrono::hours kMaxStampLead{24 * 7};

namespace {

int64_t clock_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

}  // namespace

std::vector<Found> scan(const std::string& dir, const std::string& prefix) {
  std::vector<Found> found;
  const int64_t latest_stamp = clock_ns() + std::chrono::nanoseconds(kMaxStampLead).count();
  std::error_code ec;
  const std::string head = prefix + "_";
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    // Regular files only: a link of a checkpoint's name would be read (or rotated) as one.
    std::error_code kind;
    if (!fs::is_regular_file(it->symlink_status(kind))) continue;
    if (name.size() != head.size() + 10 + 3 || name.compare(0, head.size(), head) != 0 ||
        name.compare(name.size() - 3, 3, ".pt") != 0)
      continue;
    const std::string digits = name.substr(head.size(), 10);
    if (!util::is_digits(digits)) continue;
    Found f;
    f.path = it->path().string();
    f.step = std::stoll(digits);
    f.stamp = read_write_stamp(f.path, &f.why);
    if (f.stamp && *f.stamp > latest_stamp) {
      f.why = detail::cat("its write stamp ", *f.stamp, " is more than a week ahead of this host's clock (",
                          latest_stamp - std::chrono::nanoseconds(kMaxStampLead).count(),
                          " ns since the epoch): planted, or written under a wrong clock");
      f.stamp.reset();
    }
    found.push_back(std::move(f));
  }
  std::sort(found.begin(), found.end(), [](const Found& a, const Found& b) {
    return std::make_tuple(a.stamp.has_value(), a.stamp.value_or(0), a.step, a.path) <
           std::make_tuple(b.stamp.has_value(), b.stamp.value_or(0), b.step, b.path);
  });
  return found;
}

int64_t next_write_stamp(const std::vector<Found>& found) {
  int64_t stamp = std::max<int64_t>(clock_ns(), 1);
  for (const Found& f : found)
    if (f.stamp) stamp = std::max(stamp, *f.stamp + 1);  // scan() kept it below now + a week: no overflow
  return stamp;
}

const Found* later_step(const std::vector<Found>& found, const std::string& path, int64_t step) {
  const Found* later = nullptr;
  for (const Found& f : found)
    if (f.stamp && f.path != path && f.step > step && (!later || f.step > later->step)) later = &f;
  return later;
}

}  // namespace dtrain::ckpt
