// What the front end tells a backend about a call beyond c10d's arguments, without knowing which
// backend it talks to. A backend may use a hint or ignore it; the collectives are correct either way.
#pragma once

namespace dtrain::comm {

// Note [Inline blocking collectives]: a caller that waits at once (async_op=false) marks the call
// with a BlockingCallScope; the shared-memory group then runs it on the calling thread when nothing
// is queued, saving two thread hand-offs (tens of microseconds; far more on a loaded machine).
// Asynchronous calls (DDP's buckets during backward) still run on the worker thread; DDP launches its
// last bucket, ready only when backward is done, as a blocking call. A blocking all_reduce skips even
// the Work objects where the backend can run it at once (comm/backend.h, all_reduce_here).
class BlockingCallScope {
 public:
  explicit BlockingCallScope(bool blocking);
  ~BlockingCallScope();
  BlockingCallScope(const BlockingCallScope&) = delete;
  BlockingCallScope& operator=(const BlockingCallScope&) = delete;

 private:
  bool previous_;
};

// Whether the innermost BlockingCallScope on this thread says the caller waits at once.
bool caller_waits_at_once();

// How a backend's error for a call on a broken group begins (Note [Broken groups] in
// shm/shm_process_group.cpp): the front end then reports the earlier failure it carries, not a
// timeout of this call.
inline constexpr const char kUnusableGroup[] = "the group is unusable since an earlier collective failed";

}  // namespace dtrain::comm
