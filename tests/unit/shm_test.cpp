// The shared-memory collectives (src/comm/shm) on real processes: fork() N ranks that attach to one
// segment, run collectives, and report failures through a pipe. Torch-free and fast.
#include <gtest/gtest.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cmath>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "comm/shm/comm.h"
#include "dtrain/errors.h"
#include "shm_fork.h"
#include "test_util.h"
#include "matchers.h"

using namespace dtrain::shm;
using shm_fork::expect_ok;
using shm_fork::Fn;
using shm_fork::kSlot;
using shm_fork::run_ranks;

namespace {

// Deterministic per-rank data with values that make float sums order-sensitive.
float value(int rank, size_t i) {
  return static_cast<float>((i * 7919 + rank * 104729) % 1000) * 0.001f + rank * 1e-3f;
}

template <class T>
void check_reduce(int n, size_t count, DType dt, RedOp op, size_t slot = kSlot) {
  auto errors = run_ranks(
      n,
      [&](Comm& c, int r) {
        std::vector<T> data(count);
        for (size_t i = 0; i < count; ++i) data[i] = T(value(r, i));
        c.all_reduce(data.data(), count, dt, op);
        for (size_t i = 0; i < count; ++i) {
          // Expected: combined in rank order, rounded to T after every step (as the kernels do).
          T acc = T(value(0, i));
          for (int k = 1; k < n; ++k) {
            float a = static_cast<float>(acc), b = static_cast<float>(T(value(k, i)));
            double ad = static_cast<double>(acc), bd = static_cast<double>(T(value(k, i)));
            switch (op) {
              case RedOp::SUM:
                acc = std::is_same_v<T, double> ? T(ad + bd) : T(a + b);
                break;
              case RedOp::PROD:
                acc = std::is_same_v<T, double> ? T(ad * bd) : T(a * b);
                break;
              case RedOp::MIN:
                acc = T(std::min(ad, bd));
                break;
              case RedOp::MAX:
                acc = T(std::max(ad, bd));
                break;
            }
          }
          if (std::memcmp(&acc, &data[i], sizeof(T)) != 0)
            throw std::runtime_error("element " + std::to_string(i) +
                                     " differs: " + std::to_string(static_cast<double>(data[i])) + " vs " +
                                     std::to_string(static_cast<double>(acc)));
        }
      },
      std::chrono::seconds(10), slot);
  expect_ok(errors);
}

// all_reduce_divided over `sizes` pieces: every element is each rank's value divided by `divisor`,
// summed in rank order, bit for bit. Ranks in `flat_ranks` take the other way instead: a flat copy
// divided by themselves and all_reduce(SUM), as a rank whose gradients cannot be used in place does.
template <class T>
void check_divided(int n, const std::vector<size_t>& sizes, DType dt, double divisor, std::vector<int> flat_ranks,
                   size_t slot = kSlot) {
  size_t count = 0;
  for (size_t s : sizes) count += s;
  auto errors = run_ranks(
      n,
      [&](Comm& c, int r) {
        std::vector<std::vector<T>> pieces;
        size_t i = 0;
        for (size_t s : sizes) {
          pieces.emplace_back(s);
          for (auto& x : pieces.back()) x = T(value(r, i++));
        }
        std::vector<T> flat;
        if (std::find(flat_ranks.begin(), flat_ranks.end(), r) != flat_ranks.end()) {
          for (size_t j = 0; j < count; ++j) flat.push_back(T(value(r, j)) / static_cast<T>(divisor));
          c.all_reduce(flat.data(), count, dt, RedOp::SUM);
        } else {
          std::vector<Comm::Piece> ps;
          for (auto& p : pieces) ps.push_back({p.data(), p.size()});
          c.all_reduce_divided(ps.data(), ps.size(), dt, divisor);
          for (auto& p : pieces) flat.insert(flat.end(), p.begin(), p.end());
        }
        for (size_t j = 0; j < count; ++j) {
          T acc = T(value(0, j)) / static_cast<T>(divisor);
          for (int k = 1; k < n; ++k) acc = acc + T(value(k, j)) / static_cast<T>(divisor);
          if (std::memcmp(&acc, &flat[j], sizeof(T)) != 0)
            throw std::runtime_error("rank " + std::to_string(r) + ": element " + std::to_string(j) +
                                     " differs: " + std::to_string(static_cast<double>(flat[j])) + " vs " +
                                     std::to_string(static_cast<double>(acc)));
        }
      },
      std::chrono::seconds(10), slot);
  expect_ok(errors);
}

// reduce_scatter of `count` elements per rank: rank r's output is, bit for bit, what all_reduce of
// the whole input gives in part r (the same rank order), and the input is left as it was.
template <class T>
void check_reduce_scatter(int n, size_t count, DType dt, RedOp op, size_t slot = kSlot) {
  auto errors = run_ranks(
      n,
      [&](Comm& c, int r) {
        std::vector<T> in(n * count), whole(n * count), out(count, T(-7.0f));
        for (size_t i = 0; i < in.size(); ++i) whole[i] = in[i] = T(value(r, i));
        c.reduce_scatter(in.data(), out.data(), count, dt, op);
        c.all_reduce(whole.data(), whole.size(), dt, op);
        for (size_t i = 0; i < in.size(); ++i)
          if (const T x = T(value(r, i)); std::memcmp(&in[i], &x, sizeof(T)) != 0)
            throw std::runtime_error("input element " + std::to_string(i) + " changed");
        for (size_t i = 0; i < count; ++i)
          if (std::memcmp(&out[i], &whole[r * count + i], sizeof(T)) != 0)
            throw std::runtime_error("rank " + std::to_string(r) + ": element " + std::to_string(i) +
                                     " differs from all_reduce's: " + std::to_string(static_cast<double>(out[i])) +
                                     " vs " + std::to_string(static_cast<double>(whole[r * count + i])));
      },
      std::chrono::seconds(10), slot);
  expect_ok(errors);
}

}  // namespace

