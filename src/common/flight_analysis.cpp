// The flight-record analysis (steps in flight_analysis.h).
#include "common/flight_analysis.h"

#include <dirent.h>

#include <algorithm>
#include <cstdio>
#include <map>
#include <set>
#include <stdexcept>

#include "common/flight_pickle.h"
#include "common/util.h"

namespace dtrain::flight {
namespace {

using json = nlohmann::json;

// One recorded call, as the analysis needs it.
struct Call {
  std::string group;
  int64_t seq = -1;  // collective_seq_id (collectives) or dtrain_peer_seq (send/recv)
  bool p2p = false;
  std::string op;
  std::string sizes, dtypes;  // "[4, 2]" (one tensor) or "[[4], [2]]"; "Float"
  int64_t root = -1, peer = -1, tag = 0;
  std::string state;  // scheduled, started, completed, failed
  int64_t created_ns = 0, completed_ns = 0;
  bool done() const { return state == "completed"; }
  std::string signature() const { return op + "|" + sizes + "|" + dtypes + "|" + std::to_string(root); }
};

struct RankRecord {
  int rank = -1;
  int64_t dump_ns = 0;
  std::vector<Call> calls;  // in record order
};

struct GroupInfo {
  std::vector<int> ranks;  // global, sorted
};

template <typename T>
T get_or(const json& j, const char* key, T fallback) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return fallback;
  try {
    return it->get<T>();
  } catch (const std::exception&) {
    return fallback;
  }
}

std::string brief_list(const json& lists) {
  if (!lists.is_array()) return "?";
  if (lists.size() == 1 && lists[0].is_array()) return lists[0].dump(-1).size() ? lists[0].dump() : "[]";
  return lists.dump();
}

std::string pretty(std::string s) {  // "[4,2]" -> "[4, 2]"
  std::string out;
  for (char c : s) {
    out += c;
    if (c == ',') out += ' ';
  }
  return out;
}

// "gloo:all_reduce", "gloo:send 0->1": the operation.
std::string op_of(const json& e) {
  std::string op = get_or<std::string>(e, "dtrain_op", "");
  if (!op.empty()) return op;
  std::string name = get_or<std::string>(e, "profiling_name", "?");
  name = name.substr(name.rfind(':') == std::string::npos ? 0 : name.rfind(':') + 1);
  return name.substr(0, name.find(' '));
}

Call parse_call(const json& e) {
  Call c;
  const json& pg = e.value("process_group", json::array());
  c.group = pg.is_array() && !pg.empty() && pg[0].is_string() ? pg[0].get<std::string>() : "?";
  c.p2p = get_or<bool>(e, "is_p2p", false);
  c.seq = c.p2p ? get_or<int64_t>(e, "dtrain_peer_seq", -1) : get_or<int64_t>(e, "collective_seq_id", -1);
  c.op = op_of(e);
  // An all_to_all's ranks pass different sizes by design: only its dtype must agree.
  if (c.op.rfind("all_to_all", 0) != 0 && c.op.rfind("alltoall", 0) != 0)
    c.sizes = pretty(brief_list(e.value("input_sizes", json::array())));
  const json dt = e.value("input_dtypes", json::array());
  c.dtypes = dt.is_array() && dt.size() == 1 && dt[0].is_string() ? dt[0].get<std::string>() : dt.dump();
  c.root = get_or<int64_t>(e, "dtrain_root", -1);
  c.peer = get_or<int64_t>(e, "dtrain_peer", -1);
  c.tag = get_or<int64_t>(e, "dtrain_tag", 0);
  c.state = get_or<std::string>(e, "state", "?");
  c.created_ns = get_or<int64_t>(e, "time_created_ns", 0);
  c.completed_ns = get_or<int64_t>(e, "time_discovered_completed_ns", 0);
  return c;
}

std::string secs(int64_t ns) {
  char b[32];
  std::snprintf(b, sizeof(b), "%.1f s", std::max<int64_t>(ns, 0) * 1e-9);
  return b;
}

std::string rank_list(const std::vector<int>& ranks) {
  std::vector<std::string> parts;
  for (int r : ranks) parts.push_back(std::to_string(r));
  return (ranks.size() == 1 ? "rank " : "ranks ") + util::join(parts, ", ");
}

// The state of the analysis: every rank's record and every group's members.
class Analysis {
 public:
  Analysis(const std::vector<json>& dumps, int world_size);
  std::vector<std::string> run();

