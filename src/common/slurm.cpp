// Slurm's host lists, task counts and the rendezvous derived from them (see slurm.h).
#include "common/slurm.h"

#include "common/util.h"
#include "dtrain/errors.h"

namespace dtrain::slurm {
namespace {

// A list longer than any cluster is a corrupted variable, not a job.
constexpr size_t kMaxListHosts = size_t{1} << 20;
// ... and so are more bytes of host names than that many hosts of 16 characters: the count alone let
// a list of 60 bytes ("<48 letters>[0-1048575]") expand to 55 MiB of names and a 4 KiB one to 4 GiB.
constexpr size_t kMaxListBytes = size_t{16} << 20;

[[noreturn]] void malformed(const std::string& var, const std::string& value, const std::string& kind,
                            const std::string& why, const std::string& remedy) {
  throw Error(detail::cat(var, "='", value, "' is not ", kind, " (", why, ")", remedy.empty() ? "" : ": ", remedy));
}

// Splits at the commas outside brackets: "a[1,3],b" -> "a[1,3]" "b".
std::vector<std::string> top_level_items(const std::string& list, const std::string& var, const std::string& remedy) {
  std::vector<std::string> items(1);
  int depth = 0;
  for (char c : list) {
    if (c == '[') ++depth;
    if (c == ']') --depth;
    if (depth < 0 || depth > 1) malformed(var, list, "a Slurm host list", "unbalanced brackets", remedy);
    if (c == ',' && depth == 0)
      items.emplace_back();
    else
      items.back() += c;
  }
  if (depth != 0) malformed(var, list, "a Slurm host list", "a '[' is not closed", remedy);
  return items;
}

// "01-03,7" -> 01 02 03 7: each range keeps the width of its lower bound ("08-10" -> 08 09 10).
std::vector<std::string> bracket_values(const std::string& inside, const std::string& var, const std::string& list,
                                        const std::string& remedy) {
  std::vector<std::string> out;
  for (const std::string& range : util::split(inside, ',')) {
    const size_t dash = range.find('-');
    const std::string lo = range.substr(0, dash), hi = dash == std::string::npos ? lo : range.substr(dash + 1);
    if (!util::is_digits(lo) || !util::is_digits(hi) || lo.size() > 9 || hi.size() > 9)
      malformed(var, list, "a Slurm host list", "'[" + inside + "]' holds '" + range + "', not N or N-M", remedy);
    const long a = std::stol(lo), b = std::stol(hi);
    if (a > b) malformed(var, list, "a Slurm host list", "the range " + range + " runs backwards", remedy);
    if (static_cast<size_t>(b - a) >= kMaxListHosts)
      malformed(var, list, "a Slurm host list", "the range " + range + " is too long", remedy);
    for (long v = a; v <= b; ++v) {
      std::string s = std::to_string(v);
      if (s.size() < lo.size()) s.insert(0, lo.size() - s.size(), '0');
      out.push_back(std::move(s));
    }
  }
  if (out.empty()) malformed(var, list, "a Slurm host list", "'[]' holds no number", remedy);
  return out;
}

}  // namespace

std::vector<std::string> expand_hosts(const std::string& list, const std::string& var, const std::string& remedy) {
  std::vector<std::string> hosts;
  size_t list_bytes = 0;  // of `hosts`
  for (const std::string& item : top_level_items(list, var, remedy)) {
    if (item.empty()) malformed(var, list, "a Slurm host list", "an empty host name", remedy);
    // Every bracket multiplies the names made so far by its values; the last bracket varies fastest.
    std::vector<std::string> names{""};
    size_t bytes = 0;  // of `names`, checked against kMaxListBytes before they are made
    size_t pos = 0;
    while (pos < item.size()) {
      const size_t open = item.find('[', pos);
      const std::string literal = item.substr(pos, open == std::string::npos ? std::string::npos : open - pos);
      if (literal.find(']') != std::string::npos)
        malformed(var, list, "a Slurm host list", "a ']' without its '['", remedy);
      bytes += names.size() * literal.size();
      if (list_bytes + bytes > kMaxListBytes) malformed(var, list, "a Slurm host list", "over 16 MiB of names", remedy);
      for (std::string& n : names) n += literal;
      if (open == std::string::npos) break;
      const size_t close = item.find(']', open);
      const auto values = bracket_values(item.substr(open + 1, close - open - 1), var, list, remedy);
      std::vector<std::string> next;
      if (names.size() * values.size() > kMaxListHosts)
        malformed(var, list, "a Slurm host list", "more than 2^20 hosts", remedy);
      size_t value_bytes = 0;
      for (const std::string& v : values) value_bytes += v.size();
      bytes = bytes * values.size() + names.size() * value_bytes;  // < 2^44: 2^24 bytes times 2^20 values
      if (list_bytes + bytes > kMaxListBytes) malformed(var, list, "a Slurm host list", "over 16 MiB of names", remedy);
      for (const std::string& n : names)
        for (const std::string& v : values) next.push_back(n + v);
      names = std::move(next);
      pos = close + 1;
    }
    hosts.insert(hosts.end(), names.begin(), names.end());
    list_bytes += bytes;
    if (hosts.size() > kMaxListHosts) malformed(var, list, "a Slurm host list", "more than 2^20 hosts", remedy);
  }
  return hosts;
}

std::vector<int> expand_counts(const std::string& counts, const std::string& var, const std::string& remedy) {
  std::vector<int> out;
  for (const std::string& item : util::split(counts, ',')) {
    // "N" or "N(xK)": N tasks on each of K nodes.
    const size_t paren = item.find("(x");
    const std::string n = item.substr(0, paren);
    std::string k = "1";
    if (paren != std::string::npos) {
      if (item.back() != ')') malformed(var, counts, "Slurm's task counts", "'" + item + "' is not N(xK)", remedy);
      k = item.substr(paren + 2, item.size() - paren - 3);
    }
    if (!util::is_digits(n) || !util::is_digits(k) || n.size() > 7 || k.size() > 7)
      malformed(var, counts, "Slurm's task counts", "'" + item + "' is not N or N(xK)", remedy);
    const int tasks = std::stoi(n), times = std::stoi(k);
    if (out.size() + static_cast<size_t>(times) > kMaxListHosts)
      malformed(var, counts, "Slurm's task counts", "more than 2^20 nodes", remedy);
    out.insert(out.end(), static_cast<size_t>(times), tasks);
  }
  return out;
}

uint16_t port_from_job_id(int64_t job_id) { return static_cast<uint16_t>(15000 + job_id % 10000); }

std::optional<Master> master(const env::Lookup& from, const std::string& remedy) {
  auto addr = env::host("MASTER_ADDR", from);
  auto port = env::port("MASTER_PORT", from);
  if (addr && port) return Master{*addr, *port, ""};
  const char* list_var = "SLURM_STEP_NODELIST";
  auto list = env::text(list_var, from);
  if (!list) list = env::text(list_var = "SLURM_JOB_NODELIST", from);
  auto job = env::integer("SLURM_JOB_ID", from);
  if (!list || !job) return std::nullopt;

  Master m;
  std::vector<std::string> said;
  if (addr) {
    m.host = *addr;
  } else {
    m.host = expand_hosts(*list, list_var, remedy).front();
    said.push_back(detail::cat("MASTER_ADDR=", m.host, " (the first host of ", list_var, "=", *list, ")"));
  }
  if (port) {
    m.port = *port;
  } else {
    m.port = port_from_job_id(*job);
    said.push_back(
        detail::cat("MASTER_PORT=", m.port, " (15000 + the last 4 digits of SLURM_JOB_ID=", *job, ", as Lightning)"));
  }
  m.note = detail::cat("rendezvous at ", util::join(said, " and "),
                       " from Slurm's job; export MASTER_ADDR and MASTER_PORT to choose others");
  return m;
}

std::optional<Step> step(const env::Lookup& from, const std::string& remedy) {
  auto ntasks = env::integer("SLURM_STEP_NUM_TASKS", from);
  if (!ntasks) return std::nullopt;
  auto need = [&](const char* name) {
    auto v = env::integer(name, from, remedy);
    DTRAIN_CHECK(v, name, " is not set but SLURM_STEP_NUM_TASKS=", *ntasks, " is: ", remedy);
    return static_cast<int>(*v);
  };
  Step s;
  s.ntasks = static_cast<int>(*ntasks);
  s.procid = need("SLURM_PROCID");
  s.localid = need("SLURM_LOCALID");
  const int node = need("SLURM_NODEID");
  DTRAIN_CHECK(s.procid < s.ntasks, "SLURM_PROCID=", s.procid, " is out of range for SLURM_STEP_NUM_TASKS=", s.ntasks,
               ": ", remedy);
  const std::string per_node = env::text("SLURM_STEP_TASKS_PER_NODE", from).value_or("");
  DTRAIN_CHECK(!per_node.empty(), "SLURM_STEP_TASKS_PER_NODE is not set but SLURM_STEP_NUM_TASKS=", s.ntasks,
               " is: ", remedy);
  const std::vector<int> counts = expand_counts(per_node, "SLURM_STEP_TASKS_PER_NODE", remedy);
  DTRAIN_CHECK(static_cast<size_t>(node) < counts.size(), "SLURM_NODEID=", node,
               " is out of range for SLURM_STEP_TASKS_PER_NODE=", per_node, ": ", remedy);
  s.tasks_on_node = counts[static_cast<size_t>(node)];
  DTRAIN_CHECK(s.localid < s.tasks_on_node, "SLURM_LOCALID=", s.localid, " is out of range for ", s.tasks_on_node,
               " task(s) on node ", node, " (SLURM_STEP_TASKS_PER_NODE=", per_node, "): ", remedy);
  return s;
}

}  // namespace dtrain::slurm
