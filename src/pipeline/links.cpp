// Pipeline links: one envelope message per boundary tensor between neighbouring stages (see links.h).
#include "pipeline/links.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cstring>
#include <functional>

namespace dtrain::pipeline {
namespace {

constexpr int64_t kHeaderWords = kHeaderBytes / 8;
static_assert(4 + kMaxDims <= kHeaderWords, "the header must fit its slot in the envelope");

uint8_t* envelope_bytes(const at::Tensor& envelope) { return static_cast<uint8_t*>(envelope.data_ptr()); }

ChannelLayout header_layout(const int64_t* h) {
  ChannelLayout l;
  l.dtype = static_cast<c10::ScalarType>(h[2]);
  l.shape.assign(h + 4, h + 4 + h[3]);
  return l;
}

}  // namespace

int64_t ChannelLayout::nbytes() const {
  int64_t n = static_cast<int64_t>(c10::elementSize(dtype));
  for (int64_t d : shape) n *= d;
  return n;
}

bool ChannelLayout::matches(const at::Tensor& t) const { return t.scalar_type() == dtype && t.sizes().equals(shape); }

Links::Links(Group group, int prev, int next, int tag_base, c10::Device device)
    : group_(std::move(group)), peer_{prev, next}, tag_base_(tag_base), device_(device) {}

at::Tensor Links::envelope(Peer to, int64_t status, int64_t id, const ChannelLayout& layout) {
  int64_t h[kHeaderWords] = {};
  h[0] = status;
  h[1] = id;
  h[2] = static_cast<int64_t>(layout.dtype);
  h[3] = static_cast<int64_t>(layout.shape.size());
  std::copy(layout.shape.begin(), layout.shape.end(), h + 4);
  at::Tensor env = at::empty({kHeaderBytes + out_[to].nbytes()}, at::TensorOptions(at::kByte).device(device_));
  if (device_.is_cpu())
    std::memcpy(envelope_bytes(env), h, kHeaderBytes);
  else
    env.narrow(0, 0, kHeaderBytes).copy_(at::from_blob(h, {kHeaderBytes}, at::kByte));
  return env;
}

void Links::post(Peer to, at::Tensor env) {
  sends_.push_back(isend(env, peer_[to], group_, tag_out(to)));
  in_flight_.push_back(std::move(env));
  ++messages_;
}

void Links::send(Peer to, const at::Tensor& t, int64_t id) {
  DTRAIN_ASSERT(has(to) && !fail_sent_[to], "send to a missing or ended link");
  DTRAIN_CHECK(t.dim() <= kMaxDims, "pipeline: a stage boundary tensor has ", t.dim(), " dimensions; at most ",
               kMaxDims, " are supported: flatten it before the boundary");
  if (!out_[to].matches(t)) {
    ChannelLayout next;
    next.dtype = t.scalar_type();
    next.shape = t.sizes().vec();
    post(to, envelope(to, kStatusLayout, id, next));  // the old agreed size: what the receiver expects
    out_[to] = std::move(next);
  }
  at::Tensor env = envelope(to, kStatusOk, id, out_[to]);
  if (t.numel() > 0)
    at::from_blob(envelope_bytes(env) + kHeaderBytes, t.sizes(), at::TensorOptions(t.scalar_type()).device(device_))
        .copy_(t.detach());
  post(to, std::move(env));
  ++tensors_;
}

std::pair<at::Tensor, at::Tensor> Links::next_envelope(Peer from) {
  for (;;) {
    at::Tensor env = at::empty({kHeaderBytes + in_[from].nbytes()}, at::TensorOptions(at::kByte).device(device_));
    dtrain::recv(env, peer_[from], group_, tag_in(from));
    at::Tensor header = env.narrow(0, 0, kHeaderBytes);
    if (!device_.is_cpu()) header = header.cpu();
    const int64_t* h = reinterpret_cast<const int64_t*>(header.data_ptr());
    DTRAIN_ASSERT(h[0] >= kStatusOk && h[0] <= kStatusLayout && h[3] >= 0 && h[3] <= kMaxDims,
                  "corrupt pipeline header from rank ", peer_[from]);
    if (h[0] != kStatusLayout) return {header, env};
    in_[from] = header_layout(h);
  }
}

at::Tensor Links::recv(Peer from, int64_t id) {
  DTRAIN_ASSERT(has(from) && !fail_read_[from], "recv from a missing or ended link");
  const std::pair<at::Tensor, at::Tensor> got = next_envelope(from);
  const at::Tensor& header = got.first;
  const at::Tensor env = got.second;  // captured by the view's deleter below
  const int64_t* h = reinterpret_cast<const int64_t*>(header.data_ptr());
  if (h[0] == kStatusFail) {
    fail_read_[from] = true;
    throw PeerFailed();
  }
  DTRAIN_ASSERT(h[1] == id, "pipeline message out of order: expected message ", id, " from rank ", peer_[from],
                ", got ", h[1]);
  const ChannelLayout& l = in_[from];
  const ChannelLayout sent = header_layout(h);
  DTRAIN_ASSERT(sent.dtype == l.dtype && sent.shape == l.shape, "pipeline message ", id, " from rank ", peer_[from],
                " does not have the channel's agreed layout");
  // A view of the envelope's payload that keeps the envelope alive.
  return at::from_blob(
      envelope_bytes(env) + kHeaderBytes, l.shape, [env](void*) {}, at::TensorOptions(l.dtype).device(device_));
}

void Links::send_fail() {
  for (Peer p : {kPrev, kNext}) {
    if (!has(p) || fail_sent_[p]) continue;
    post(p, envelope(p, kStatusFail, -1, out_[p]));
    fail_sent_[p] = true;
  }
}

void Links::drain() {
  for (Peer p : {kPrev, kNext}) {
    while (has(p) && !fail_read_[p]) {
      const at::Tensor header = next_envelope(p).first;
      if (reinterpret_cast<const int64_t*>(header.data_ptr())[0] == kStatusFail) fail_read_[p] = true;
    }
  }
}

void Links::finish_step() {
  // Wait for every send even if one fails, so none stays in flight with its tensor freed.
  std::exception_ptr first;
  for (auto& w : sends_) {
    try {
      w.wait();
    } catch (...) {
      if (!first) first = std::current_exception();
    }
  }
  sends_.clear();
  in_flight_.clear();
  fail_sent_[0] = fail_sent_[1] = false;
  fail_read_[0] = fail_read_[1] = false;
  messages_ = tensors_ = 0;
  if (first) std::rethrow_exception(first);
}

}  // namespace dtrain::pipeline
