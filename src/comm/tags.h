// The point-to-point tags of dtrain's own messages, in one table, so that no two of its uses meet and
// users' tags stay clear of them. dtrain::send/recv document tags from kFirstReservedTag up as
// dtrain's (docs/api.md); a user's tag there would be matched against these messages.
#pragma once

namespace dtrain::comm {

inline constexpr int kFirstReservedTag = 0x6F000000;

// DDP's hooks: a small sum as an exchange of messages (Note [Small sums as exchanges] in
// src/ddp/comm_hooks.cpp). One tag: every rank issues its sends and receives in the same order.
inline constexpr int kSmallSumTag = 0x6F000000;

// dtrain::functional::all_to_all: one message each way between each pair per call, so order alone
// matches them (src/tp/functional.cpp).
inline constexpr int kAllToAllTag = 0x6F000001;

// Ring attention (context parallelism): K/V blocks passed to the next rank of the ring, and in
// backward their gradients, each on its own tag so that the two streams between a pair, both in
// flight at once, never match each other's messages (src/cp/ring_attention.cpp).
inline constexpr int kRingKvTag = 0x6F000002;
inline constexpr int kRingGradTag = 0x6F000003;

// Pipelines: two tags per pipeline on a group, kPipelineTagBase + 2 * (the group's object index),
// up to INT_MAX (src/pipeline/pipeline.cpp).
inline constexpr int kPipelineTagBase = 0x70000000;

static_assert(kFirstReservedTag <= kSmallSumTag && kSmallSumTag < kAllToAllTag && kAllToAllTag < kRingKvTag &&
                  kRingKvTag < kRingGradTag && kRingGradTag < kPipelineTagBase,
              "tags overlap");

}  // namespace dtrain::comm