 private:
  const Call* call_at(int rank, const std::string& group, int64_t seq) const;
  std::vector<const Call*> collectives(int rank, const std::string& group) const;
  bool mismatch(const std::string& group, std::vector<std::string>& out) const;
  std::string skipped(const std::string& group, int rank, int64_t seq, const std::vector<int>& majority) const;
  void p2p(std::vector<std::string>& out) const;
  void hang(const std::string& group, std::vector<std::string>& out) const;
  std::string whereabouts(int rank, const std::string& group) const;

  std::map<int, RankRecord> ranks_;
  std::map<std::string, GroupInfo> groups_;
};

Analysis::Analysis(const std::vector<json>& dumps, int world_size) {
  for (const auto& d : dumps) {
    RankRecord r;
    r.rank = get_or<int>(d, "rank", -1);
    if (r.rank < 0) continue;
    r.dump_ns = get_or<int64_t>(d.value("dtrain", json::object()), "dump_time_ns", 0);
    for (const auto& e : d.value("entries", json::array()))
      if (e.is_object()) r.calls.push_back(parse_call(e));
    if (r.dump_ns == 0)
      for (const auto& c : r.calls) r.dump_ns = std::max({r.dump_ns, c.created_ns, c.completed_ns});
    const json pg_config = d.value("pg_config", json::object());
    for (auto& [name, cfg] : pg_config.items()) {
      auto ranks = json::parse(get_or<std::string>(cfg, "ranks", "[]"), nullptr, false);
      if (!ranks.is_array() || groups_.count(name)) continue;
      for (const auto& x : ranks)
        if (x.is_number_integer()) groups_[name].ranks.push_back(x.get<int>());
    }
    ranks_[r.rank] = std::move(r);
  }
  if (world_size > 0 && !groups_.count("default"))
    for (int i = 0; i < world_size; ++i) groups_["default"].ranks.push_back(i);
}

const Call* Analysis::call_at(int rank, const std::string& group, int64_t seq) const {
  auto it = ranks_.find(rank);
  if (it == ranks_.end()) return nullptr;
  for (const auto& c : it->second.calls)
    if (!c.p2p && c.group == group && c.seq == seq) return &c;
  return nullptr;
}

std::vector<const Call*> Analysis::collectives(int rank, const std::string& group) const {
  std::vector<const Call*> out;
  auto it = ranks_.find(rank);
  if (it != ranks_.end())
    for (const auto& c : it->second.calls)
      if (!c.p2p && c.group == group) out.push_back(&c);
  return out;
}

std::vector<std::string> Analysis::run() {
  std::vector<std::string> out;
  for (const auto& [name, info] : groups_) mismatch(name, out);
  if (!out.empty()) return out;
  p2p(out);
  for (const auto& [name, info] : groups_) hang(name, out);
  if (out.empty())
    out.push_back("no hang or mismatch in the records of " + std::to_string(ranks_.size()) +
                  " ranks: every recorded call completed on every rank that made it");
  return out;
}

// Step 1: the first sequence number where the members' calls differ.
bool Analysis::mismatch(const std::string& group, std::vector<std::string>& out) const {
  std::set<int64_t> seqs;
  for (int r : groups_.at(group).ranks)
    for (const Call* c : collectives(r, group)) seqs.insert(c->seq);
  for (int64_t s : seqs) {
    std::map<std::string, std::vector<int>> by_sig;
    std::map<std::string, const Call*> sample;
    for (int r : groups_.at(group).ranks)
      if (const Call* c = call_at(r, group, s)) {
        by_sig[c->signature()].push_back(r);
        sample[c->signature()] = c;
      }
    if (by_sig.size() < 2) continue;
    // The majority's call (the most ranks; on a tie, the one with the lowest rank).
    auto major = by_sig.begin();
    for (auto it = by_sig.begin(); it != by_sig.end(); ++it)
      if (it->second.size() > major->second.size() ||
          (it->second.size() == major->second.size() && it->second[0] < major->second[0]))
        major = it;
    const Call& m = *sample[major->first];
    const std::string where = " at #" + std::to_string(s) + " of group '" + group + "'";
    const bool others = by_sig.size() == 2;
    for (const auto& [sig, ranks] : by_sig) {
      if (sig == major->first) continue;
      const Call& c = *sample[sig];
      if (ranks.size() == 1) {
        std::string skip = skipped(group, ranks[0], s, major->second);
        if (!skip.empty()) {
          out.push_back(skip);
          continue;
        }
      }
      // "the others" when they all agree and are several; with two ranks, the other one by name.
      const std::string them = others && major->second.size() > 1 ? "the others" : rank_list(major->second);
      if (c.op != m.op)
        out.push_back("ranks disagree" + where + ": " + rank_list(ranks) + (ranks.size() == 1 ? " calls " : " call ") +
                      c.op + ", " + them + " " + m.op);
      else if (c.sizes != m.sizes)
        out.push_back("sizes differ" + where + " (" + m.op + "): " + rank_list(ranks) +
                      (ranks.size() == 1 ? " passes " : " pass ") + c.sizes + ", " + them + " " + m.sizes);
      else if (c.dtypes != m.dtypes)
        out.push_back("dtypes differ" + where + " (" + m.op + "): " + rank_list(ranks) +
                      (ranks.size() == 1 ? " passes " : " pass ") + c.dtypes + ", " + them + " " + m.dtypes);
      else
        out.push_back("roots differ" + where + " (" + m.op + "): " + rank_list(ranks) + " use" +
                      (ranks.size() == 1 ? "s " : " ") + "root " + std::to_string(c.root) + ", " + them + " root " +
                      std::to_string(m.root));
    }
    return true;
  }
  return false;
}

// Whether `rank`'s call #seq is the call the majority makes after #seq: what they made at #seq+1,
// or, when they have not got there (they wait in #seq), at #seq+1-p for the period p of their calls
// (a training step repeats its collectives). Returns the line, or "" when it is not a skip.
std::string Analysis::skipped(const std::string& group, int rank, int64_t seq, const std::vector<int>& majority) const {
  const Call* mine = call_at(rank, group, seq);
  const Call* theirs = call_at(majority[0], group, seq);
  if (!mine || !theirs) return "";
  const Call* next = call_at(majority[0], group, seq + 1);
  if (!next) {
    auto sig = [&](int64_t s) {
      const Call* c = call_at(majority[0], group, s);
      return c ? c->signature() : std::string();
    };
    for (int64_t p = 1; p <= 64 && !next; ++p) {
      bool periodic = true;
      int64_t checked = 0;
      for (int64_t s = seq; s > seq - 3 * p && periodic; --s) {
        if (sig(s).empty() || sig(s - p).empty()) break;
        periodic = sig(s) == sig(s - p);
        ++checked;
      }
      if (periodic && checked >= std::min<int64_t>(2 * p, 2)) next = call_at(majority[0], group, seq + 1 - p);
    }
  }
  if (!next || next->signature() != mine->signature()) return "";
  return "rank " + std::to_string(rank) + " skipped " + theirs->op + " #" + std::to_string(seq) + " of group '" +
         group + "' (" + theirs->sizes + " " + theirs->dtypes + "): the others call it there, rank " +
         std::to_string(rank) + " calls " + mine->op + " " + mine->sizes + ", the call that comes after it";
}

// Step 2: a pending send or recv whose peer has not made the matching call.
void Analysis::p2p(std::vector<std::string>& out) const {
  for (const auto& [rank, rec] : ranks_)
    for (const Call& c : rec.calls) {
      if (!c.p2p || c.done() || c.peer < 0 || c.seq < 0) continue;
      const bool recv = c.op == "recv";
      const std::string opposite = recv ? "send" : "recv";
      auto peer = ranks_.find(static_cast<int>(c.peer));
      std::string line = (recv ? "recv with no matching send" : "send with no matching recv") +
                         std::string(" in group '") + c.group + "': rank " + std::to_string(rank) + " waits in " +
                         c.op + " #" + std::to_string(c.seq) + (recv ? " from" : " to") + " rank " +
                         std::to_string(c.peer) + " (tag " + std::to_string(c.tag) + ") for " +
                         secs(rec.dump_ns - c.created_ns) + "; ";
      if (peer == ranks_.end()) {
        out.push_back(line + "rank " + std::to_string(c.peer) +
                      " left no record (stopped, killed, or stuck where it cannot write one)");
        continue;
      }
      int64_t made = 0;
      bool matched = false;
      for (const Call& o : peer->second.calls)
        if (o.p2p && o.group == c.group && o.op == opposite && o.peer == rank) {
          made = std::max(made, o.seq);
          matched |= o.seq == c.seq;
        }
      if (matched) continue;
      out.push_back(line + "rank " + std::to_string(c.peer) + " made " + std::to_string(made) + " matching " +
                    opposite + (made == 1 ? "" : "s") + (recv ? " to" : " from") + " it and " +
                    whereabouts(static_cast<int>(c.peer), c.group));
    }
}

// What `rank` is doing, as seen from a wait in `group`: waiting elsewhere, or making no call.
std::string Analysis::whereabouts(int rank, const std::string& group) const {
  const RankRecord& rec = ranks_.at(rank);
  int64_t last = 0;
  for (const Call& c : rec.calls) {
    if (!c.done())
      return "waits in group '" + c.group + "' at " + c.op + " #" + std::to_string(c.seq) +
             (c.p2p ? (c.op == "recv" ? " from rank " : " to rank ") + std::to_string(c.peer) : "") + " (entered " +
             secs(rec.dump_ns - c.created_ns) + " before its dump)";
    last = std::max({last, c.created_ns, c.completed_ns});
  }
  (void)group;
  if (last == 0) return "has made no call at all";
  return "has made no call for " + secs(rec.dump_ns - last) +
         " while the others wait: it is computing or stuck outside dtrain";
}

// Step 3: the last sequence number entered, who waits in it and where the others are.
void Analysis::hang(const std::string& group, std::vector<std::string>& out) const {
  const auto& members = groups_.at(group).ranks;
  int64_t frontier = -1;
  for (int r : members)
    for (const Call* c : collectives(r, group)) frontier = std::max(frontier, c->seq);
  if (frontier < 0) return;
  std::vector<int> waiting, behind;
  int64_t waited = 0;
  const Call* at = nullptr;
  for (int r : members) {
    const Call* c = call_at(r, group, frontier);
    if (!c) {
      behind.push_back(r);
      continue;
    }
    at = c;
    if (c->done()) continue;
    waiting.push_back(r);
    waited = std::max(waited, ranks_.at(r).dump_ns - c->created_ns);
  }
  if (waiting.empty()) return;
  std::string line = "hang in group '" + group + "' at " + at->op + " #" + std::to_string(frontier) + ": " +
                     rank_list(waiting) + " entered it " + secs(waited) + " ago";
  if (behind.empty()) {
    out.push_back(line +
                  "; every rank entered it and none completed it: a peer stopped inside it, or the "
                  "transport failed");
    return;
  }
  std::vector<std::string> notes;
  for (int r : behind) {
    if (!ranks_.count(r)) {
      line += "; rank " + std::to_string(r) + " left no record (stopped, killed, or stuck where it cannot write one)";
      continue;
    }
    auto mine = collectives(r, group);
    if (mine.empty()) {
      line += "; rank " + std::to_string(r) + " has not entered any call of this group";
    } else {
      const Call* last = mine.back();
      for (const Call* c : mine)
        if (c->seq > last->seq) last = c;
      line += "; rank " + std::to_string(r) + (last->done() ? " completed #" : " entered #") +
              std::to_string(last->seq) + " and has not entered #" + std::to_string(frontier);
    }
    notes.push_back("rank " + std::to_string(r) + " " + whereabouts(r, group));
  }
  out.push_back(line);
  for (auto& n : notes) out.push_back(n);
}

}  // namespace