// Sizes around the slot (4 KiB: 1024 float32, split n ways per step), empty and one element, every
// dtype and reduce op, 1 to 4 ranks.
TEST(ShmComm, ReduceScatterEqualsAllReducesPartOfEveryRank) {
  for (int n : {1, 2, 3, 4})
    for (size_t count : {size_t{0}, size_t{1}, size_t{7}, size_t{341}, size_t{342}, size_t{1025}, size_t{5003}}) {
      check_reduce_scatter<float>(n, count, DType::F32, RedOp::SUM);
      check_reduce_scatter<double>(n, count, DType::F64, RedOp::SUM);
      check_reduce_scatter<c10::BFloat16>(n, count, DType::BF16, RedOp::SUM);
      check_reduce_scatter<c10::Half>(n, count, DType::F16, RedOp::SUM);
    }
  for (RedOp op : {RedOp::PROD, RedOp::MIN, RedOp::MAX}) {
    check_reduce_scatter<float>(3, 1000, DType::F32, op);
    check_reduce_scatter<c10::BFloat16>(2, 3000, DType::BF16, op);
  }
  check_reduce_scatter<float>(4, 100000, DType::F32, RedOp::SUM, 64 * 1024);
}

TEST(ShmComm, ReduceScatterAgainstAnotherCollectiveFailsEveryRankNamingBoth) {
  auto errors = run_ranks(2, [&](Comm& c, int r) {
    std::vector<float> in(8, 1.0f), out(4);
    if (r == 0)
      c.reduce_scatter(in.data(), out.data(), 4, DType::F32, RedOp::SUM);
    else
      c.all_reduce(in.data(), 8, DType::F32, RedOp::SUM);
  });
  for (const auto& e : errors) {
    EXPECT_THAT(e, HasSubstr("mismatched collectives")) << e;
    EXPECT_THAT(e, HasSubstr("reduce_scatter of 4 float32 per rank (SUM)")) << e;
  }
}

