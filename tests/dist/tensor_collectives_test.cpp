// all_gather_into_tensor and reduce_scatter_tensor on 2 to 4 real processes against references
// computed here: every dtype class, empty to larger than a shared-memory slot, every reduce op,
// both accepted shapes, the in-place forms; all_to_all_single and all_to_all with uneven splits
// (zeros, a rank that sends nothing), and the functional all_to_all_single's gradient; over shared
// memory (the default group) and over Gloo alone (a DTRAIN_SHM=0 group here, and the whole program
// in dist_tensor_collectives_test_gloo_*).
#include <algorithm>
#include <atomic>
#include <chrono>
#include <thread>

#include <ATen/ATen.h>
#include <c10/core/CPUAllocator.h>
#include <torch/csrc/api/include/torch/version.h>

#include "dist_main.h"
#include "dtrain/errors.h"
#include "dtrain/functional_collectives.h"
#include "test_util.h"
#include "matchers.h"

using namespace dtrain;

namespace {
int R() { return rank(); }
int64_t N() { return world_size(); }
using dtrain::test_util::dtrain_error_of;

Group gloo_group() {
  dtrain::test_util::EnvOverride off("DTRAIN_SHM", "0");
  return new_group({});
}

// Rank r's values: multiples of 1/4 in [-1, 1] (integers in [-4, 4] for int64), so that sums,
// products, minima and maxima of up to 4 ranks are exact in every dtype and every order: Gloo's
// reduction order then cannot change the expected bits.
at::Tensor values(int r, int64_t numel, at::ScalarType dt) {
  at::Tensor p = (at::arange(numel, at::kLong) * 7 + r * 3).remainder(9) - 4;
  return at::isFloatingType(dt) ? (p.to(at::kDouble) / 4).to(dt) : p.to(dt);
}

at::Tensor combine(const at::Tensor& a, const at::Tensor& b, ReduceOp op) {
  switch (op) {
    case ReduceOp::SUM:
    case ReduceOp::AVG:
      return a + b;
    case ReduceOp::PRODUCT:
      return a * b;
    case ReduceOp::MIN:
      return at::minimum(a, b);
    case ReduceOp::MAX:
      return at::maximum(a, b);
  }
  return a;
}

// Gloo in LibTorch 1.13 has no bfloat16: every rank rejects the call before anything is sent.
bool rejected_here(const Group& g, at::ScalarType dt) {
  return TORCH_VERSION_MAJOR < 2 && !g.uses_shared_memory() && dt == at::kBFloat16;
}

const at::ScalarType kDtypes[] = {at::kFloat, at::kDouble, at::kBFloat16, at::kHalf, at::kLong};
// Empty, one element, sizes that split unevenly across ranks and chunks, more than one 1 MiB slot.
const int64_t kCounts[] = {0, 1, 7, 1027, 300001};

void check_all_gather(const Group& g, at::ScalarType dt, int64_t count, bool stacked, bool async_op) {
  at::Tensor in = values(R(), count, dt);
  at::Tensor out = stacked ? at::full({N(), count}, -9, at::TensorOptions(dt)) : at::full({N() * count}, -9, dt);
  const std::string e = dtrain_error_of([&] { all_gather_into_tensor(out, in, g, async_op).wait(); });
  if (rejected_here(g, dt)) {
    EXPECT_THAT(e, HasSubstr("has no BFloat16 collectives")) << e;
    return;
  }
  ASSERT_EQ(e, "(no dtrain::Error thrown)") << dt << " x " << count;
  std::vector<at::Tensor> parts;
  for (int k = 0; k < N(); ++k) parts.push_back(values(k, count, dt));
  at::Tensor expected = stacked ? at::stack(parts) : at::cat(parts);
  EXPECT_TRUE(at::equal(out, expected)) << dt << " x " << count << (stacked ? " stacked" : "");
}

void check_reduce_scatter(const Group& g, at::ScalarType dt, int64_t count, ReduceOp op, bool stacked, bool async_op) {
  at::Tensor in = values(R(), N() * count, dt);
  if (stacked) in = in.view({N(), count});
  at::Tensor out = at::full({count}, -9, dt);
  const std::string e = dtrain_error_of([&] { reduce_scatter_tensor(out, in, op, g, async_op).wait(); });
  if (rejected_here(g, dt)) {
    EXPECT_THAT(e, HasSubstr("has no BFloat16 collectives")) << e;
    return;
  }
  ASSERT_EQ(e, "(no dtrain::Error thrown)") << dt << " x " << count << " " << to_string(op);
  auto part = [&](int k) { return values(k, N() * count, dt).narrow(0, R() * count, count); };
  at::Tensor expected = part(0);
  for (int k = 1; k < N(); ++k) expected = combine(expected, part(k), op);
  if (op == ReduceOp::AVG) expected = expected.div(N());
  EXPECT_TRUE(at::equal(out, expected)) << dt << " x " << count << " " << to_string(op) << " rank " << R();
  EXPECT_TRUE(at::equal(in.view({-1}), values(R(), N() * count, dt))) << "the input changed";
}

}  // namespace

