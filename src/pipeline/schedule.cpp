// Pipeline schedules: the ordered forward/backward actions of one rank.
//
// Notation: p pipeline ranks, this rank r, v model chunks per rank (virtual stages; 1 except for the
// interleaved schedule), m micro-batches. Rank r holds the stages r, r + p, ..., r + (v-1)p of the p*v.
//
// GPipe (fill-drain): F(0), F(1), ..., F(m-1), then B(m-1), ..., B(0). The backward runs the newest
// micro-batch first (its activations are the most recently touched), as torchgpipe does; every stage
// uses the same order, so the messages on each channel arrive in the order they are read.
//
// The 1F1B family (1F1B, interleaved 1F1B, ZB-H1) is one loop with three parameters, as Megatron and
// torch.distributed.pipelining build it:
//   1. warm-up:   the first w forward ops;
//   2. steady:    for j in 0..mv-w-1: forward op w + j, then backward op j;
//   3. cool-down: the backward ops mv-w..mv-1;
//   4. forward op j runs chunk (j / p) mod v, backward op j runs chunk v-1 - (j / p) mod v (the last
//      chunk first), and each chunk takes its micro-batches in order 0, 1, ..., m-1;
//   5. ZB-H1 only: each backward op is B (the input gradient) and queues its W (the weight gradient);
//      from backward op r on, one queued W (the oldest) follows each B, and the queue is emptied at the
//      end, so rank r holds back r W's and runs them in the cool-down's bubble.
// Because every rank runs the same sequence of (chunk, micro-batch) in its forwards and in its
// backwards, what rank r sends rank r+1 (or the last rank rank 0, one chunk further) arrives in the
// order the receiver reads it.
//   1F1B (PipeDream-Flush):   v = 1, w = min(p-r-1, m). Rank r stores at most min(p-r, m) micro-batches'
//                             activations: memory bounded by the number of stages, GPipe's bubble.
//   Interleaved 1F1B:         w = min((v-1)p + 2(p-r-1), mv) chunk forwards, m a multiple of p. The
//                             bubble is (p-1)/v of a 1F1B stage's; rank r stores at most w + 1 chunks'
//                             activations (of 1/v of its layers each): 1 + (p-1)/(pv) times 1F1B's.
//   ZB-H1 (Qi et al. 2024):   v = 1, w = min(p-r-1, m), W held back by r. Forwards not yet through B stay
//                             min(p-r, m) as in 1F1B, and at most min(p, m) micro-batches are waiting for
//                             B or W; with F, B, W of equal cost the bubble is (p-1) instead of 3(p-1).
#include <deque>

#include "dtrain/pipeline.h"

namespace dtrain {

std::string to_string(Schedule s) {
  switch (s) {
    case Schedule::kGPipe:
      return "GPipe";
    case Schedule::k1F1B:
      return "1F1B";
    case Schedule::kInterleaved1F1B:
      return "Interleaved1F1B";
    case Schedule::kZeroBubbleH1:
      return "ZeroBubbleH1";
  }
  return "Schedule(" + std::to_string(static_cast<int>(s)) + ")";
}

namespace pipeline {

void check_schedule(Schedule schedule, int stages, int64_t chunks, int virtual_stages) {
  DTRAIN_CHECK(chunks >= 1, "pipeline: chunks must be >= 1, got ", chunks);
  DTRAIN_CHECK(virtual_stages >= 1, "PipelineOptions: virtual_stages must be >= 1, got ", virtual_stages);
  if (schedule != Schedule::kInterleaved1F1B) {
    DTRAIN_CHECK(virtual_stages == 1, "PipelineOptions: virtual_stages=", virtual_stages, " needs ",
                 "Schedule::kInterleaved1F1B; ", to_string(schedule),
                 " runs one stage per rank: use virtual_stages(1) or the interleaved schedule");
    return;
  }
  DTRAIN_CHECK(stages >= 2, "PipelineOptions: Interleaved1F1B needs at least 2 pipeline ranks, got ", stages,
               ": use Schedule::k1F1B");
  DTRAIN_CHECK(chunks % stages == 0, "PipelineOptions: Interleaved1F1B needs chunks to be a multiple of the ", stages,
               " pipeline ranks, got chunks=", chunks, ": use chunks=", (chunks / stages + 1) * stages);
}

namespace {

// Steps 1-5 of the 1F1B family (top of this file); w_delay < 0: no split backward.
std::vector<Action> one_f_one_b(int p, int r, int v, int64_t m, int64_t warmup, int64_t w_delay) {
  const int64_t ops = m * v;
  std::vector<Action> out;
  out.reserve(3 * ops);
  std::vector<int64_t> next_f(v, 0), next_b(v, 0);
  std::deque<Action> held_w;
  auto forward = [&](int64_t j) {
    const int c = static_cast<int>((j / p) % v);
    out.push_back({Action::kForward, next_f[c]++, c * p + r});
  };
  auto backward = [&](int64_t j) {
    const int c = v - 1 - static_cast<int>((j / p) % v);
    out.push_back({Action::kBackward, next_b[c]++, c * p + r});
    if (w_delay < 0) return;
    held_w.push_back({Action::kWeight, out.back().micro_batch, out.back().stage});
    if (j >= w_delay) {
      out.push_back(held_w.front());
      held_w.pop_front();
    }
  };
  for (int64_t j = 0; j < warmup; ++j) forward(j);
  for (int64_t j = 0; j < ops - warmup; ++j) {
    forward(warmup + j);
    backward(j);
  }
  for (int64_t j = ops - warmup; j < ops; ++j) backward(j);
  out.insert(out.end(), held_w.begin(), held_w.end());
  return out;
}

}  // namespace

std::vector<Action> make_schedule(Schedule schedule, int stages, int stage, int64_t chunks, int virtual_stages) {
  DTRAIN_CHECK(stages >= 1 && stage >= 0 && stage < stages, "pipeline schedule: stage ", stage, " is not in [0, ",
               stages, ")");
  check_schedule(schedule, stages, chunks, virtual_stages);
  const int p = stages, r = stage, v = virtual_stages;
  const int64_t m = chunks;
  switch (schedule) {
    case Schedule::kGPipe: {
      std::vector<Action> out;
      for (int64_t i = 0; i < m; ++i) out.push_back({Action::kForward, i, r});
      for (int64_t i = m - 1; i >= 0; --i) out.push_back({Action::kBackward, i, r});
      return out;
    }
    case Schedule::k1F1B:
      return one_f_one_b(p, r, 1, m, std::min<int64_t>(p - r - 1, m), -1);
    case Schedule::kInterleaved1F1B:
      return one_f_one_b(p, r, v, m, std::min<int64_t>(static_cast<int64_t>(v - 1) * p + 2 * (p - r - 1), m * v), -1);
    case Schedule::kZeroBubbleH1:
      return one_f_one_b(p, r, 1, m, std::min<int64_t>(p - r - 1, m), r);
  }
  DTRAIN_CHECK(false, "pipeline: unknown schedule ", static_cast<int>(schedule));
  return {};
}

std::string to_string(const Action& a) {
  const char* kind = a.kind == Action::kForward ? "F" : a.kind == Action::kBackward ? "B" : "W";
  return kind + std::to_string(a.micro_batch);
}

}  // namespace pipeline
}  // namespace dtrain
