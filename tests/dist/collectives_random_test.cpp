// A seeded random sequence of collectives (every kind, dtype, reduce op, root and size class, sync
// and async) checked against exact references (collectives_reference.h), on 2 and 3 ranks, over
// shared memory and with DTRAIN_SHM=0; then the same sequence with failures injected, after each of
// which the group must still work on every rank; and a failure after data moved, which must break the
// group on every rank at once (Note [Broken groups]). DTRAIN_TEST_SEED replays a sequence.
#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <functional>
#include <iterator>
#include <random>

#include "collectives_reference.h"
#include "dist_main.h"
#include "dtrain/errors.h"
#include "test_util.h"
#include "matchers.h"

using namespace dtrain;
using namespace dtrain::test_ref;
using dtrain::test_util::dtrain_error_of;

namespace {

int R() { return rank(); }
int N() { return world_size(); }

uint64_t seed() {
  const char* s = std::getenv("DTRAIN_TEST_SEED");
  return s ? std::strtoull(s, nullptr, 10) : 20261201;
}

size_t slot_bytes() {
  const char* s = std::getenv("DTRAIN_SHM_SLOT_BYTES");
  return s ? std::strtoull(s, nullptr, 10) : 1 << 20;
}

struct Op {
  int index = 0;
  Kind kind = Kind::kAllReduce;
  at::ScalarType dtype = at::kFloat;
  ReduceOp rop = ReduceOp::SUM;
  int root = 0;
  int64_t numel = 0;
  bool async = false;
};

std::string describe(const Op& op, uint64_t s) {
  return dtrain::detail::cat("seed ", s, " (DTRAIN_TEST_SEED), op #", op.index, ": ", name(op.kind), " of ", op.numel,
                             " ", c10::toString(op.dtype), reduces(op.kind) ? " " + to_string(op.rop) : std::string(),
                             ", root ", op.root, op.async ? ", async" : ", sync", " on rank ", R(), " of ", N());
}

// Every rank draws the same sequence. Sizes: 0, 1, small, a few thousand, and around one or more
// shared-memory chunks (DTRAIN_SHM_SLOT_BYTES), where the chunking has its edges.
Op draw(std::mt19937_64& g, int index) {
  static const at::ScalarType dtypes[] = {at::kFloat, at::kDouble, at::kBFloat16, at::kHalf,
                                          at::kInt,   at::kLong,   at::kShort};
  auto pick = [&](size_t n) { return static_cast<size_t>(g() % n); };
  Op op;
  op.index = index;
  op.kind = kKinds[pick(std::size(kKinds))];
  op.dtype = dtypes[pick(std::size(dtypes))];
  op.rop = static_cast<ReduceOp>(pick(5));
  if (op.rop == ReduceOp::AVG && !at::isFloatingType(op.dtype)) op.rop = ReduceOp::SUM;
  op.root = static_cast<int>(pick(static_cast<size_t>(N())));
  const int64_t chunk = static_cast<int64_t>(slot_bytes() / c10::elementSize(op.dtype));
  switch (pick(6)) {
    case 0:
      op.numel = 0;
      break;
    case 1:
      op.numel = 1;
      break;
    case 2:
      op.numel = 2 + static_cast<int64_t>(pick(63));
      break;
    case 3:
      op.numel = 64 + static_cast<int64_t>(pick(3000));
      break;
    default: {
      const int64_t around[] = {chunk - 1,       chunk,         chunk + 1,     2 * chunk + 1,
                                chunk / N() + 1, 5 * chunk - 3, 64 * chunk + 7};
      op.numel = around[pick(std::size(around))];
    }
  }
  op.async = pick(5) < 2;
  return op;
}

void expect_equal(const at::Tensor& got, const at::Tensor& want, const std::string& what) {
  if (at::equal(got.to(at::kDouble), want.to(at::kDouble))) return;
  at::Tensor bad = (got.to(at::kDouble) != want.to(at::kDouble)).nonzero();
  const int64_t i = bad.size(0) ? bad[0][0].item<int64_t>() : -1;
  ADD_FAILURE() << what << ": wrong result, first at element " << i << " of " << got.numel() << ": got "
                << (i >= 0 ? got[i].item<double>() : 0.0) << ", expected " << (i >= 0 ? want[i].item<double>() : 0.0);
}

struct Started {
  Work work;
  std::function<void()> check;  // compares the outputs with the reference, after the work is done
};

// Starts op on the default group (waiting at once unless op.async).
Started start(const Op& op, uint64_t s) {
  const std::string what = describe(op, s);
  // By value: the checks run after start() returned.
  auto in = [s, op](int r, int part) { return input_of(s, op.index, r, part, op.numel, op.dtype, op.rop); };
  auto red = [s, op](int part) { return reduced(s, op.index, N(), part, op.numel, op.dtype, op.rop); };
  const Group g;
  switch (op.kind) {
    case Kind::kAllReduce: {
      at::Tensor t = in(R(), 0);
      return {all_reduce(t, op.rop, g, op.async), [=] { expect_equal(t, red(0), what); }};
    }
    case Kind::kBroadcast: {
      at::Tensor t = in(R(), 0);
      return {broadcast(t, op.root, g, op.async), [=] { expect_equal(t, in(op.root, 0), what); }};
    }
    case Kind::kReduce: {
      at::Tensor t = in(R(), 0);
      return {reduce(t, op.root, op.rop, g, op.async), [=] {
                if (R() == op.root) expect_equal(t, red(0), what);
              }};
    }
    case Kind::kAllGather: {
      std::vector<at::Tensor> outs;
      for (int k = 0; k < N(); ++k) outs.push_back(at::full({op.numel}, 99, op.dtype));
      return {all_gather(outs, in(R(), 0), g, op.async), [=] {
                for (int k = 0; k < N(); ++k) expect_equal(outs[k], in(k, 0), what + ", part " + std::to_string(k));
              }};
    }
    case Kind::kReduceScatter: {
      std::vector<at::Tensor> ins;
      for (int j = 0; j < N(); ++j) ins.push_back(in(R(), j));
      at::Tensor out = at::full({op.numel}, 99, op.dtype);
      return {reduce_scatter(out, ins, op.rop, g, op.async), [=] { expect_equal(out, red(R()), what); }};
    }
    case Kind::kAllGatherIntoTensor: {
      // Concatenated for even operations, stacked for odd ones: both shapes are accepted.
      at::Tensor out =
          op.index % 2 ? at::full({N(), op.numel}, 99, op.dtype) : at::full({N() * op.numel}, 99, op.dtype);
      return {all_gather_into_tensor(out, in(R(), 0), g, op.async), [=] {
                for (int k = 0; k < N(); ++k)
                  expect_equal(out.view({N(), -1})[k], in(k, 0), what + ", part " + std::to_string(k));
              }};
    }
    case Kind::kReduceScatterTensor: {
      std::vector<at::Tensor> ins;
      for (int j = 0; j < N(); ++j) ins.push_back(in(R(), j));
      at::Tensor input = op.index % 2 ? at::stack(ins) : at::cat(ins);
      at::Tensor out = at::full({op.numel}, 99, op.dtype);
      return {reduce_scatter_tensor(out, input, op.rop, g, op.async), [=] { expect_equal(out, red(R()), what); }};
    }
    case Kind::kGather: {
      std::vector<at::Tensor> list;
      if (R() == op.root)
        for (int k = 0; k < N(); ++k) list.push_back(at::full({op.numel}, 99, op.dtype));
      return {gather(in(R(), 0), list, op.root, g, op.async), [=] {
                for (size_t k = 0; k < list.size(); ++k)
                  expect_equal(list[k], in(static_cast<int>(k), 0), what + ", part " + std::to_string(k));
              }};
    }
    case Kind::kScatter: {
      std::vector<at::Tensor> list;
      if (R() == op.root)
        for (int k = 0; k < N(); ++k) list.push_back(in(op.root, k));
      at::Tensor out = at::full({op.numel}, 99, op.dtype);
      return {scatter(out, list, op.root, g, op.async), [=] { expect_equal(out, in(op.root, R()), what); }};
    }
    case Kind::kAllToAllSingle: {
      auto piece = [s, op](int i, int j) {
        return input_of(s, op.index, i, j, exchange_rows(op.numel, i, j), op.dtype, op.rop);
      };
      std::vector<at::Tensor> mine, theirs;
      std::vector<int64_t> sends, gets;
      for (int k = 0; k < N(); ++k) {
        mine.push_back(piece(R(), k));
        sends.push_back(exchange_rows(op.numel, R(), k));
        theirs.push_back(piece(k, R()));
        gets.push_back(exchange_rows(op.numel, k, R()));
      }
      const at::Tensor expected = at::cat(theirs);
      at::Tensor out = at::full_like(expected, 99);
      return {all_to_all_single(out, at::cat(mine), gets, sends, g, op.async),
              [=] { expect_equal(out, expected, what); }};
    }
  }
  return {};
}

// After a failure: a barrier and a checked all_reduce must work on every rank, well within the
// group's timeout (DTRAIN_TIMEOUT_S=60 under ctest), so nothing waited for a timeout.
void expect_group_usable(const std::string& after) {
  const auto t0 = std::chrono::steady_clock::now();
  try {
    barrier();
    at::Tensor t = at::full({3}, static_cast<float>(R() + 1));
    all_reduce(t);
    EXPECT_FLOAT_EQ(t[2].item<float>(), N() * (N() + 1) / 2.0f) << after;
  } catch (const std::exception& e) {
    ADD_FAILURE() << after << ": the group is no longer usable: " << e.what();
  }
  EXPECT_LT(std::chrono::steady_clock::now() - t0, dtrain::test_util::scaled(std::chrono::seconds(10))) << after;
}

// Runs `count` operations of the sequence `s`; inject(op) may replace an operation with a failure
// (it returns true when it did).
void run_sequence(uint64_t s, int count, const std::function<bool(const Op&)>& inject = nullptr) {
  std::mt19937_64 g(s);
  const bool shm = Group().uses_shared_memory();
  std::vector<std::pair<Op, Started>> pending;
  auto drain = [&] {
    std::shuffle(pending.begin(), pending.end(), g);  // any order of waiting must do
    for (auto& [op, st] : pending) {
      try {
        st.work.wait();
        st.check();
      } catch (const std::exception& e) {
        ADD_FAILURE() << describe(op, s) << ": failed: " << e.what();
      }
    }
    pending.clear();
  };
  for (int i = 0; i < count; ++i) {
    const Op op = draw(g, i);
    const bool wait_now = !op.async || g() % 3 == 0 || pending.size() >= 4;
    if (inject && inject(op)) continue;
    if (!expect_supported(op.kind, op.dtype, shm)) {
      // Rejected at the call, async or not, on every rank: nothing is left in flight.
      const std::string e = dtrain_error_of([&] { start(op, s); });
      EXPECT_THAT(e, HasSubstr(std::string(name(op.kind)) + " on group 'default'")) << describe(op, s) << e;
      EXPECT_THAT(e, HasSubstr(" cannot run: Gloo in LibTorch ")) << describe(op, s) << ": " << e;
      EXPECT_THAT(e, HasSubstr(std::string("has no ") + c10::toString(op.dtype))) << e;
      EXPECT_THAT(e, HasSubstr("convert the tensor")) << e;
      continue;
    }
    try {
      pending.emplace_back(op, start(op, s));
    } catch (const std::exception& e) {
      ADD_FAILURE() << describe(op, s) << ": failed: " << e.what();
    }
    if (wait_now) drain();
  }
  drain();
}

struct DebugLevelScope {
  explicit DebugLevelScope(DebugLevel l) : saved(get_debug_level()) { set_debug_level(l); }
  ~DebugLevelScope() { set_debug_level(saved); }
  DebugLevel saved;
};

}  // namespace

