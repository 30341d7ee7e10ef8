// Reading the ranks' flight records and naming the culprit of a hang or a mismatch. Torch-free:
// dtrain-run runs it on its workers' dumps, and `dtrain-run --analyze DIR` on dumps from elsewhere.
//
// A dump (one per rank, `dtrain_trace_rank_<rank>`, written by src/comm/flight_recorder.cpp) is the
// dict PyTorch's flight recorder pickles (version "2.10"): "pg_config" (group name -> desc, ranks),
// "entries" (one per call: collective_seq_id, p2p_seq_id, profiling_name "gloo:all_reduce",
// input_sizes, input_dtypes, state scheduled/started/completed, time_created_ns, ...) plus dtrain's
// own keys: "rank", "dtrain" (dump_time_ns, reason, world_size) and per entry "dtrain_op" (the
// call's dtrain name), "dtrain_peer" (the global peer rank of send/recv), "dtrain_peer_seq" (the
// number of the message between the pair, which both ends agree on), "dtrain_root" and "dtrain_tag".
//
//   auto dumps = dtrain::flight::read_dumps("/tmp/run/attempt_0/flight", &problems);
//   for (const auto& line : dtrain::flight::analyze(dumps, /*world_size=*/4)) std::cerr << line << "\n";
//   // hang in group 'default' at all_reduce #58: ranks 0, 1, 3 entered it 30.2 s ago; rank 2 completed
//   // #57 and has not entered #58
//
// The analysis, per group, in this order (the first finding is the likeliest cause):
//   1. mismatch: the first sequence number where the ranks' calls differ in operation, sizes, dtypes
//      or root; a rank whose call is the one the others make next (their calls repeat each step)
//      skipped one;
//   2. point-to-point: a pending recv (or send) whose peer never made the matching call;
//   3. hang: the last sequence number any rank entered, who waits in it, and for each rank that
//      has not entered it, what it did last (nothing for a while: computing or stuck outside
//      dtrain; waiting in another group; no dump at all: stopped or dead).
#pragma once

#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace dtrain::flight {

// The file name of a rank's dump in its folder (the prefix PyTorch's analyzer strips to find the rank).
constexpr const char* kDumpPrefix = "dtrain_trace_rank_";

// Every `dtrain_trace_rank_<N>` in `dir`, decoded; a file that cannot be read or decoded is skipped
// with one line in `problems`. Throws std::runtime_error if `dir` is not a readable folder.
std::vector<nlohmann::json> read_dumps(const std::string& dir, std::vector<std::string>* problems);

// A few lines naming what went wrong; world_size (or -1: the largest group seen) names the ranks
// that left no dump. Never throws on odd content: a malformed entry is skipped.
std::vector<std::string> analyze(const std::vector<nlohmann::json>& dumps, int world_size = -1);

}  // namespace dtrain::flight
