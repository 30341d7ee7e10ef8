// Pipeline links: header + tensor messages between neighbouring stages (see links.h).
#include "pipeline/links.h"

#include <ATen/ATen.h>

namespace dtrain::pipeline {

Links::Links(Group group, int prev, int next, int tag_base, c10::Device device)
    : group_(std::move(group)), peer_{prev, next}, tag_base_(tag_base), device_(device) {}

void Links::post(Peer to, at::Tensor t) {
  sends_.push_back(isend(t, peer_[to], group_, tag_out(to)));
  in_flight_.push_back(std::move(t));
}

void Links::send(Peer to, const at::Tensor& t, int64_t id) {
  DTRAIN_ASSERT(has(to) && !fail_sent_[to], "send to a missing or ended link");
  DTRAIN_CHECK(t.dim() <= kMaxDims, "pipeline: a stage boundary tensor has ", t.dim(), " dimensions; at most ",
               kMaxDims, " are supported: flatten it before the boundary");
  std::vector<int64_t> h(kHeaderLen, 0);
  h[0] = kStatusOk;
  h[1] = static_cast<int64_t>(t.scalar_type());
  h[2] = t.dim();
  h[3] = id;
  for (int64_t d = 0; d < t.dim(); ++d) h[4 + d] = t.size(d);
  post(to, at::tensor(h, at::kLong).to(device_));
  post(to, t.detach().contiguous());
}

at::Tensor Links::recv_header(Peer from) {
  at::Tensor header = at::empty({kHeaderLen}, at::TensorOptions(at::kLong).device(device_));
  dtrain::recv(header, peer_[from], group_, tag_in(from));
  return header.cpu();
}

at::Tensor Links::recv(Peer from, int64_t id) {
  DTRAIN_ASSERT(has(from) && !fail_read_[from], "recv from a missing or ended link");
  at::Tensor header = recv_header(from);
  const int64_t* h = header.data_ptr<int64_t>();
  if (h[0] == kStatusFail) {
    fail_read_[from] = true;
    throw PeerFailed();
  }
  DTRAIN_ASSERT(h[0] == kStatusOk && h[2] >= 0 && h[2] <= kMaxDims, "corrupt pipeline header");
  DTRAIN_ASSERT(h[3] == id, "pipeline message out of order: expected message ", id, " from rank ", peer_[from],
                ", got ", h[3]);
  std::vector<int64_t> shape(h + 4, h + 4 + h[2]);
  at::Tensor t = at::empty(shape, at::TensorOptions(static_cast<at::ScalarType>(h[1])).device(device_));
  dtrain::recv(t, peer_[from], group_, tag_in(from));
  return t;
}

void Links::send_fail() {
  for (Peer p : {kPrev, kNext}) {
    if (!has(p) || fail_sent_[p]) continue;
    std::vector<int64_t> h(kHeaderLen, 0);
    h[0] = kStatusFail;
    post(p, at::tensor(h, at::kLong).to(device_));
    fail_sent_[p] = true;
  }
}

void Links::drain() {
  for (Peer p : {kPrev, kNext}) {
    while (has(p) && !fail_read_[p]) {
      at::Tensor header = recv_header(p);
      const int64_t* h = header.data_ptr<int64_t>();
      if (h[0] == kStatusFail) {
        fail_read_[p] = true;
        break;
      }
      std::vector<int64_t> shape(h + 4, h + 4 + h[2]);
      at::Tensor t = at::empty(shape, at::TensorOptions(static_cast<at::ScalarType>(h[1])).device(device_));
      dtrain::recv(t, peer_[p], group_, tag_in(p));
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
  if (first) std::rethrow_exception(first);
}

}  // namespace dtrain::pipeline