// DDP's last bucket averaged in the gradients themselves: pieces of any size (empty ones, ones that
// straddle the parts and the chunks), 1 to 4 ranks, any divisor, and ranks that mix the two ways.
TEST(ShmComm, AllReduceDividedOfPiecesEqualsDividingThenSumming) {
  const std::vector<size_t> sizes{0, 1, 700, 0, 5000, 3, 20011};
  for (int n : {1, 2, 3, 4}) {
    check_divided<float>(n, sizes, DType::F32, n, {});
    check_divided<double>(n, sizes, DType::F64, 3, {});
    check_divided<float>(n, {1}, DType::F32, n, {});
  }
  check_divided<float>(2, sizes, DType::F32, 2, {1});
  check_divided<float>(3, sizes, DType::F32, 3, {0, 2});
  check_divided<double>(4, sizes, DType::F64, 4, {3}, 64 * 1024);
}

TEST(ShmComm, AllReduceSumFloatAcrossChunkBoundaries) {
  for (int n : {2, 3})
    for (size_t count : {size_t{0}, size_t{1}, size_t{5}, size_t{1024}, size_t{1025}, size_t{10007}})
      check_reduce<float>(n, count, DType::F32, RedOp::SUM);
}

TEST(ShmComm, AllReduceOpsAndDtypes) {
  for (int n : {2, 3}) {
    check_reduce<float>(n, 3000, DType::F32, RedOp::MIN);
    check_reduce<float>(n, 3000, DType::F32, RedOp::MAX);
    check_reduce<float>(n, 3000, DType::F32, RedOp::PROD);
    check_reduce<double>(n, 3000, DType::F64, RedOp::SUM);
    check_reduce<c10::Half>(n, 5000, DType::F16, RedOp::SUM);
    check_reduce<c10::Half>(n, 3001, DType::F16, RedOp::MIN);
    check_reduce<c10::Half>(n, 3001, DType::F16, RedOp::MAX);
    check_reduce<c10::BFloat16>(n, 5000, DType::BF16, RedOp::SUM);
  }
}

// Slots of 64 KB: each rank's part spans several of combine_streaming's 4 KB blocks, and counts that
// do not divide evenly leave the last part ending inside a block.
TEST(ShmComm, AllReduceWithLargeSlotsStreamsManyBlocks) {
  constexpr size_t kBig = 64 * 1024;
  for (int n : {2, 3, 4}) {
    check_reduce<float>(n, 50001, DType::F32, RedOp::SUM, kBig);
    check_reduce<float>(n, 20000, DType::F32, RedOp::MAX, kBig);
    check_reduce<double>(n, 20001, DType::F64, RedOp::MIN, kBig);
    check_reduce<c10::Half>(n, 70001, DType::F16, RedOp::SUM, kBig);
    check_reduce<c10::BFloat16>(n, 70003, DType::BF16, RedOp::SUM, kBig);
  }
}

// An all_reduce of at most 64 KB (one slot of 64 KB here) is one step in which every rank reduces
// the whole tensor from the slots: the same bits as the steps in parts, for every rank count, dtype,
// op, divided pieces (ranks 0 and 1 divide their own values as they enter, higher ranks take them
// from their slot), and at the boundary (16384 float32 in one step, 16385 in parts).
TEST(ShmComm, SmallAllReducesInOneStepKeepTheBitsOfTheStepsInParts) {
  constexpr size_t kBig = 64 * 1024;
  for (int n : {1, 2, 3, 4}) {
    for (size_t count : {size_t{1}, size_t{3001}, size_t{16384}, size_t{16385}})
      check_reduce<float>(n, count, DType::F32, RedOp::SUM, kBig);
    check_reduce<float>(n, 3001, DType::F32, RedOp::MIN, kBig);
    check_reduce<float>(n, 3001, DType::F32, RedOp::MAX, kBig);
    check_reduce<float>(n, 3001, DType::F32, RedOp::PROD, kBig);
    check_reduce<double>(n, 8191, DType::F64, RedOp::SUM, kBig);
    check_reduce<c10::Half>(n, 20001, DType::F16, RedOp::SUM, kBig);
    check_reduce<c10::BFloat16>(n, 20001, DType::BF16, RedOp::MAX, kBig);
    check_divided<float>(n, {0, 1, 700, 0, 5000, 3}, DType::F32, n, {}, kBig);
  }
  check_divided<float>(3, {0, 1, 700, 0, 5000, 3}, DType::F32, 3, {0, 2}, kBig);
  check_divided<double>(4, {4000, 3}, DType::F64, 4, {1, 3}, kBig);
}

