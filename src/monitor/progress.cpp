// dtrain::Progress: a bar on a terminal, plain periodic lines elsewhere (logs, pipes, dtrain-run).
#include <unistd.h>

#include <algorithm>
#include <cstdio>

#include "common/env.h"
#include "dtrain/errors.h"
#include "dtrain/monitor.h"

namespace dtrain {
namespace {

std::string hms(double seconds) {
  const auto s = static_cast<int64_t>(std::max(0.0, seconds) + 0.5);
  char buf[32];
  if (s >= 3600)
    std::snprintf(buf, sizeof buf, "%lld:%02lld:%02lld", static_cast<long long>(s / 3600),
                  static_cast<long long>(s / 60 % 60), static_cast<long long>(s % 60));
  else
    std::snprintf(buf, sizeof buf, "%lld:%02lld", static_cast<long long>(s / 60), static_cast<long long>(s % 60));
  return buf;
}

}  // namespace

Progress::Progress(ProgressOptions options)
    : o_(std::move(options)),
      tty_(o_.terminal().value_or(o_.out() != nullptr && ::isatty(::fileno(o_.out())))),
      start_(std::chrono::steady_clock::now()),
      last_draw_(start_) {
  DTRAIN_CHECK(o_.total() > 0, "Progress: total must be > 0 steps, got ", o_.total());
  DTRAIN_CHECK(o_.lines() > 0, "Progress: lines must be > 0, got ", o_.lines());
  // Under dtrain-run our stdout is a pipe; the launcher says when it ends on a terminal and draws
  // the bar there itself from marked lines (Note [Launcher bar] in tools/dtrain-run/output.h).
  launcher_ = !tty_ && !o_.terminal().has_value() && o_.out() == stdout && env::flag("DTRAIN_PROGRESS_TTY");
}

std::string Progress::status(int64_t step, double loss, double samples_done) const {
  const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  if (samples_done < 0) samples_done = static_cast<double>(step * o_.samples_per_step());
  const double rate = elapsed > 0 ? samples_done / elapsed : 0.0;
  const double eta = step > 0 ? elapsed * (o_.total() - step) / step : 0.0;
  char buf[192];
  std::snprintf(buf, sizeof buf, "%3d%% %lld/%lld loss %.4f | %.0f samples/s | elapsed %s ETA %s",
                static_cast<int>(100 * step / o_.total()), static_cast<long long>(step),
                static_cast<long long>(o_.total()), loss, rate, hms(elapsed).c_str(), hms(eta).c_str());
  return buf;
}

void Progress::update(int64_t step, double loss, double samples_done) {
  if (!o_.out()) return;
  const int64_t total = o_.total();
  step = std::min(step, total);
  const std::string label = o_.label().empty() ? "" : o_.label() + " ";
  if (tty_ || launcher_) {
    const auto now = std::chrono::steady_clock::now();
    if (step == total || now - last_draw_ >= std::chrono::milliseconds(200) || !drawn_) {
      last_draw_ = now;
      drawn_ = true;
      constexpr int kWidth = 30;
      const int filled = static_cast<int>(kWidth * step / total);
      std::string bar(filled, '=');
      if (filled < kWidth) bar += '>' + std::string(kWidth - filled - 1, ' ');
      // A terminal: redrawn in place. The launcher: one marked line per state ("\r" first).
      std::fprintf(o_.out(), tty_ ? "\r%s[%s] %s\033[K" : "\r%s[%s] %s\n", label.c_str(), bar.c_str(),
                   status(step, loss, samples_done).c_str());
      std::fflush(o_.out());
    }
    if (tty_) return;
  }
  // Plain lines: one each time another 1/lines of the total is passed (the last step prints 100%).
  // Under the launcher's bar they go to its log files only ("\v" first).
  const int n = o_.lines();
  if (!o_.plain_lines() || next_line_ > n || step * n < next_line_ * total) return;
  while (next_line_ <= n && step * n >= next_line_ * total) ++next_line_;
  std::fprintf(o_.out(), "%s%s%s\n", launcher_ ? "\v" : "", label.c_str(), status(step, loss, samples_done).c_str());
  std::fflush(o_.out());
}

void Progress::finish() {
  if (!o_.out() || !drawn_) return;
  drawn_ = false;
  std::fprintf(o_.out(), tty_ ? "\n" : "\r\n");  // the launcher keeps the bar's last state as a line
  std::fflush(o_.out());
}

}  // namespace dtrain
