// A counter in the job's store that every member of a set increments, and a bounded wait until it
// reaches the set's size: new_group's barrier (Note [new_group barrier]), destroy_process_group's
// checkout (Note [Store lifetime]) and the read receipts of the rendezvous verdict (Note [Verdict receipts]).
#pragma once

#include <chrono>
#include <cstdint>
#include <string>

namespace c10d {
class Store;
}

namespace dtrain::comm {

// Each member counts itself in with store.add(key, 1); whoever must wait for all of them calls this.
// Waits until the counter `key` holds at least n. When `timeout` passes first, throws dtrain::Error
//   "<context>: only <c> of <n> members reached store key '<key>' within <t> ms (<n - c> missing): <remedy>"
// A store that fails (its host is gone) throws its own error.
void wait_for_count(c10d::Store& store, const std::string& key, int64_t n, std::chrono::milliseconds timeout,
                    const std::string& context, const std::string& remedy);

}  // namespace dtrain::comm