// Calls on either side of the one-step boundary take different paths: the descriptor check still
// fails both ranks, naming both calls, before either reads the other's slot.
TEST(ShmComm, OneStepAgainstStepsInPartsFailsEveryRankNamingBoth) {
  auto errors = run_ranks(
      2,
      [&](Comm& c, int r) {
        std::vector<float> data(16385, 1.0f);
        c.all_reduce(data.data(), r == 0 ? 16384 : 16385, DType::F32, RedOp::SUM);
      },
      std::chrono::seconds(10), 64 * 1024);
  ASSERT_EQ(errors.size(), 2u);
  for (const auto& e : errors) {
    EXPECT_THAT(e, HasSubstr("mismatched collectives")) << e;
    EXPECT_THAT(e, HasSubstr("all_reduce of 16384 float32 (SUM)")) << e;
    EXPECT_THAT(e, HasSubstr("all_reduce of 16385 float32 (SUM)")) << e;
  }
}

// combine_streaming equals combine for every alignment, length and the aliasing the collectives use
// (out == a or out == b, shared == a).
TEST(ShmKernels, StreamingCombineMatchesCombine) {
  const size_t n = 3000;
  for (size_t shift : {size_t{0}, size_t{1}, size_t{3}, size_t{7}})
    for (size_t count : {size_t{0}, size_t{1}, size_t{17}, size_t{1024}, size_t{1025}, n - 8})
      for (int alias : {0, 1, 2, 3}) {  // none, out == a, out == b, shared == a
        std::vector<float> a(n), b(n), out(n, -1.f), shared(n, -2.f), want(n);
        for (size_t i = 0; i < n; ++i) {
          a[i] = value(0, i);
          b[i] = value(1, i);
        }
        combine(want.data() + shift, a.data() + shift, b.data() + shift, count, DType::F32, RedOp::SUM);
        float* o = alias == 1 ? a.data() : alias == 2 ? b.data() : out.data();
        float* sh = alias == 3 ? a.data() : shared.data();
        combine_streaming(o + shift, sh + shift, a.data() + shift, b.data() + shift, count, DType::F32, RedOp::SUM);
        for (size_t i = 0; i < count; ++i) {
          ASSERT_EQ(o[shift + i], want[shift + i]) << "shift " << shift << " count " << count << " alias " << alias;
          ASSERT_EQ(sh[shift + i], want[shift + i]) << "shift " << shift << " count " << count << " alias " << alias;
        }
        if (alias != 3 && shift > 0) {
          ASSERT_EQ(shared[shift - 1], -2.f);  // nothing written outside
        }
        if (alias != 3) {
          ASSERT_EQ(shared[shift + count], -2.f);
        }
      }
}

