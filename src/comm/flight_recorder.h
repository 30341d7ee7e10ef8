// The flight recorder: every rank keeps its last N collective and point-to-point calls per group
// (N = $DTRAIN_FLIGHT_ENTRIES, 2000; 0 turns it off), and writes them to a file when a call fails
// or times out, when no group has made progress for $DTRAIN_FLIGHT_STALL_S while a call is
// pending, on SIGUSR1, and when dtrain-run asks (it sends SIGUSR1). The file is the dict PyTorch's
// flight recorder pickles, so `python -m torch.distributed.flight_recorder.fr_trace DIR` reads it,
// and `dtrain-run --analyze DIR` names the culprit (common/flight_analysis.h has the format).
//
// The front end (collectives.cpp) is the one place every call of every backend passes through:
//
//   FlightRecord rec = record_call(g, FlightCall("all_reduce", "all_reduce").in(tensor));
//   rec.started();                       // the backend has the call
//   Work w(g.pg->allreduce(ts, opts), what);
//   attach_flight_record(w, rec);        // Work::wait marks it completed or failed (and dumps)
//
// Per group a ring of N entries under a small mutex: a call takes it three times, for a few
// stores each, and never while it waits, so a dump never waits for a hung collective. Sequence
// numbers count the group's collectives on each member alike (the ranks agree on them); send and
// recv count the messages between each pair (both ends agree), and the group's p2p calls.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "compat/c10d_compat.h"
#include "dtrain/process_group.h"

namespace dtrain::comm {

class FlightRing;

// What one call records, besides its group: names, tensors' sizes and dtypes, root and peer.
struct FlightCall {
  FlightCall(const char* dtrain_op, const char* trace_op) : op(dtrain_op), trace(trace_op) {}
  FlightCall& in(const at::Tensor& t);
  FlightCall& in(const std::vector<at::Tensor>& ts);
  FlightCall& out(const at::Tensor& t);
  FlightCall& out(const std::vector<at::Tensor>& ts);
  FlightCall& flat(int64_t numel, at::ScalarType dtype);  // one tensor of numel elements, in and out
  // `t` as the one input and the one output (an in-place call): record_call writes its size and dtype
  // into the ring's entry in place, which allocates nothing once the ring has wrapped, where in(t)
  // and out(t) allocate six vectors per call. `t` must outlive the record_call.
  FlightCall& in_out(const at::Tensor& t);
  const char* op;     // dtrain's name: "all_gather_into_tensor"
  const char* trace;  // PyTorch's profiling name: "_all_gather_base"
  std::vector<std::vector<int64_t>> in_sizes, out_sizes;
  std::vector<at::ScalarType> in_dtypes, out_dtypes;
  int root = -1;  // group rank of a rooted collective's root
  int peer = -1;  // group rank of send's destination or recv's source (-1: any source)
  bool is_send = false, is_recv = false;
  int tag = 0;
  const at::Tensor* in_place = nullptr;  // in_out's tensor until record_call
};

// One recorded call; empty when the recorder is off or the call is part of another.
class FlightRecord {
 public:
  FlightRecord() = default;
  FlightRecord(std::shared_ptr<FlightRing> ring, uint64_t id) : ring_(std::move(ring)), id_(id) {}
  // The backend has the call; `work` (null for composed calls) lets the watchdog see it complete
  // when nobody waits for it (Note [Unwaited calls]).
  void started(c10::intrusive_ptr<c10d::Work> work = {});
  void completed();
  // Marks it failed and dumps the record (reason: the failure's message).
  void failed(const std::string& why);
  explicit operator bool() const { return ring_ != nullptr; }

 private:
  std::shared_ptr<FlightRing> ring_;
  uint64_t id_ = 0;
};

// The group's ring (null when the recorder is off); made once per member group.
std::shared_ptr<FlightRing> make_flight_ring(const std::string& group_name, const std::string& backend,
                                             const std::vector<int>& ranks, int64_t timeout_ms);
FlightRecord record_call(const detail::GroupImpl& g, FlightCall call);
// Works of the call carry its record: wait() and is_completed() mark it.
void attach_flight_record(Work& w, FlightRecord rec);

// While alive, calls on this thread are parts of a composed call and are not recorded.
class FlightPartsScope {
 public:
  FlightPartsScope();
  ~FlightPartsScope();
  FlightPartsScope(const FlightPartsScope&) = delete;
  FlightPartsScope& operator=(const FlightPartsScope&) = delete;
};

// Writes this rank's record now; returns the file's path ("" if the recorder is off or writing failed,
// which is said on stderr). Prints one line naming the file.
std::string dump_flight_record(const std::string& reason);

// init_process_group: reads the knobs (a bad value throws), installs the SIGUSR1 handler (where the
// program has none) and starts the watchdog; destroy_process_group stops watching.
void start_flight_recorder(int rank, int world_size);
void stop_flight_recorder();

}  // namespace dtrain::comm