TEST(TensorCollectives, DefaultGroupRunsOverTheTransportThisRunTests) { expect_default_group_transport_from_env(); }

TEST(TensorCollectives, AllGatherIntoTensorConcatenatesOrStacksInRankOrder) {
  for (const Group& g : {Group(), gloo_group()})
    for (at::ScalarType dt : kDtypes)
      for (int64_t count : kCounts) {
        check_all_gather(g, dt, count, /*stacked=*/false, /*async_op=*/false);
        if (count == 7) check_all_gather(g, dt, count, /*stacked=*/true, /*async_op=*/true);
      }
}

TEST(TensorCollectives, ReduceScatterTensorGivesEachRankItsReducedPart) {
  for (const Group& g : {Group(), gloo_group()})
    for (at::ScalarType dt : kDtypes)
      for (int64_t count : kCounts)
        for (ReduceOp op : {ReduceOp::SUM, ReduceOp::AVG, ReduceOp::PRODUCT, ReduceOp::MIN, ReduceOp::MAX}) {
          if (op == ReduceOp::AVG && !at::isFloatingType(dt)) continue;
          if (op != ReduceOp::SUM && count > 1027) continue;  // the chunking is the same for every op
          check_reduce_scatter(g, dt, count, op, /*stacked=*/count == 7, /*async_op=*/count == 1);
        }
}

// The in-place forms: the input is this rank's slice of all_gather's output, and
// reduce_scatter's output is this rank's slice of its input.
TEST(TensorCollectives, InPlaceForms) {
  for (const Group& g : {Group(), gloo_group()}) {
    at::Tensor out = at::zeros({N() * 1000});
    at::Tensor mine = out.narrow(0, R() * 1000, 1000);
    mine.copy_(values(R(), 1000, at::kFloat));
    all_gather_into_tensor(out, mine, g);
    for (int k = 0; k < N(); ++k) EXPECT_TRUE(at::equal(out.narrow(0, k * 1000, 1000), values(k, 1000, at::kFloat)));

    at::Tensor in = values(R(), N() * 1000, at::kFloat);
    at::Tensor slice = in.narrow(0, R() * 1000, 1000);
    reduce_scatter_tensor(slice, in, ReduceOp::SUM, g);
    at::Tensor expected = at::zeros({1000});
    for (int k = 0; k < N(); ++k) expected += values(k, N() * 1000, at::kFloat).narrow(0, R() * 1000, 1000);
    EXPECT_TRUE(at::equal(slice, expected)) << "group " << g.name();
  }
}

// A gather whose output reaches 8 MiB is written with streaming stores: here into an output that
// starts 4 bytes past a 16-byte boundary and whose parts end off one too, out of place and in place.
TEST(TensorCollectives, LargeAllGatherWritesEveryByteOfAnUnalignedOutput) {
  const int64_t count = (int64_t{1} << 20) + 3;  // 4 MiB + 12 bytes of float32 per rank
  at::Tensor storage = at::full({N() * count + 1}, -9.0f);
  at::Tensor out = storage.narrow(0, 1, N() * count);
  std::vector<at::Tensor> parts;
  for (int k = 0; k < N(); ++k) parts.push_back(values(k, count, at::kFloat));
  const at::Tensor expected = at::cat(parts);
  all_gather_into_tensor(out, parts[R()]);
  EXPECT_TRUE(at::equal(out, expected)) << "out of place";
  EXPECT_EQ(storage[0].item<float>(), -9.0f) << "wrote before the output";
  out.fill_(-9.0f);
  at::Tensor mine = out.narrow(0, R() * count, count);
  mine.copy_(parts[R()]);
  all_gather_into_tensor(out, mine);
  EXPECT_TRUE(at::equal(out, expected)) << "in place";
}