// float16 takes a vectorized F16C path on CPUs that have it: every op, on values that round, overflow
// to infinity, are subnormal, signed zeros, infinities and NaNs, at lengths with and without a tail,
// equals c10::Half's own conversions element by element (NaN: any NaN).
TEST(ShmKernels, Float16CombineEqualsCHalfConversions) {
  const float specials[] = {0.f,   -0.f,   1.f,      -1.5f,     0.1f, 65504.f, 60000.f, -60000.f, 6e-8f,
                            3e-5f, -2e-7f, INFINITY, -INFINITY, NAN,  1e-3f,   333.3f,  2049.f,   0.33325f};
  const size_t ns = sizeof(specials) / sizeof(specials[0]);
  for (size_t count : {size_t{1}, size_t{7}, size_t{8}, size_t{9}, size_t{ns * ns}, size_t{ns * ns + 5}}) {
    std::vector<c10::Half> a(count), b(count), out(count);
    for (size_t i = 0; i < count; ++i) {
      a[i] = c10::Half(i < ns * ns ? specials[i % ns] : value(0, i));
      b[i] = c10::Half(i < ns * ns ? specials[i / ns] : value(1, i));
    }
    for (RedOp op : {RedOp::SUM, RedOp::PROD, RedOp::MIN, RedOp::MAX}) {
      combine(out.data(), a.data(), b.data(), count, DType::F16, op);
      for (size_t i = 0; i < count; ++i) {
        const float x = static_cast<float>(a[i]), y = static_cast<float>(b[i]);
        const float r = op == RedOp::SUM    ? x + y
                        : op == RedOp::PROD ? x * y
                        : op == RedOp::MIN  ? std::min(x, y)
                                            : std::max(x, y);
        const c10::Half want(r);
        const float got = static_cast<float>(out[i]);
        if (std::isnan(static_cast<float>(want))) {
          ASSERT_TRUE(std::isnan(got)) << to_string(op) << " of " << x << " and " << y << " gave " << got;
        } else {
          ASSERT_EQ(std::memcmp(&want, &out[i], sizeof(c10::Half)), 0)
              << to_string(op) << " of " << x << " and " << y << ": " << got << " instead of "
              << static_cast<float>(want);
        }
      }
    }
  }
}

TEST(ShmComm, ManyBackToBackOpsKeepTheirOrder) {
  expect_ok(run_ranks(3, [](Comm& c, int r) {
    for (int it = 0; it < 300; ++it) {
      float x = static_cast<float>(r + it);
      c.all_reduce(&x, 1, DType::F32, RedOp::SUM);
      if (x != static_cast<float>(3 * it + 3)) throw std::runtime_error("iteration " + std::to_string(it));
    }
  }));
}

TEST(ShmComm, BroadcastFromEveryRoot) {
  for (int n : {2, 3})
    expect_ok(run_ranks(n, [n](Comm& c, int r) {
      for (int root = 0; root < n; ++root) {
        std::vector<uint8_t> buf(3 * kSlot + 17, static_cast<uint8_t>(r));
        if (r == root)
          for (size_t i = 0; i < buf.size(); ++i) buf[i] = static_cast<uint8_t>(i * 31 + root);
        c.broadcast(buf.data(), buf.size(), root);
        for (size_t i = 0; i < buf.size(); ++i)
          if (buf[i] != static_cast<uint8_t>(i * 31 + root)) throw std::runtime_error("byte " + std::to_string(i));
      }
    }));
}

TEST(ShmComm, AllGatherAndBarrier) {
  expect_ok(run_ranks(3, [](Comm& c, int r) {
    const size_t bytes = 2 * kSlot + 5;
    std::vector<uint8_t> in(bytes);
    for (size_t i = 0; i < bytes; ++i) in[i] = static_cast<uint8_t>(i + 40 * r);
    std::vector<std::vector<uint8_t>> out(3, std::vector<uint8_t>(bytes));
    void* outs[3] = {out[0].data(), out[1].data(), out[2].data()};
    c.all_gather(in.data(), bytes, outs);
    for (int k = 0; k < 3; ++k)
      for (size_t i = 0; i < bytes; ++i)
        if (out[k][i] != static_cast<uint8_t>(i + 40 * k)) throw std::runtime_error("gathered byte differs");
    c.barrier();
  }));
}