TEST(CollectivesRandom, DefaultGroupRunsOverTheTransportThisRunTests) { expect_default_group_transport_from_env(); }

TEST(CollectivesRandom, EveryResultMatchesTheExactReference) { run_sequence(seed(), 300); }

// The same sequence, every fifth operation replaced by a failure: a dtype no backend of the group
// takes (int16 reductions: rejected before anything is sent), or, under DTRAIN_DEBUG=DETAIL, a shape
// that differs on one rank. Every rank must see the failure, and the group must work after it.
TEST(CollectivesRandom, InjectedFailuresLeaveTheGroupUsable) {
  const auto t0 = std::chrono::steady_clock::now();
  int injected = 0;
  run_sequence(seed(), 150, [&](const Op& op) {
    if (op.index % 5 != 2) return false;
    ++injected;
    const std::string where = describe(op, seed());
    const Group g;
    std::string e;
    if (op.index % 2 == 0) {
      at::Tensor t = at::ones({op.numel}, at::kShort);
      e = dtrain_error_of([&] { reduce(t, op.root, ReduceOp::SUM, g, op.async); });
      EXPECT_THAT(e, HasSubstr("reduce on group 'default'")) << where << ": " << e;
      EXPECT_THAT(e, HasSubstr("has no Short collectives")) << where << ": " << e;
    } else {
      DebugLevelScope detail(DebugLevel::DETAIL);
      at::Tensor t = at::ones({op.numel + (R() == op.root ? 1 : 0)}, at::kFloat);
      e = dtrain_error_of([&] { all_reduce(t, ReduceOp::SUM, g, op.async).wait(); });
      EXPECT_THAT(e, HasSubstr("differs across ranks")) << where << ": " << e;
    }
    expect_group_usable(where + ", after the injected failure " + e);
    return true;
  });
  EXPECT_EQ(injected, 30);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, dtrain::test_util::scaled(std::chrono::seconds(60)));
}

