// The point-to-point links of one pipeline stage: activations to/from the neighbouring stages (Note
// [pipeline failure] in pipeline.cpp, Note [boundary envelopes] below).
//
// Activations travel on tag tag_base + 0 (stage s -> s+1), gradients on tag_base + 1 (stage s+1 -> s);
// Gloo and the shared-memory point-to-point keep the messages of one pair and tag in order, so the
// receiver reads them in the order the schedule sent them. With virtual stages the links form a ring
// (the last rank's next is rank 0); with 2 ranks prev and next are the same rank, and the two
// directions still use different tags.
// Sends are asynchronous (Gloo's send completes only once the receiver posts its receive, so a
// blocking send could deadlock two stages sending to each other); they are waited for at step end.
//
// Note [boundary envelopes]
// Each boundary tensor is one message, an envelope: a fixed header (int64: [status, id, scalar type,
// ndim, dim 0, ..., dim kMaxDims-1], padded to kHeaderBytes) followed by the tensor's bytes. A receive
// must know the size of what it receives, so each channel (direction) has an agreed layout, the dtype
// and shape of its data, which sender and receiver track alike (both start with none, 0 bytes):
//   kOk      the tensor, of the agreed layout; the receiver checks the header's layout and id (the
//            pipeline's message_id: boundary and micro-batch), so messages that would cross, or sides
//            that disagree, fail loudly instead of computing with the wrong activation.
//   kLayout  sent, with the old agreed size, before a tensor whose dtype or shape differs from the
//            agreed one (the first message of the run, a smaller last micro-batch, a new batch size);
//            its header holds the new layout, which both sides adopt. So the steady state is one
//            message per tensor; a change of shape costs one more.
//   kFail    ends the channel for this step; it has the agreed size too, so a receiver waiting for
//            data is released by it.
// The layouts outlive the step (a failed one included: drain reads the channels to their FAIL in the
// order sent, applying kLayout). The cost is one copy of each sent tensor into its envelope; the
// received tensor is a view of the envelope's bytes.
#pragma once

#include <exception>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

#include "dtrain/process_group.h"

namespace dtrain::pipeline {

constexpr int kMaxDims = 8;
constexpr int64_t kHeaderBytes = 128;  // keeps the payload aligned for every dtype
constexpr int64_t kStatusOk = 1;
constexpr int64_t kStatusFail = 2;
constexpr int64_t kStatusLayout = 3;

// Thrown by Links::recv when the neighbour sent FAIL instead of data (caught inside the pipeline).
struct PeerFailed : std::exception {
  const char* what() const noexcept override { return "a neighbouring pipeline stage failed"; }
};

// One channel's agreed dtype and shape (Note [boundary envelopes]).
struct ChannelLayout {
  c10::ScalarType dtype = c10::ScalarType::Byte;
  std::vector<int64_t> shape = {0};
  int64_t nbytes() const;
  bool matches(const at::Tensor& t) const;
};

class Links {
 public:
  enum Peer { kPrev = 0, kNext = 1 };

  // prev/next: global ranks of the neighbouring stages, -1 where there is none.
  Links(Group group, int prev, int next, int tag_base, c10::Device device);

  // Activations go to kNext, gradients to kPrev.
  void send(Peer to, const at::Tensor& t, int64_t id);
  // Activations come from kPrev, gradients from kNext. Throws PeerFailed on FAIL; the message must
  // carry `id`.
  at::Tensor recv(Peer from, int64_t id);

  // Failure path: FAIL on every outgoing channel not yet ended this step (asynchronous).
  void send_fail();
  // Failure path: reads each incoming channel up to its FAIL, discarding the data.
  void drain();
  // Waits for every send of this step; then a new step may start.
  void finish_step();

  bool has(Peer p) const { return peer_[p] >= 0; }
  int peer_rank(Peer p) const { return peer_[p]; }
  // Messages sent since the last finish_step, and of them the tensors (the rest is kLayout / kFail).
  int64_t messages_sent() const { return messages_; }
  int64_t tensors_sent() const { return tensors_; }

 private:
  int tag_out(Peer to) const { return tag_base_ + (to == kNext ? 0 : 1); }
  int tag_in(Peer from) const { return tag_base_ + (from == kPrev ? 0 : 1); }
  // An envelope of the channel's agreed size with the header filled in from `status`, `id`, `layout`.
  at::Tensor envelope(Peer to, int64_t status, int64_t id, const ChannelLayout& layout);
  void post(Peer to, at::Tensor envelope);
  // The next envelope from `from`, kLayout applied; returns its header (on the CPU) and the envelope.
  std::pair<at::Tensor, at::Tensor> next_envelope(Peer from);

  Group group_;
  int peer_[2];
  int tag_base_;
  c10::Device device_;
  ChannelLayout out_[2];  // per peer: the agreed layout of the channel to it
  ChannelLayout in_[2];   // ... and from it
  std::vector<Work> sends_;
  std::vector<at::Tensor> in_flight_;  // kept alive until their sends complete
  bool fail_sent_[2] = {false, false};
  bool fail_read_[2] = {false, false};
  int64_t messages_ = 0;
  int64_t tensors_ = 0;
};

}  // namespace dtrain::pipeline
