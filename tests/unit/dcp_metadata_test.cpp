// A distributed checkpoint's `.metadata` read as a load reads a file written by anyone
// (checkpoint/dcp_metadata.h): every chunk fits its tensor and every stored item its file's
// offsets, checked before the planner computes with them, and the pickle beneath may not expand,
// through values it shares, past a budget proportional to its size (common/pickle.h,
// Note [Pickle budget]), so a hostile file is one clean error. The hostile files are
// fuzz_dcp_metadata's seeds.
#include <gtest/gtest.h>

#include <cstdint>
#include <limits>

#include "checkpoint/dcp_metadata.h"
#include "common/pickle.h"
#include "common/util.h"
#include "matchers.h"

namespace {

using dtrain::dcp::detail::Chunk;
using dtrain::dcp::detail::decode;
using dtrain::dcp::detail::encode;
using dtrain::dcp::detail::Item;
using dtrain::dcp::detail::Metadata;
using dtrain::dcp::detail::Shape;

constexpr int64_t kMax = std::numeric_limits<int64_t>::max();

// One tensor 'w' of `whole` in one chunk at `offsets` of `sizes`, stored at bytes [offset, offset +
// length) of __0_0.distcp.
Metadata one_chunk(Shape whole, Shape offsets, Shape sizes, int64_t offset = 0, int64_t length = 100) {
  Metadata m;
  auto& t = m.tensors["w"];
  t.dtype = "float32";
  t.size = std::move(whole);
  t.chunks.push_back({offsets, std::move(sizes)});
  m.paths["w"] = {{false, 0, "w"}};
  m.items.push_back(Item{"w", offsets, {"__0_0.distcp", offset, length}});
  return m;
}

TEST(DcpMetadata, ReadsBackAChunkThatFits) {
  const Metadata m = decode(encode(one_chunk({4, 6}, {2, 0}, {2, 6})));
  ASSERT_EQ(m.tensors.at("w").chunks.size(), 1u);
  EXPECT_EQ(m.tensors.at("w").chunks[0].offsets, (Shape{2, 0}));
  EXPECT_EQ(m.items.at(0).storage.length, 100);
}

// The planner indexed the chunk's offsets by the tensor's dimensions: torch.Size(()) for a 2-d
// tensor read past the end of an empty vector (a segfault in dcp::load).
TEST(DcpMetadata, RefusesAChunkOfAnotherRank) {
  EXPECT_THAT(
      [] {
        decode(encode(one_chunk({4, 6}, {}, {4, 6})));
      },
      ThrowsDtrainError(AllOf(HasSubstr("state_dict_metadata['w'].chunks[0]"),
                              HasSubstr("offsets [] and sizes [4, 6] for a tensor of size [4, 6]"),
                              HasSubstr("one offset and one size per dimension"))));
  EXPECT_THAT(
      [] {
        decode(encode(one_chunk({4, 6}, {0, 0}, {4})));
      },
      ThrowsDtrainError(HasSubstr("offsets [0, 0] and sizes [4] for a tensor of size [4, 6]")));
}

TEST(DcpMetadata, RefusesAChunkOutsideItsTensor) {
  const std::vector<std::pair<Chunk, std::string>> cases = {
      {{{-1, 0}, {2, 6}}, "offsets [-1, 0] and sizes [2, 6]"},
      {{{3, 0}, {2, 6}}, "offsets [3, 0] and sizes [2, 6]"},
      {{{0, 0}, {-1, 6}}, "offsets [0, 0] and sizes [-1, 6]"},
      // offset + size wraps around to a negative number: no overflow may let it pass.
      {{{kMax, 0}, {kMax, 6}}, "offsets [" + std::to_string(kMax) + ", 0] and sizes [" + std::to_string(kMax)},
      {{{2, kMax}, {2, 2}}, "offsets [2, " + std::to_string(kMax) + "] and sizes [2, 2]"},
  };
  for (const auto& [c, words] : cases)
    EXPECT_THAT(
        [&c = c] {  // a structured binding: captured by name
          decode(encode(one_chunk({4, 6}, c.offsets, c.sizes)));
        },
        ThrowsDtrainError(AllOf(HasSubstr(words), HasSubstr("0 <= offset and offset + size <= the dimension"))))
        << words;
  EXPECT_THAT(
      [] {
        decode(encode(one_chunk({4, -6}, {0, 0}, {4, 0})));
      },
      ThrowsDtrainError(HasSubstr("state_dict_metadata['w'].size is [4, -6], a negative size")));
}

// The same chunk listed twice would be read, and held, twice: a small file could make a load hold
// its largest tensor any number of times.
TEST(DcpMetadata, RefusesAChunkListedTwice) {
  Metadata m = one_chunk({4}, {0}, {4});
  m.tensors.at("w").chunks.push_back(m.tensors.at("w").chunks[0]);
  EXPECT_THAT([&] { decode(encode(m)); },
              ThrowsDtrainError(HasSubstr("state_dict_metadata['w'].chunks[1] repeats the chunk at offsets [0]")));
}

TEST(DcpMetadata, RefusesAStorageRangeThatOverflows) {
  EXPECT_THAT([] { decode(encode(one_chunk({4}, {0}, {4}, kMax - 1, 2))); },
              ThrowsDtrainError(AllOf(HasSubstr("the item 'w' is stored at bytes " + std::to_string(kMax - 1)),
                                      HasSubstr("past the largest offset a file can have"))));
  EXPECT_THAT([] { decode(encode(one_chunk({4}, {0}, {4}, -1, 2))); },
              ThrowsDtrainError(HasSubstr("the item 'w' has a negative offset or length")));
}

// Two items in the same bytes of a file: a writer never does that, and a load would read those bytes
// once per item.
TEST(DcpMetadata, RefusesItemsThatOverlapInTheirFile) {
  Metadata m = one_chunk({4}, {0}, {2}, 0, 100);
  m.tensors.at("w").chunks.push_back({{2}, {2}});
  m.items.push_back(Item{"w", Shape{2}, {"__0_0.distcp", 99, 100}});
  EXPECT_THAT([&] { decode(encode(m)); }, ThrowsDtrainError(AllOf(HasSubstr("__0_0.distcp"), HasSubstr("bytes 0-100"),
                                                                  HasSubstr("bytes 99-199"), HasSubstr("overlap"))));
  m.items.back().storage.offset = 100;  // back to back: fine
  EXPECT_EQ(decode(encode(m)).items.size(), 2u);
  m.items.back().storage.relative_path = "__1_0.distcp";  // another file: fine
  m.items.back().storage.offset = 0;
  EXPECT_EQ(decode(encode(m)).items.size(), 2u);
}

std::string seed(const std::string& name) {
  return dtrain::util::read_file(std::string(DTRAIN_SOURCE_DIR) + "/tests/fuzz/corpus/dcp_metadata/" + name, "seed");
}

// Each level a pair of the level below and a reference to it (memo), 40 times over: 206 bytes that
// stand for 2^40 values (Python's pickler writes `a = (a, a)` in a loop so).
std::string doubling(int levels) {
  std::string p("\x80\x02]q\x00", 5);
  for (int k = 1; k <= levels; ++k)
    p += std::string{'h', static_cast<char>(k - 1), static_cast<char>(0x86), 'q', static_cast<char>(k)};
  return p + ".";
}

TEST(PickleBudget, RefusesAPickleWhoseSharedValuesExpandPastItsSize) {
  EXPECT_THAT(
      [] { dtrain::pickle::parse(doubling(40)); },
      ThrowsDtrainError(AllOf(HasSubstr("pickle of 206 bytes shares values past its budget"),
                              HasSubstr("more than " + std::to_string(dtrain::pickle::budget_for(206)) + " values"))));
  EXPECT_NO_THROW(dtrain::pickle::parse(doubling(10)));  // 2^11 values: within the slack
}

// The budget is far above what PyTorch's own files use: a factor of 4 to spare, at the least.
TEST(PickleBudget, RealMetadataUsesAFractionOfIt) {
  const std::string bytes = seed("python_2ranks_adam");
  const auto doc = dtrain::pickle::parse(bytes);
  const auto e = dtrain::pickle::expansion(doc.root(), UINT64_MAX / 2, UINT64_MAX / 2);
  EXPECT_LT(e.values * 4, dtrain::pickle::kBudgetPerByte * bytes.size()) << e.values;
  EXPECT_LT(e.text_bytes * 4, dtrain::pickle::kBudgetPerByte * bytes.size()) << e.text_bytes;
  EXPECT_EQ(decode(bytes).tensors.size(), 16u);
}

// Copied wherever they were shared, these took 71, 253 and 1,606 MiB (3, 5.4 and 9.8 KB: n keys
// sharing one tensor of n chunks sharing one torch.Size of n dimensions) and 500 MB of text (10 KB:
// 500 paths of one tuple of 500 references to one str of 2,000 bytes).
TEST(DcpMetadata, RefusesAFileWhoseSharedValuesExpandPastItsBudget) {
  for (const char* name : {"budget_shared_tensor_130", "budget_shared_tensor_250", "budget_shared_tensor_450",
                           "budget_shared_paths", "budget_doubling"})
    EXPECT_THAT([&] { decode(seed(name)); }, ThrowsDtrainError(HasSubstr("shares values past its budget"))) << name;
}

}  // namespace