TEST(ShmComm, MismatchedShapesFailEveryRankWithBothCalls) {
  auto start = std::chrono::steady_clock::now();
  auto errors = run_ranks(
      2,
      [](Comm& c, int r) {
        std::vector<float> data(r == 0 ? 10 : 20, 1.f);
        c.all_reduce(data.data(), data.size(), DType::F32, RedOp::SUM);
      },
      std::chrono::duration_cast<std::chrono::milliseconds>(dtrain::test_util::scaled(std::chrono::seconds(10))));
  EXPECT_LT(std::chrono::steady_clock::now() - start, dtrain::test_util::scaled(std::chrono::seconds(5)));
  for (const auto& e : errors) {
    EXPECT_THAT(e, HasSubstr("mismatched collectives")) << e;
    EXPECT_THAT(e, HasSubstr("all_reduce of 10 float32 (SUM)")) << e;
    EXPECT_THAT(e, HasSubstr("all_reduce of 20 float32 (SUM)")) << e;
  }
}

TEST(ShmComm, DifferentOperationsAreCaught) {
  auto errors = run_ranks(2, [](Comm& c, int r) {
    float x = 1;
    if (r == 0)
      c.all_reduce(&x, 1, DType::F32, RedOp::SUM);
    else
      c.broadcast(&x, sizeof(x), 0);
  });
  EXPECT_THAT(errors[0], HasSubstr("broadcast of 4 bytes from rank 0")) << errors[0];
  EXPECT_THAT(errors[1], HasSubstr("mismatched collectives")) << errors[1];
}

TEST(ShmComm, AMissingRankTimesOutNamingIt) {
  shm_fork::SharedFlag timed_out;
  auto errors = run_ranks(
      2,
      [&](Comm& c, int r) {
        float x = 1;
        if (r == 0)
          timed_out.set_on_throw([&] { c.all_reduce(&x, 1, DType::F32, RedOp::SUM); });
        else
          timed_out.wait();  // alive but never calls, until rank 0 has given up
      },
      std::chrono::milliseconds(300));
  EXPECT_THAT(errors[0], HasSubstr("timed out after 300 ms waiting for rank 1")) << errors[0];
  EXPECT_EQ(errors[1], "");
}

TEST(ShmComm, ADeadRankIsNoticedWithoutWaitingForTheTimeout) {
  auto start = std::chrono::steady_clock::now();
  auto errors = run_ranks(
      2,
      [](Comm& c, int r) {
        float x = 1;
        if (r == 1) _exit(3);
        c.all_reduce(&x, 1, DType::F32, RedOp::SUM);
      },
      std::chrono::duration_cast<std::chrono::milliseconds>(dtrain::test_util::scaled(std::chrono::seconds(30))));
  EXPECT_LT(std::chrono::steady_clock::now() - start, dtrain::test_util::scaled(std::chrono::seconds(5)));
  EXPECT_THAT(errors[0], HasSubstr("rank 1 (pid")) << errors[0];
  EXPECT_THAT(errors[0], HasSubstr("exited")) << errors[0];
}

