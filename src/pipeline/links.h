// The point-to-point links of one pipeline stage: activations to/from the neighbouring stages, each
// message a fixed-size header then the tensor (Note [pipeline failure] in dtrain/pipeline.h).
//
// Header (int64): [status, scalar type, ndim, id, dim 0, ..., dim kMaxDims-1]. status kOk is followed by
// the tensor; kFail ends the channel for this step (no tensor follows). id names the boundary and the
// micro-batch (the pipeline's message_id); the receiver checks it, so a schedule whose messages would
// cross fails loudly instead of computing with the wrong activation. Activations travel on tag
// tag_base + 0 (stage s -> s+1), gradients on tag_base + 1 (stage s+1 -> s); Gloo keeps the messages
// of one pair and tag in order, so the receiver reads them in the order the schedule sent them. With
// virtual stages the links form a ring (the last rank's next is rank 0); with 2 ranks prev and next are
// the same rank, and the two directions still use different tags.
// Sends are asynchronous (Gloo's send completes only once the receiver posts its receive, so a
// blocking send could deadlock two stages sending to each other); they are waited for at step end.
#pragma once

#include <exception>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include "dtrain/process_group.h"

namespace dtrain::pipeline {

constexpr int kMaxDims = 8;
constexpr int64_t kHeaderLen = 4 + kMaxDims;
constexpr int64_t kStatusOk = 1;
constexpr int64_t kStatusFail = 2;

// Thrown by Links::recv when the neighbour sent FAIL instead of data (caught inside the pipeline).
struct PeerFailed : std::exception {
  const char* what() const noexcept override { return "a neighbouring pipeline stage failed"; }
};

class Links {
 public:
  enum Peer { kPrev = 0, kNext = 1 };

  // prev/next: global ranks of the neighbouring stages, -1 where there is none.
  Links(Group group, int prev, int next, int tag_base, c10::Device device);

  // Activations go to kNext, gradients to kPrev.
  void send(Peer to, const at::Tensor& t, int64_t id);
  // Activations come from kPrev, gradients from kNext. Throws PeerFailed on a FAIL header; the message
  // must carry `id`.
  at::Tensor recv(Peer from, int64_t id);

  // Failure path: FAIL on every outgoing channel not yet ended this step (asynchronous).
  void send_fail();
  // Failure path: reads each incoming channel up to its FAIL header, discarding the data.
  void drain();
  // Waits for every send of this step; then a new step may start.
  void finish_step();

  bool has(Peer p) const { return peer_[p] >= 0; }
  int peer_rank(Peer p) const { return peer_[p]; }

 private:
  int tag_out(Peer to) const { return tag_base_ + (to == kNext ? 0 : 1); }
  int tag_in(Peer from) const { return tag_base_ + (from == kPrev ? 0 : 1); }
  void post(Peer to, at::Tensor t);
  at::Tensor recv_header(Peer from);

  Group group_;
  int peer_[2];
  int tag_base_;
  c10::Device device_;
  std::vector<Work> sends_;
  std::vector<at::Tensor> in_flight_;  // kept alive until their sends complete
  bool fail_sent_[2] = {false, false};
  bool fail_read_[2] = {false, false};
};

}  // namespace dtrain::pipeline
