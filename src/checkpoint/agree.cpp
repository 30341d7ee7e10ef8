// The first failure of any rank, thrown on every rank alike (agree.h).
#include "checkpoint/agree.h"

#include <vector>

#include "dtrain/errors.h"

namespace dtrain::ckpt {

void throw_first_failure(const std::string& mine, const Group& group, const std::string& what) {
  // One process, or a group of one: nobody else to tell.
  if (!is_initialized() || group.size() == 1) {
    if (!mine.empty()) throw Error(what + mine);
    return;
  }
  const std::vector<std::string> all = all_gather_bytes(mine, group);
  for (size_t r = 0; r < all.size(); ++r)
    if (!all[r].empty()) throw Error(detail::cat(what, "rank ", group.ranks()[r], ": ", all[r]));
}

}  // namespace dtrain::ckpt
