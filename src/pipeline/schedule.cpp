// Pipeline schedules: the ordered forward/backward actions of one stage.
//
// GPipe (fill-drain): F(0), F(1), ..., F(m-1), then B(m-1), ..., B(0). The backward runs the newest
// micro-batch first (its activations are the most recently touched), as torchgpipe does; every stage
// uses the same order, so the messages on each channel arrive in the order they are read.
//
// 1F1B (PipeDream-Flush, non-interleaved), stage s of p, m micro-batches:
//   warm-up:  w = min(p - s - 1, m) forwards F(0..w-1)
//   steady:   for i in 0..m-w-1: F(w + i), B(i)
//   cool-down: B(m-w..m-1)
// Stage s holds at most w + 1 = min(p - s, m) micro-batches' activations (the first stage p), instead of
// m: memory bounded by the number of stages, with the same bubble as GPipe.
#include "dtrain/pipeline.h"

#include <algorithm>

namespace dtrain {

std::string to_string(Schedule s) { return s == Schedule::kGPipe ? "GPipe" : "1F1B"; }

namespace pipeline {

std::vector<Action> make_schedule(Schedule schedule, int stages, int stage, int64_t chunks) {
  DTRAIN_CHECK(stages >= 1 && stage >= 0 && stage < stages, "pipeline schedule: stage ", stage, " is not in [0, ",
               stages, ")");
  DTRAIN_CHECK(chunks >= 1, "pipeline: chunks must be >= 1, got ", chunks);
  std::vector<Action> out;
  out.reserve(2 * chunks);
  if (schedule == Schedule::kGPipe) {
    for (int64_t i = 0; i < chunks; ++i) out.push_back({Action::kForward, i});
    for (int64_t i = chunks - 1; i >= 0; --i) out.push_back({Action::kBackward, i});
    return out;
  }
  const int64_t warmup = std::min<int64_t>(stages - stage - 1, chunks);
  for (int64_t i = 0; i < warmup; ++i) out.push_back({Action::kForward, i});
  for (int64_t i = 0; i < chunks - warmup; ++i) {
    out.push_back({Action::kForward, warmup + i});
    out.push_back({Action::kBackward, i});
  }
  for (int64_t i = chunks - warmup; i < chunks; ++i) out.push_back({Action::kBackward, i});
  return out;
}

}  // namespace pipeline
}  // namespace dtrain
