// split_group: MPI_Comm_split over a dtrain group.
//
//   1. Every member of the parent all-gathers (color, key) over the parent, so each knows every
//      member's choice and the ranks of its own color.
//   2. The new group's name is the parent's name, the parent's next object index and the color:
//      only the parent's members call split_group, so a count kept per process, or the world's
//      new_group counter, would differ between ranks (Note [Group-agreed ids]). Ranks of other
//      colors build nothing for it, so groups of different colors are built without meeting.
//   3. The members of a color build its backend under "pg/<name>" and wait for each other
//      (Note [new_group barrier]).
#include <algorithm>
#include <tuple>

#include "comm/state.h"
#include "common/util.h"

namespace dtrain {

Group split_group(int color, int key, const Group& parent, std::optional<std::chrono::milliseconds> timeout) {
  auto& st = comm::world_state();
  DTRAIN_CHECK(!st.pytorch_peers, "rank ", st.rank,
               ": split_group is not supported when the job has Python ranks "
               "(Python names split groups by hashes of its own): use new_group, which makes Python's groups");
  const auto& p = comm::resolve(parent);
  DTRAIN_CHECK(p.rank >= 0, "rank ", st.rank, ": split_group: this rank is not a member of group '", p.name,
               "': only the parent's members call split_group");
  const int64_t index = parent.next_object_index();
  const auto choices = all_gather_values(std::vector<int64_t>{color, key}, parent);  // step 1

  // (key, parent rank, global rank) of this color's members, in the group's order.
  std::vector<std::tuple<int64_t, int, int>> members;
  for (size_t r = 0; r < choices.size(); ++r)
    if (color >= 0 && choices[r][0] == color) members.emplace_back(choices[r][1], static_cast<int>(r), p.ranks[r]);
  std::sort(members.begin(), members.end());
  std::vector<int> ranks;
  std::vector<std::string> listed;
  for (const auto& m : members) {
    ranks.push_back(std::get<2>(m));
    listed.push_back(std::to_string(std::get<2>(m)));
  }
  DTRAIN_CHECK(std::is_sorted(ranks.begin(), ranks.end()), "rank ", st.rank, ": split_group: the keys order color ",
               color, "'s members as global ranks [", util::join(listed, ", "),
               "], but a group numbers its ranks by global rank: pass keys that increase with the rank "
               "(the parent rank will do)");

  const std::string name =
      detail::cat(p.name, ".split", index, ".c", color < 0 ? std::string("none") : std::to_string(color));
  const auto group_timeout = util::capped(timeout.value_or(p.timeout));
  auto g = comm::make_group(st, name, std::move(ranks), group_timeout);
  comm::await_members(st, *g, group_timeout,
                      "every member of the parent group must call split_group, in the same order");
  return detail::GroupAccess::make(std::move(g));
}

}  // namespace dtrain