std::vector<json> read_dumps(const std::string& dir, std::vector<std::string>* problems) {
  DIR* d = opendir(dir.c_str());
  if (!d)
    throw std::runtime_error("cannot read the folder '" + dir +
                             "' of flight records: pass the folder the ranks' dtrain_trace_rank_<N> files are in");
  std::vector<std::string> names;
  while (dirent* e = readdir(d)) {
    const std::string n = e->d_name;
    if (n.rfind(kDumpPrefix, 0) == 0 && util::is_digits(n.substr(std::string(kDumpPrefix).size()))) names.push_back(n);
  }
  closedir(d);
  std::sort(names.begin(), names.end());
  std::vector<json> dumps;
  for (const auto& n : names) {
    try {
      json j = pickle::loads(util::read_file(dir + "/" + n, "flight record"));
      if (!j.is_object()) throw std::runtime_error("not a dict");
      if (!j.contains("rank")) j["rank"] = std::stoi(n.substr(std::string(kDumpPrefix).size()));
      dumps.push_back(std::move(j));
    } catch (const std::exception& e) {
      if (problems) problems->push_back(dir + "/" + n + ": " + e.what());
    }
  }
  return dumps;
}

std::vector<std::string> analyze(const std::vector<json>& dumps, int world_size) {
  try {
    return Analysis(dumps, world_size).run();
  } catch (const std::exception& e) {
    return {std::string("the flight records could not be analysed: ") + e.what()};
  }
}

}  // namespace dtrain::flight