// The CPU allocator of the moment, remembering the largest block asked of it (on any thread).
class TcLargestBlockAllocator final : public c10::Allocator {
 public:
  explicit TcLargestBlockAllocator(c10::Allocator* inner) : inner_(inner) {}
#if TORCH_VERSION_MAJOR >= 2
  c10::DataPtr allocate(size_t n) override {
    note(n);
    return inner_->allocate(n);
  }
  void copy_data(void* dest, const void* src, size_t count) const override { default_copy_data(dest, src, count); }
#else
  c10::DataPtr allocate(size_t n) const override {
    const_cast<TcLargestBlockAllocator*>(this)->note(n);
    return inner_->allocate(n);
  }
#endif
  c10::DeleterFnPtr raw_deleter() const override { return inner_->raw_deleter(); }
  size_t largest() const { return largest_.load(); }

 private:
  void note(size_t n) {
    size_t seen = largest_.load();
    while (n > seen && !largest_.compare_exchange_weak(seen, n)) {
    }
  }
  c10::Allocator* inner_;
  std::atomic<size_t> largest_{0};
};

// Note [Tensor collectives on Gloo]: the gather writes into the caller's output, with no whole
// output of its own beside it (c10d's Gloo all_gather stages one on its thread and copies it out:
// a unit's whole parameters more at fully_shard's peak RSS).
TEST(TensorCollectives, AllGatherIntoTensorStagesNoWholeOutput) {
  const int64_t count = int64_t{1} << 18;  // 1 MiB of float32 per rank
  for (const Group& g : {Group(), gloo_group()}) {
    at::Tensor out = at::empty({N() * count});
    const at::Tensor mine = values(R(), count, at::kFloat);
    c10::Allocator* inner = c10::GetCPUAllocator();
    TcLargestBlockAllocator counting(inner);
    {
      struct Restore {
        c10::Allocator* previous;
        ~Restore() { c10::SetCPUAllocator(previous); }
      } restore{inner};
      c10::SetCPUAllocator(&counting);
      ASSERT_EQ(c10::GetCPUAllocator(), &counting) << "the counting allocator was not installed";
      all_gather_into_tensor(out, mine, g);
    }
    EXPECT_LT(counting.largest(), static_cast<size_t>(out.nbytes()))
        << "group " << g.name() << (g.uses_shared_memory() ? " (shared memory)" : " (Gloo)");
    for (int k = 0; k < N(); ++k) EXPECT_TRUE(at::equal(out.narrow(0, k * count, count), values(k, count, at::kFloat)));
  }
}

// Over shared memory each rank reduces its own part in rank order: arbitrary floats give the very
// bits of all_reduce (which sums in rank order too), on every rank.
// (A group of its own, over shared memory even in the DTRAIN_SHM=0 runs: Gloo's order is its own.)
TEST(TensorCollectives, ReduceScatterOverSharedMemoryHasAllReducesBits) {
  Group g;
  {
    dtrain::test_util::EnvOverride on("DTRAIN_SHM", "1");
    g = new_group({});
  }
  ASSERT_TRUE(g.uses_shared_memory());
  for (at::ScalarType dt : {at::kFloat, at::kBFloat16, at::kHalf, at::kDouble}) {
    at::manual_seed(1000 + R());
    at::Tensor in = at::randn({N() * 300001}).to(dt);
    at::Tensor whole = in.clone();
    at::Tensor out = at::empty({300001}, dt);
    reduce_scatter_tensor(out, in, ReduceOp::SUM, g);
    all_reduce(whole, ReduceOp::SUM, g);
    EXPECT_TRUE(at::equal(out, whole.narrow(0, R() * 300001, 300001))) << dt;
  }
}