// docs/features.md: "a rank that died is noticed within 50 ms". Rank 1 dies while rank 0 already waits in the
// all-reduce (asleep on the futex by then); rank 0 must fail within 50 ms of the death. The waits
// look for dead peers every 10 ms, so the median of the trials over 50 ms is not noise; a single
// trial may be late by a time slice on a loaded machine, but never by seconds.
TEST(ShmComm, ADeadRankIsNoticedWithin50Milliseconds) {
  using Clock = std::chrono::steady_clock;
  // [0]: when rank 1 died, [1]: when rank 0's all-reduce failed (steady clock, shared by fork()).
  auto* t = static_cast<std::atomic<int64_t>*>(
      mmap(nullptr, 2 * sizeof(std::atomic<int64_t>), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0));
  ASSERT_NE(t, MAP_FAILED);
  auto now_ns = [] {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch()).count();
  };
  std::vector<double> noticed_ms;
  for (int trial = 0; trial < 5; ++trial) {
    t[0] = t[1] = 0;
    auto errors = run_ranks(
        2,
        [&](Comm& c, int r) {
          float x = 1;
          if (r == 1) {
            usleep(100 * 1000 + trial * 7000);  // a different phase against the waiter's checks each time
            t[0] = now_ns();
            _exit(3);
          }
          try {
            c.all_reduce(&x, 1, DType::F32, RedOp::SUM);
          } catch (...) {
            t[1] = now_ns();
            throw;
          }
        },
        std::chrono::seconds(30));
    EXPECT_THAT(errors[0], HasSubstr("exited")) << errors[0];
    ASSERT_TRUE(t[0] > 0 && t[1] > 0) << "rank 1 did not die, or rank 0 did not fail";
    const double ms = (t[1] - t[0]) / 1e6;
    std::printf("trial %d: rank 0 noticed the death after %.2f ms\n", trial, ms);
    EXPECT_LT(ms, 1000.0 * dtrain::test_util::kTimeScale) << "trial " << trial;
    noticed_ms.push_back(ms);
  }
  std::sort(noticed_ms.begin(), noticed_ms.end());
  EXPECT_LT(noticed_ms[noticed_ms.size() / 2], 50.0 * dtrain::test_util::kTimeScale) << "the median of 5 trials";
  munmap(t, 2 * sizeof(std::atomic<int64_t>));
}

TEST(ShmSegment, AttachChecksTheSizeAndUnlinkRemovesTheName) {
  Segment seg = Segment::create(Segment::unique_name("size"), 2, kSlot);
  try {
    Segment::attach(seg.name(), 3, kSlot);
    ADD_FAILURE() << "attach with the wrong rank count succeeded";
  } catch (const dtrain::Error& e) {
    EXPECT_THAT(std::string(e.what()), HasSubstr("expected")) << e.what();
  }
  const std::string name = seg.name();
  seg.unlink();
  EXPECT_EQ(shm_open(name.c_str(), O_RDWR, 0600), -1);
  EXPECT_NE(Segment::unique_name("x"), Segment::unique_name("x"));
  // docs/features.md: the names carry the creator's pid and a random 64-bit id (16 hex digits).
  const std::string n = Segment::unique_name("x");
  EXPECT_EQ(n.rfind("/dtrain-" + std::to_string(getpid()) + "-", 0), 0u) << n;
  EXPECT_EQ(n.size(), std::string("/dtrain-" + std::to_string(getpid()) + "-").size() + 16 + 2) << n;
}

// The segment's name comes from the store, which anyone who reaches it can write: attach maps only
// what this job's creator could have made. A segment planted under the expected name with mode
// 0666 (or owned by another user, or under a name unique_name() never makes) is refused, naming why.
TEST(ShmSegment, AttachRefusesASegmentThisJobCouldNotHaveMade) {
  auto refusal = [](const std::string& name) {
    try {
      Segment::attach(name, 2, kSlot);
    } catch (const dtrain::Error& e) {
      return std::string(e.what());
    }
    return std::string("attached");
  };
  Segment planted = Segment::create(Segment::unique_name("planted"), 2, kSlot);
  const int fd = shm_open(planted.name().c_str(), O_RDWR, 0);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(fchmod(fd, 0666), 0);
  EXPECT_THAT(refusal(planted.name()), HasSubstr("the shared-memory segment " + planted.name() +
                                                 " has mode 0666, not 0600: it is not one this job's ranks created"));
  ASSERT_EQ(fchmod(fd, 0600), 0);
  EXPECT_EQ(refusal(planted.name()), "attached");
  if (geteuid() == 0) {  // only root can give a segment to another user
    ASSERT_EQ(fchown(fd, 65534, 65534), 0);
    EXPECT_THAT(refusal(planted.name()), HasSubstr(" is owned by uid 65534, not this process's 0")) << "as root";
  }
  close(fd);
  EXPECT_THAT(refusal("/../../tmp/x"), HasSubstr("is not one unique_name() makes"));
  EXPECT_THAT(refusal("/somebody-else"), HasSubstr("is not one unique_name() makes"));
}