// The case that desynchronized the ranks: a bfloat16 reduce on Gloo alone, then a barrier. LibTorch
// 1.13's Gloo has no bfloat16, so every rank rejects it before anything is sent; 2.x runs it.
TEST(CollectivesRandom, Bfloat16ReduceOverGlooThenBarrier) {
  Group g;
  {
    dtrain::test_util::EnvOverride off("DTRAIN_SHM", "0");
    g = new_group({});
  }
  ASSERT_FALSE(g.uses_shared_memory());
  for (int i = 0; i < 20; ++i) {
    at::Tensor t = at::full({5}, static_cast<float>(R() + 1)).to(at::kBFloat16);
    const std::string e = dtrain_error_of([&] { reduce(t, 0, ReduceOp::SUM, g, /*async_op=*/i % 2 == 1).wait(); });
    if (TORCH_VERSION_MAJOR < 2) {
      EXPECT_THAT(e,
                  HasSubstr("rank " + std::to_string(R()) + ": reduce on group '" + g.name() + "' (gloo, ranks [0, 1"))
          << e;
      EXPECT_THAT(e, HasSubstr("cannot run: Gloo in LibTorch 1.13")) << e;
      EXPECT_THAT(e, HasSubstr("has no BFloat16 collectives: convert the tensor (e.g. to float32)")) << e;
      EXPECT_THAT(e, HasSubstr("or run the ranks of one host over shared memory")) << e;
    } else {
      EXPECT_EQ(e, "(no dtrain::Error thrown)");
      if (R() == 0) {
        EXPECT_EQ(t[4].item<float>(), N() * (N() + 1) / 2.0f);
      }
    }
    barrier(g);
    at::Tensor ok = at::ones({2});
    all_reduce(ok, ReduceOp::SUM, g);
    EXPECT_EQ(ok[1].item<float>(), static_cast<float>(N()));
  }
}