TEST(TensorCollectives, IsCompletedMeansTheOutputIsFinal) {
  for (const Group& g : {Group(), gloo_group()}) {
    at::Tensor in = at::full({N() * 4}, static_cast<float>(R() + 1));
    at::Tensor out = at::zeros({4});
    Work w = reduce_scatter_tensor(out, in, ReduceOp::AVG, g, /*async_op=*/true);
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    while (!w.is_completed()) {
      ASSERT_LT(std::chrono::steady_clock::now(), deadline) << "is_completed() never became true";
      std::this_thread::yield();
    }
    EXPECT_FLOAT_EQ(out[3].item<float>(), (N() + 1) / 2.0f);
    w.wait();
  }
}

// Bad arguments fail on every rank before anything is sent, naming the value and the remedy; the
// group stays usable.
TEST(TensorCollectives, BadInputIsAClearError) {
  const std::string n = std::to_string(N());
  at::Tensor out = at::empty({4});
  EXPECT_EQ(dtrain_error_of([&] { reduce_scatter_tensor(out, at::ones({N() * 4 + 2})); }),
            "reduce_scatter_tensor: input has " + std::to_string(N() * 4 + 2) + " elements, expected world_size (" + n +
                ") x output (4) = " + std::to_string(N() * 4));
  at::Tensor big = at::empty({N() * 3});
  EXPECT_EQ(dtrain_error_of([&] { all_gather_into_tensor(big, at::ones({4})); }),
            "all_gather_into_tensor: output has " + std::to_string(N() * 3) + " elements, expected world_size (" + n +
                ") x input (4) = " + std::to_string(N() * 4));
  at::Tensor wrong_shape = at::empty({2, N() * 2});
  const std::string shape = dtrain_error_of([&] { all_gather_into_tensor(wrong_shape, at::ones({2, 2})); });
  EXPECT_THAT(shape, HasSubstr("output has shape [2, " + std::to_string(N() * 2) + "], expected [" + n +
                               ", 2, 2] or [" + std::to_string(N() * 2) + ", 2]"))
      << shape;
  at::Tensor doubles = at::empty({N() * 4}, at::kDouble);
  EXPECT_THAT(dtrain_error_of([&] { all_gather_into_tensor(doubles, at::ones({4})); }),
              HasSubstr("output is Double on cpu but input is Float on cpu: pass tensors of one dtype on one device"));
  at::Tensor ints = at::empty({4}, at::kLong);
  EXPECT_THAT(dtrain_error_of([&] { reduce_scatter_tensor(ints, at::ones({N() * 4}, at::kLong), ReduceOp::AVG); }),
              HasSubstr("ReduceOp::AVG needs a floating-point tensor"));
  at::Tensor strided = at::empty({N() * 8}).view({N() * 4, 2}).select(1, 0);
  EXPECT_THAT(dtrain_error_of([&] { all_gather_into_tensor(strided, at::ones({4})); }), HasSubstr("is not contiguous"));
  at::Tensor ok = at::ones({N()});
  at::Tensor one = at::empty({1});
  reduce_scatter_tensor(one, ok);
  EXPECT_FLOAT_EQ(one[0].item<float>(), static_cast<float>(N()));
}

