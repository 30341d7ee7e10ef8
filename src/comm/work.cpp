// dtrain::Work and dtrain::Group accessors.
#include <mutex>

#include <c10/util/Exception.h>

#include "comm/capabilities.h"
#include "comm/flight_recorder.h"
#include "comm/state.h"

namespace dtrain {

// The message of any exception without c10's backtrace.
std::string brief(const std::exception& e) {
  if (auto* ce = dynamic_cast<const c10::Error*>(&e)) return ce->what_without_backtrace();
  return e.what();
}

namespace comm {

Error collective_failure(const std::string& what, const std::exception& e) {
  // Note [collective timeouts]: a peer that hangs, is stopped (SIGSTOP) or died mid-collective
  // reaches the others as the backend's timeout (Gloo: "Timed out waiting ..."); say so plainly.
  const std::string msg = brief(e);
  const bool timed_out = (msg.find("imed out") != std::string::npos || msg.find("imeout") != std::string::npos) &&
                         msg.rfind(kUnusableGroup, 0) != 0;  // an earlier call's timeout
  return Error(what +
               (timed_out ? " timed out (a rank of the group did not take part in time: hung, stopped or dead?): "
                          : " failed: ") +
               msg);
}

}  // namespace comm

struct Work::State {
  c10::intrusive_ptr<c10d::Work> work;  // null for composed operations (on_done does the waiting)
  std::string what;                     // "rank 1: all_reduce on group 'default' (gloo)"
  std::function<void()> on_done;
  std::function<bool()> parts_done;  // composed operations: whether their parts have finished
  std::once_flag once;
  std::exception_ptr error;
  // Work::then callbacks for works without a completion future: run after the first wait().
  std::mutex then_mu;
  bool waited = false;
  std::vector<std::function<void()>> then_fns;
  comm::FlightRecord flight;  // the call's entry in the flight recorder (empty: none)
};

struct detail::WorkAccess {
  static void attach(Work& w, comm::FlightRecord rec) {
    if (w.state_) w.state_->flight = std::move(rec);
  }
};

void comm::attach_flight_record(Work& w, FlightRecord rec) { detail::WorkAccess::attach(w, std::move(rec)); }

Work::Work(c10::intrusive_ptr<c10d::Work> work, std::string what, std::function<void()> on_done,
           std::function<bool()> parts_done)
    : state_(std::make_shared<State>()) {
  state_->work = std::move(work);
  state_->what = std::move(what);
  state_->on_done = std::move(on_done);
  state_->parts_done = std::move(parts_done);
}

void Work::wait() {
  if (!state_) return;
  std::call_once(state_->once, [s = state_.get()] {
    try {
      if (s->work) s->work->wait();
      if (s->on_done) s->on_done();
      s->flight.completed();
    } catch (const Error& e) {
      s->error = std::make_exception_ptr(e);
      s->flight.failed(e.what());
    } catch (const std::exception& e) {
      const Error err = comm::collective_failure(s->what, e);
      s->error = std::make_exception_ptr(err);
      s->flight.failed(err.what());
    }
    std::vector<std::function<void()>> fns;
    {
      std::lock_guard<std::mutex> g(s->then_mu);
      s->waited = true;
      fns.swap(s->then_fns);
    }
    for (auto& fn : fns) fn();
  });
  if (state_->error) std::rethrow_exception(state_->error);
}

void Work::then(std::function<void()> user_fn) {
  if (!state_) {
    user_fn();
    return;
  }
  // fn may run on the backend's thread, where an escaping exception would terminate the process:
  // it is documented not to throw, and one that does is reported instead.
  std::function<void()> fn = [user_fn = std::move(user_fn), what = state_->what] {
    try {
      user_fn();
    } catch (const std::exception& e) {
      warn_once("work-then:" + what, what + ": a Work::then callback threw (" + brief(e) +
                                         "): callbacks must not throw; the exception was ignored");
    }
  };
  if (state_->work && compat::add_completion_callback(state_->work, fn)) return;
  {
    std::lock_guard<std::mutex> g(state_->then_mu);
    if (!state_->waited) {
      state_->then_fns.push_back(std::move(fn));
      return;
    }
  }
  fn();
}

bool Work::is_completed() {
  if (!state_) return true;
  if (state_->work && !state_->work->isCompleted()) return false;
  if (state_->parts_done && !state_->parts_done()) return false;
  // The backend is done: run the last local step now (it does not block), so that "completed"
  // means the results are in place. A failure stays stored for wait() to rethrow.
  try {
    wait();
  } catch (const std::exception&) {
  }
  return true;
}

const detail::GroupImpl& detail::GroupAccess::impl(const Group& group) {
  DTRAIN_ASSERT(group.impl_ != nullptr, "GroupAccess::impl on the default group");
  return *group.impl_;
}

bool Group::is_member() const { return comm::resolve(*this).rank >= 0; }
int Group::rank() const { return comm::resolve(*this).rank; }
int Group::size() const { return static_cast<int>(comm::resolve(*this).ranks.size()); }
const std::vector<int>& Group::ranks() const { return comm::resolve(*this).ranks; }
std::string Group::backend() const { return comm::resolve(*this).backend; }
namespace comm {
const Capabilities& capabilities(const Group& group) {
  const auto& g = resolve(group);
  DTRAIN_CHECK(g.caps, "rank ", world_state().rank, ": group '", g.name,
               "' has no backend on this rank, which is not a member: use it only on the group's ranks");
  return *g.caps;
}
}  // namespace comm

bool Group::uses_shared_memory() const {
  const auto& g = comm::resolve(*this);
  return g.caps && g.caps->uses_shared_memory();
}
int Group::group_rank(int global_rank) const {
  const auto& g = comm::resolve(*this);
  auto it = g.group_rank_of.find(global_rank);
  DTRAIN_CHECK(it != g.group_rank_of.end(), "rank ", global_rank, " is not a member of group '", g.name, "'");
  return it->second;
}
const std::string& Group::name() const { return comm::resolve(*this).name; }
int64_t Group::next_object_index() const {
  const auto& g = comm::resolve(*this);
  DTRAIN_CHECK(g.rank >= 0, "rank ", comm::world_state().rank, " is not a member of group '", g.name,
               "': only its members build objects on it");
  return g.objects.fetch_add(1);
}

}  // namespace dtrain