// Over shared memory, ranks that pass different sizes are found out only once their first chunks are
// in the segment: the group is then broken (Note [Broken groups]), and every later call, of any kind
// and on any rank, fails at once naming that first failure. Other groups are unaffected.
TEST(CollectivesRandom, AFailureAfterDataMovedBreaksTheGroupOnEveryRank) {
  Group g;
  {
    dtrain::test_util::EnvOverride on("DTRAIN_SHM", "1");
    g = new_group({});
  }
  ASSERT_TRUE(g.uses_shared_memory());
  at::Tensor t = at::ones({R() == 0 ? 4 : 5});
  const std::string first = dtrain_error_of([&] { all_reduce(t, ReduceOp::SUM, g); });
  EXPECT_THAT(first, HasSubstr("mismatched collectives over shared memory")) << first;
  const auto t0 = std::chrono::steady_clock::now();
  at::Tensor f = at::ones({3});
  at::Tensor i32 = at::ones({3}, at::kInt);  // reduced over Gloo: the group's other transport
  const std::vector<std::pair<std::string, std::function<void()>>> later = {
      {"barrier", [&] { barrier(g); }},
      {"all_reduce", [&] { all_reduce(f, ReduceOp::SUM, g); }},
      {"reduce", [&] { reduce(i32, 0, ReduceOp::SUM, g); }},
      {"broadcast", [&] { broadcast(f, N() - 1, g, /*async_op=*/true).wait(); }},
  };
  for (const auto& [op, call] : later) {
    const std::string e = dtrain_error_of(call);
    EXPECT_EQ(e.rfind("rank " + std::to_string(R()) + ": " + op + " on group '" + g.name() + "'", 0), 0u) << e;
    EXPECT_THAT(e, HasSubstr("failed: the group is unusable since an earlier collective failed (")) << e;
    EXPECT_THAT(e, HasSubstr("mismatched collectives over shared memory")) << e;
    EXPECT_THAT(e, HasSubstr("destroy the process group and create it again, or restart the job")) << e;
    EXPECT_THAT(e, Not(HasSubstr("timed out"))) << e;
  }
  EXPECT_LT(std::chrono::steady_clock::now() - t0, dtrain::test_util::scaled(std::chrono::seconds(2)));
  expect_group_usable("the default group, after a subgroup broke");
}

DTRAIN_DIST_TEST_MAIN()