namespace {

// Rows rank i sends rank j under split pattern `pattern` (every rank computes every rank's): with
// zeros, and in pattern 1 a rank 0 that sends nothing at all.
int64_t a2a_rows(int pattern, int i, int j) {
  if (pattern == 0) return (i + 2 * j + 1) % 4;
  return i == 0 ? 0 : (i + j) % 3;
}

// The part rank i sends rank j: rows of two float64 values naming i, j and the element.
at::Tensor a2a_part(int i, int j, int64_t rows, double offset = 0) {
  at::Tensor t = at::arange(rows * 2, at::kDouble).view({rows, 2}) * 0.5 + 0.25;
  return t + (1000.0 * i + 100.0 * j + offset);
}

std::vector<int64_t> a2a_sends(int pattern, int me) {
  std::vector<int64_t> v;
  for (int j = 0; j < N(); ++j) v.push_back(a2a_rows(pattern, me, j));
  return v;
}

std::vector<int64_t> a2a_gets(int pattern, int me) {
  std::vector<int64_t> v;
  for (int i = 0; i < N(); ++i) v.push_back(a2a_rows(pattern, i, me));
  return v;
}

// This rank's input (its parts for ranks 0..n-1) and the output it must receive (rank i's part for it).
at::Tensor a2a_input(int pattern, double offset = 0) {
  std::vector<at::Tensor> parts;
  for (int j = 0; j < N(); ++j) parts.push_back(a2a_part(R(), j, a2a_rows(pattern, R(), j), offset));
  return at::cat(parts);
}

at::Tensor a2a_expected(int pattern, double offset = 0) {
  std::vector<at::Tensor> parts;
  for (int i = 0; i < N(); ++i) parts.push_back(a2a_part(i, R(), a2a_rows(pattern, i, R()), offset));
  return at::cat(parts);
}

}  // namespace

TEST(AllToAll, SingleExchangesUnevenSplitsInRankOrder) {
  for (const Group& g : {Group(), gloo_group()})
    for (int pattern : {0, 1})
      for (bool async_op : {false, true}) {
        const at::Tensor in = a2a_input(pattern);
        const at::Tensor before = in.clone();
        at::Tensor out = at::full({a2a_expected(pattern).size(0), 2}, -9.0, at::kDouble);
        all_to_all_single(out, in, a2a_gets(pattern, R()), a2a_sends(pattern, R()), g, async_op).wait();
        EXPECT_TRUE(at::equal(out, a2a_expected(pattern)))
            << "group " << g.name() << ", pattern " << pattern << ", rank " << R() << ": got " << out;
        EXPECT_TRUE(at::equal(in, before)) << "the input changed";
      }
}

// No split sizes: equal parts, as torch.distributed.
TEST(AllToAll, SingleWithoutSplitSizesSendsEqualParts) {
  for (const Group& g : {Group(), gloo_group()}) {
    at::Tensor in = at::arange(N() * 3, at::kDouble) + 100.0 * R();
    at::Tensor out = at::zeros({N() * 3}, at::kDouble);
    all_to_all_single(out, in, {}, {}, g);
    std::vector<at::Tensor> parts;
    for (int i = 0; i < N(); ++i) parts.push_back(at::arange(R() * 3, R() * 3 + 3, at::kDouble) + 100.0 * i);
    EXPECT_TRUE(at::equal(out, at::cat(parts))) << "group " << g.name() << ": got " << out;
  }
}

// The list form: input_tensor_list[j] of rank i, of shape [rows(i, j), 2], lands in rank j's
// output_tensor_list[i]; empty tensors included.
TEST(AllToAll, ListFormDeliversEachTensorToItsRank) {
  for (const Group& g : {Group(), gloo_group()})
    for (bool async_op : {false, true}) {
      std::vector<at::Tensor> ins, outs;
      for (int j = 0; j < N(); ++j) ins.push_back(a2a_part(R(), j, a2a_rows(0, R(), j)));
      for (int i = 0; i < N(); ++i) outs.push_back(at::full({a2a_rows(0, i, R()), 2}, -9.0, at::kDouble));
      all_to_all(outs, ins, g, async_op).wait();
      for (int i = 0; i < N(); ++i)
        EXPECT_TRUE(at::equal(outs[i], a2a_part(i, R(), a2a_rows(0, i, R()))))
            << "group " << g.name() << ", from rank " << i << ": got " << outs[i];
    }
}

