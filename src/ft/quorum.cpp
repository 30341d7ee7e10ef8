// The quorum's records in the store and the heartbeat observer (ft/quorum.h).
#include "ft/quorum.h"

#include <sstream>

#include "dtrain/errors.h"

namespace dtrain::ft {

std::string text(const store::Bytes& b) { return std::string(b.begin(), b.end()); }
store::Bytes bytes(const std::string& s) { return store::Bytes(s.begin(), s.end()); }

std::string round_key(int64_t round, const std::string& what) { return detail::cat("ft/r", round, "/", what); }

std::optional<std::string> peek(store::StoreClient& store, const std::string& key) {
  if (!store.check({key})) return std::nullopt;
  try {
    return text(store.get(key, std::chrono::milliseconds(100)));
  } catch (const store::TimeoutError&) {
    return std::nullopt;  // deleted in between (a round's cleanup)
  }
}

std::string encode(const Member& m) { return detail::cat(m.id, " ", m.step, " ", m.incarnation); }

Member decode_member(const std::string& t) {
  std::istringstream s(t);
  Member m;
  DTRAIN_CHECK(static_cast<bool>(s >> m.id >> m.step >> m.incarnation), "fault tolerance: a corrupt quorum slot '", t,
               "' in the store: start the job afresh (another program writes ft/ keys?)");
  return m;
}

std::string encode(const Decision& d) {
  std::ostringstream s;
  s << d.quorum_id << " " << d.max_step << "\n";
  for (const Member& m : d.members) s << encode(m) << "\n";
  return s.str();
}

Decision decode_decision(const std::string& t) {
  std::istringstream s(t);
  Decision d;
  DTRAIN_CHECK(static_cast<bool>(s >> d.quorum_id >> d.max_step), "fault tolerance: a corrupt quorum record '", t,
               "' in the store: start the job afresh (another program writes ft/ keys?)");
  Member m;
  while (s >> m.id >> m.step >> m.incarnation) d.members.push_back(m);
  return d;
}

bool Liveness::alive(store::StoreClient& store, const Member& m) {
  if (store.add("ft/inc/" + m.id, 0) != m.incarnation) return false;  // relaunched: that process is gone
  const int64_t count = store.add("ft/hb/" + m.id, 0);
  const auto now = std::chrono::steady_clock::now();
  auto [it, fresh] = seen_.try_emplace(m.id, Seen{count, now});
  if (!fresh && it->second.count != count) it->second = Seen{count, now};
  return now - it->second.since < timeout_;
}

}  // namespace dtrain::ft
