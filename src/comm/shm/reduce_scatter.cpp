// Comm::reduce_scatter: the reduce-scatter half of all_reduce (comm.cpp), without the all-gather.
//
// `in` holds n parts of `count` elements; rank r's output is the reduction of every rank's part r.
// A step moves up to `part` elements of every part: rank k copies its parts j != k side by side
// into its slot (slot offset j * part), signals A; rank r waits for every A, then combines, in rank
// order 0..n-1, the ranks' part r (its own read from `in`, the others' from their slots) straight
// into its output, and signals B and C (its slot may be reused two steps on, as in every
// collective). Each rank thus writes (n-1)/n of its input into shared memory once and reads
// (n-1)/n parts of others' data once; the rank order makes the bits equal to all_reduce's.
#include <algorithm>
#include <cstring>

#include "comm/shm/comm.h"
#include "dtrain/errors.h"

namespace dtrain::shm {

void Comm::reduce_scatter(const void* in, void* out, size_t count, DType dtype, RedOp op) {
  check_usable();
  const size_t es = element_size(dtype);
  current_ = OpDesc{++op_id_, count, kReduceScatter, static_cast<uint8_t>(dtype), static_cast<uint8_t>(op), -1};
  // Parts start on 64-byte boundaries of the slot, as all_reduce's do, when the slot is that large.
  size_t part_bytes = seg_.slot_bytes() / static_cast<size_t>(n_);
  if (part_bytes >= 64) part_bytes = part_bytes / 64 * 64;
  const size_t part = part_bytes / es;
  DTRAIN_ASSERT(part > 0, "shared-memory slot of ", seg_.slot_bytes(), " bytes too small for ", n_, " ranks");
  const char* src = static_cast<const char*>(in);
  char* dst = static_cast<char*>(out);
  size_t done = 0;
  bool first = true;
  do {
    const size_t m = std::min(part, count - done);
    const uint32_t s = begin_step();
    const int buf = static_cast<int>(s % 2);
    char* my_slot = seg_.slot(rank_, buf);
    for (int j = 0; j < n_; ++j)
      if (j != rank_ && m > 0) std::memcpy(my_slot + j * part * es, src + (j * count + done) * es, m * es);
    if (first) publish(current_);
    signal(A, s);
    wait_all(A, s);
    if (first)
      for (int k = 0; k < n_; ++k)
        if (k != rank_) check_peer(k, current_);
    auto part_of = [&](int k) -> const void* {
      return k == rank_ ? static_cast<const void*>(src + (rank_ * count + done) * es)
                        : static_cast<const void*>(seg_.slot(k, buf) + rank_ * part * es);
    };
    char* acc = dst + done * es;
    if (m > 0) {
      if (n_ == 1) std::memcpy(acc, part_of(0), m * es);
      for (int k = 1; k < n_; ++k) combine(acc, k == 1 ? part_of(0) : acc, part_of(k), m, dtype, op);
    }
    signal(B, s);
    signal(C, s);
    done += m;
    first = false;
  } while (done < count);
}

}  // namespace dtrain::shm