// The gradient of sum(y * w) with y = all_to_all_single(x): each rank's w sent back the way its
// rows came, i.e. the block of rank j's w that came from this rank, for every j in order.
TEST(AllToAll, FunctionalGradientIsTheReverseExchange) {
  for (const Group& g : {Group(), gloo_group()})
    for (int pattern : {0, 1}) {
      at::Tensor x = a2a_input(pattern).requires_grad_(true);
      at::Tensor y = functional::all_to_all_single(x, a2a_gets(pattern, R()), a2a_sends(pattern, R()), g);
      EXPECT_TRUE(at::equal(y.detach(), a2a_expected(pattern))) << "forward, pattern " << pattern;
      // Rank j's weight w_j has y_j's layout; its block from rank i is a2a_part(i, j, ., 0.125).
      (y * a2a_expected(pattern, 0.125)).sum().backward();
      ASSERT_TRUE(x.grad().defined());
      EXPECT_TRUE(at::equal(x.grad(), a2a_input(pattern, 0.125)))
          << "group " << g.name() << ", pattern " << pattern << ": grad " << x.grad();
    }
}

// Bad arguments are refused in one line naming the values, before anything is sent; a split
// matrix that does not match across ranks is refused on every rank by the guard, and the group
// stays usable.
TEST(AllToAll, BadInputIsAClearError) {
  const std::string n = std::to_string(N());
  at::Tensor in = at::zeros({N() * 2, 2}, at::kDouble);
  at::Tensor out = at::zeros({N() * 2, 2}, at::kDouble);
  std::vector<int64_t> twos(N(), 2), short_sum(N(), 2), negative(N(), 2);
  short_sum[0] = 1;
  negative[0] = -1;
  negative[1] = 5;
  std::string sizes = "[", short_sizes = "[", negative_sizes = "[";
  for (int j = 0; j < N(); ++j) {
    sizes += (j ? ", " : "") + std::to_string(twos[j]);
    short_sizes += (j ? ", " : "") + std::to_string(short_sum[j]);
    negative_sizes += (j ? ", " : "") + std::to_string(negative[j]);
  }
  sizes += "]";
  short_sizes += "]";
  negative_sizes += "]";
  EXPECT_EQ(dtrain_error_of([&] { all_to_all_single(out, in, twos, short_sum); }),
            "all_to_all_single: input_split_sizes " + short_sizes + " sums to " + std::to_string(N() * 2 - 1) +
                " but input has " + std::to_string(N() * 2) + " rows along dim 0: make the sizes add up to it");
  EXPECT_EQ(dtrain_error_of([&] { all_to_all_single(out, in, negative, twos); }),
            "all_to_all_single: output_split_sizes " + negative_sizes +
                " holds the negative size -1: pass row counts of 0 or more");
  EXPECT_EQ(dtrain_error_of([&] { all_to_all_single(out, in, {2}, twos); }),
            "all_to_all_single: output_split_sizes [2] has 1 sizes but the group has " + n +
                " ranks: pass one size per rank");
  at::Tensor odd = at::zeros({N() * 2 + 1, 2}, at::kDouble);
  EXPECT_EQ(dtrain_error_of([&] { all_to_all_single(out, odd); }),
            "all_to_all_single: input has " + std::to_string(N() * 2 + 1) +
                " rows along dim 0, which do not divide by the " + n +
                " ranks: pass input_split_sizes (one size per rank, summing to " + std::to_string(N() * 2 + 1) + ")");
  at::Tensor floats = at::zeros({N() * 2, 2}, at::kFloat);
  EXPECT_EQ(dtrain_error_of([&] { all_to_all_single(floats, in, twos, twos); }),
            "all_to_all_single: output is Float on cpu but input is Double on cpu: pass tensors of one dtype on one "
            "device");
  at::Tensor wide = at::zeros({N() * 2, 3}, at::kDouble);
  EXPECT_EQ(dtrain_error_of([&] { all_to_all_single(wide, in, twos, twos); }),
            "all_to_all_single: output has shape [" + std::to_string(N() * 2) + ", 3] but input [" +
                std::to_string(N() * 2) + ", 2]: they may differ in dim 0 only");
  std::vector<at::Tensor> ins(N(), at::zeros({2}, at::kDouble)), outs(N(), at::zeros({2}, at::kDouble));
  outs[1] = at::zeros({2}, at::kFloat);
  EXPECT_EQ(dtrain_error_of([&] { all_to_all(outs, ins); }),
            "all_to_all: output_tensor_list[1] is Float on cpu but input_tensor_list[0] is Double on cpu: pass "
            "tensors of one dtype on one device");
  std::vector<at::Tensor> one{at::zeros({2}, at::kDouble)};
  EXPECT_EQ(dtrain_error_of([&] { all_to_all(one, ins); }),
            "all_to_all: output_tensor_list has 1 tensors but the group has " + n + " ranks: pass one tensor per rank");
  EXPECT_EQ(dtrain_error_of([&] { functional::all_to_all_single(in, twos); }),
            "functional::all_to_all_single: output_split_sizes " + sizes +
                " with input_split_sizes []: pass both, or neither for equal parts");

  // Each rank's own arguments are fine, but rank 0 sends one row more to rank 1 than rank 1
  // expects (and one fewer to itself): refused on every rank before anything is sent.
  for (const Group& g : {Group(), gloo_group()}) {
    std::vector<int64_t> sends = a2a_sends(0, R());
    if (R() == 0) {
      sends[0] -= 1;  // a2a_rows(0, 0, 0) is 1
      sends[1] += 1;
    }
    at::Tensor x = a2a_input(0);
    at::Tensor y = at::zeros({a2a_expected(0).size(0), 2}, at::kDouble);
    const std::string e = dtrain_error_of([&] { all_to_all_single(y, x, a2a_gets(0, R()), sends, g); });
    EXPECT_THAT(e, HasSubstr("rank " + std::to_string(R()) + ": all_to_all_single on group '" + g.name() + "'")) << e;
    EXPECT_THAT(e, HasSubstr("mismatched all_to_all: rank 0 sends 0 rows to rank 0, which expects 1 "
                             "(input_split_sizes [0, 4"))
        << e;
    EXPECT_THAT(e, HasSubstr("rank i's input_split_sizes[j] must equal rank j's output_split_sizes[i]")) << e;
    at::Tensor ok = a2a_input(1);
    at::Tensor got = at::zeros({a2a_expected(1).size(0), 2}, at::kDouble);
    all_to_all_single(got, ok, a2a_gets(1, R()), a2a_sends(1, R()), g);
    EXPECT_TRUE(at::equal(got, a2a_expected(1))) << "the group after the refusal, " << g.name();
  }
}

