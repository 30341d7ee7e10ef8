// One call of a collective front end (comm/collectives.cpp), as a sequence of phases that every
// front end takes in the same order, as ProcessGroupGloo's AsyncWork runs its own:
//
//   1. who:        the caller is a member of the group (the constructor);
//   2. what:       its tensors are usable (defined, contiguous; lists of one per rank);
//   3. can:        the group's backend runs this call (dtype, reduce op, device), checked before anything
//                  is sent, so every rank refuses alike and the group stays usable;
//   4. same:       under DTRAIN_DEBUG=DETAIL every rank makes the same call (comm/debug_check.h);
//   5. record:     the flight recorder's record of the call (comm/flight_recorder.h);
//   6. launch:     the backend's c10d op inside a BlockingCallScope
//                  (Note [Inline blocking collectives]), wrapped in a Work that names the rank and
//                  the operation when it fails, and waited for unless async_op.
//
// A step that every collective should take (a profiler range, a NaN check) is one edit here, not
// one per front end. Example:
//
//   comm::CollectiveCall call(group, "broadcast");
//   call.tensor(t).supported(c10d::OpType::BROADCAST, t).same_call(comm::describe(t), "src=0");
//   opts.rootRank = call.group_rank(src, "src");
//   call.record(FlightCall("broadcast", "broadcast").in(t).out(t));
//   return call.launch([&] { return call.group().pg->broadcast(ts, opts); }, async_op);
#pragma once

#include <functional>
#include <string>
#include <utility>
#include <vector>

#include <c10/util/FunctionRef.h>
#include <torch/csrc/distributed/c10d/Types.hpp>

#include "comm/capabilities.h"
#include "comm/debug_check.h"
#include "comm/flight_recorder.h"
#include "comm/state.h"
#include "dtrain/process_group.h"

namespace dtrain::comm {

c10d::ReduceOp to_c10d(ReduceOp op);

class CollectiveCall {
 public:
  // 1. The caller must be a member of `group`.
  CollectiveCall(const Group& group, const char* op);

  const detail::GroupImpl& group() const { return g_; }
  const char* op() const { return op_; }
  // "rank 1: all_reduce on group 'default' (gloo, ranks [0, 1], timeout 5 s)": what a failure or a
  // timeout names (Note [collective timeouts]).
  std::string what() const;
  // The group rank of a global rank the caller named as `role` ("src", "dst"); refused when it is
  // not a member.
  int group_rank(int global, const char* role) const;

  // 2. A tensor defined and contiguous; a list of one such tensor per rank, each shaped as `like`.
  CollectiveCall& tensor(const at::Tensor& t);
  CollectiveCall& list(const std::vector<at::Tensor>& list, const at::Tensor& like, const char* name);
  // ReduceOp::AVG divides in place (Note [AVG on Gloo]), which an integer tensor cannot hold.
  CollectiveCall& average(ReduceOp op, const at::Tensor& t);
  // 3. The group's backend can run the call.
  CollectiveCall& supported(c10d::OpType type, const at::Tensor& t, ReduceOp rop = ReduceOp::SUM);
  // 4. DTRAIN_DEBUG=DETAIL: every member describes its call by `parts` (the arguments every rank
  // passes alike) and the descriptions must agree.
  template <typename... Parts>
  CollectiveCall& same_call(const Parts&... parts) {
    if (!detail_checks_on()) return *this;
    std::string desc = std::string(op_) + "(";
    bool first = true;
    [[maybe_unused]] auto add = [&](const std::string& p) {  // unused without parts (barrier)
      desc += (first ? "" : ", ") + p;
      first = false;
    };
    (add(parts), ...);
    check_same_call(g_, desc + ")");
    return *this;
  }
  // 5. The call's flight record.
  CollectiveCall& record(FlightCall call);
  FlightRecord& flight() { return rec_; }

  // 6. Hands the call to the backend (`start` returns its c10d::Work) inside a BlockingCallScope,
  // and waits unless async_op. `done` runs once the work is done (AVG's division).
  template <typename Start>
  Work launch(Start&& start, bool async_op, std::function<void()> done = {}) {
    BlockingCallScope blocking(!async_op);
    return finish(begin(std::forward<Start>(start), std::move(done)), async_op);
  }
  // The same without the scope and without waiting: point-to-point calls, which return their Work.
  template <typename Start>
  Work begin(Start&& start, std::function<void()> done = {}, std::function<bool()> parts_done = {}) {
    c10::intrusive_ptr<c10d::Work> w;
    try {
      w = start();
    } catch (const std::exception& e) {
      rec_.failed(brief(e));
      throw;
    }
    return wrap(std::move(w), std::move(done), std::move(parts_done));
  }
  // A call made of others (composed on Gloo): the record covers the whole, its parts are not
  // recorded (run them inside a FlightPartsScope); `done` finishes it, `parts_done` polls it.
  Work composed(std::function<void()> done, std::function<bool()> parts_done, bool async_op);
  // Parts of the call that finish before it returns, under its record (their own calls are not
  // recorded: run them inside a FlightPartsScope).
  template <typename Run>
  void run_parts(Run&& run) {
    rec_.started();
    try {
      run();
    } catch (const std::exception& e) {
      rec_.failed(brief(e));
      throw;
    }
    rec_.completed();
  }
  // A backend's inline run (Note [Inline blocking collectives]) under the record: true and completed
  // if it ran; a failure is marked and rethrown as dtrain::Error; false leaves the general path.
  // A function_ref, not a std::function: the caller's lambda is called in place, never copied to the
  // heap (a blocking all_reduce of 4 KB takes this path on every call).
  bool run_inline(c10::function_ref<bool()> here);

 private:
  Work wrap(c10::intrusive_ptr<c10d::Work> w, std::function<void()> done, std::function<bool()> parts_done);
  static Work finish(Work w, bool async_op);

  const detail::GroupImpl& g_;
  const char* op_;
  FlightRecord rec_;
};

}  // namespace dtrain::comm
