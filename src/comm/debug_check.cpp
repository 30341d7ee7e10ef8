#include "comm/debug_check.h"

#include <atomic>
#include <sstream>

#include <torch/csrc/distributed/c10d/Store.hpp>

#include "comm/state.h"
#include "common/env.h"
#include "store/store.h"

namespace dtrain {
namespace {

// -1: not read yet; else a DebugLevel.
std::atomic<int> g_level{-1};

DebugLevel parse_env() {
  const std::string s = env::choice("DTRAIN_DEBUG");
  if (s == "INFO") return DebugLevel::INFO;
  if (s == "DETAIL") return DebugLevel::DETAIL;
  return DebugLevel::OFF;
}

}  // namespace

DebugLevel get_debug_level() {
  int l = g_level.load(std::memory_order_relaxed);
  if (l >= 0) return static_cast<DebugLevel>(l);
  DebugLevel parsed = DebugLevel::OFF;
  try {
    parsed = parse_env();
  } catch (const Error& e) {
    warn_once("debug-level", std::string(e.what()) + " (using OFF)");
  }
  g_level.store(static_cast<int>(parsed));
  return parsed;
}

void set_debug_level(DebugLevel level) { g_level.store(static_cast<int>(level)); }
void set_debug_level_from_env() { g_level.store(static_cast<int>(parse_env())); }

std::string to_string(DebugLevel level) {
  switch (level) {
    case DebugLevel::OFF:
      return "OFF";
    case DebugLevel::INFO:
      return "INFO";
    case DebugLevel::DETAIL:
      return "DETAIL";
  }
  return "?";
}

namespace comm {

bool detail_checks_on() { return get_debug_level() == DebugLevel::DETAIL; }

void init_debug_level() {
  if (g_level.load() < 0) set_debug_level_from_env();
}

std::string describe(const at::Tensor& t) {
  std::ostringstream os;
  os << c10::toString(t.scalar_type()) << "[";
  for (int64_t d = 0; d < t.dim(); ++d) os << (d ? ", " : "") << t.size(d);
  os << "]";
  return os.str();
}

void check_same_call(const detail::GroupImpl& g, const std::string& desc) {
  const size_t n = g.ranks.size();
  if (n < 2) return;
  auto& st = world_state();
  c10d::Store& s = *st.store;
  const uint64_t seq = g.debug_seq.fetch_add(1);
  auto key = [&](uint64_t q, size_t r) { return detail::cat("debug/", g.name, "/", q, "/", r); };
  // Step 2.
  s.set(key(seq, g.rank), store::to_bytes(desc));
  if (seq >= 2) s.deleteKey(key(seq - 2, g.rank));
  // Step 3.
  std::vector<std::string> calls(n);
  calls[g.rank] = desc;
  for (size_t r = 0; r < n; ++r) {
    if (static_cast<int>(r) == g.rank) continue;
    try {
      calls[r] = store::to_string(s.get(key(seq, r)));
    } catch (const std::exception& e) {
      throw Error(detail::cat("rank ", st.rank, ": DTRAIN_DEBUG=DETAIL: rank ", g.ranks[r],
                              " did not reach collective #", seq, " on group '", g.name, "' (rank ", st.rank, " calls ",
                              desc,
                              ") within the timeout: it is stuck elsewhere, has failed, or "
                              "calls fewer collectives (",
                              brief(e), ")"));
    }
  }
  // Step 4.
  for (size_t r = 1; r < n; ++r) {
    if (calls[r] == calls[0]) continue;
    throw Error(detail::cat("rank ", st.rank, ": DTRAIN_DEBUG=DETAIL: collective #", seq, " on group '", g.name,
                            "' differs across ranks: rank ", g.ranks[0], " calls ", calls[0], " but rank ", g.ranks[r],
                            " calls ", calls[r],
                            ": every rank must call the same collectives in the same order with the same "
                            "shapes and dtypes"));
  }
}

}  // namespace comm
}  // namespace dtrain