// all_to_all_single's call check carries its splits in the same exchange as every other call's
// description (Note [Guarded Gloo collectives]): against an all_reduce that goes to Gloo (int64) on
// the other ranks, every rank refuses naming both calls, nothing moves, and the group stays usable.
TEST(AllToAll, SingleAgainstAnotherCollectiveFailsEveryRankNamingBoth) {
  for (const Group& g : {Group(), gloo_group()}) {
    at::Tensor x = a2a_input(0);
    at::Tensor y = at::zeros({a2a_expected(0).size(0), 2}, at::kDouble);
    at::Tensor counts = at::ones({4}, at::kLong);
    const std::string e = dtrain_error_of([&] {
      if (R() == 0)
        all_to_all_single(y, x, a2a_gets(0, R()), a2a_sends(0, R()), g);
      else
        all_reduce(counts, ReduceOp::SUM, g);
    });
    const std::string single = "all_to_all_single of Double", sum = "all_reduce of 4 Long elements (SUM)";
    const std::string expected = R() == 0
                                     ? "rank 0 calls " + single + " but rank 1 calls " + sum
                                     : "rank " + std::to_string(R()) + " calls " + sum + " but rank 0 calls " + single;
    EXPECT_THAT(e, HasSubstr("mismatched collectives over Gloo: " + expected)) << g.name() << ": " << e;
    EXPECT_TRUE(at::equal(y, at::zeros_like(y))) << "moved before the refusal, " << g.name();
    EXPECT_TRUE(at::equal(counts, at::ones_like(counts))) << "moved before the refusal, " << g.name();
    at::Tensor got = at::zeros({a2a_expected(1).size(0), 2}, at::kDouble);
    all_to_all_single(got, a2a_input(1), a2a_gets(1, R()), a2a_sends(1, R()), g);
    EXPECT_TRUE(at::equal(got, a2a_expected(1))) << "the group after the refusal, " << g.name();
  }
}

DTRAIN_DIST_TEST_MAIN()
