#include "comm/capabilities.h"

namespace dtrain::comm {

namespace {
thread_local bool t_blocking_call = false;
}  // namespace

BlockingCallScope::BlockingCallScope(bool blocking) : previous_(t_blocking_call) { t_blocking_call = blocking; }
BlockingCallScope::~BlockingCallScope() { t_blocking_call = previous_; }

bool caller_waits_at_once() { return t_blocking_call; }

}  // namespace dtrain::comm
