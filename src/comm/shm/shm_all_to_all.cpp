// all_to_all_single in ShmProcessGroup: every rank's splits checked before anything moves, then on one
// host each byte moved once, straight from the sender's input into the receiver's output (Note
// [Single-copy all_to_all]); between hosts, or where the kernel refuses it, Gloo's exchange.
#include <sys/uio.h>
#include <unistd.h>

#include <ATen/ATen.h>

#include <cerrno>
#include <cstring>

#include "comm/shm/shm_pg_impl.h"
#include "common/env.h"
#include "dtrain/errors.h"

// Note [Single-copy all_to_all]
// A shared-memory collective copies each byte twice: into the segment, then out of it. An all_to_all
// has no arithmetic to do on the way, so on one host each rank writes what it sends every peer
// straight from its input tensor into the peer's output with process_vm_writev (cross-memory attach:
// the kernel copies between the two address spaces once), and copies its own part with memcpy.
// Writing is the faster direction: 8 MB took 0.86-0.90 ms against 0.98-1.0 ms read with
// process_vm_readv on the 2-core test machine, and 8 MB of memcpy 0.57 ms. Each rank starts with its own part and then
// goes round the ring from its right neighbour, so that n ranks do not all write into rank 0 at once. The call check
// (Note [Guarded Gloo collectives]) carries the splits and each rank's process id and output
// address in its one exchange, so the call costs two rounds over the segment: that exchange, and a
// final MIN of every rank's success, the barrier that keeps each rank from returning its output
// before every peer has written its part. Reading in pieces the size of a cache (64 KB to 2 MB) was no faster than one
// process_vm_readv of the whole part, so each part is one call. process_vm_writev needs ptrace permission over the
// peers (the same user, and no Yama scope or container policy that forbids it): the group's first all_to_all probes it
// (every rank writes a word into every peer, MIN over the segment), and when any rank cannot, the group keeps Gloo's
// exchange, the same choice on every rank (DTRAIN_SHM_SINGLE_COPY=0 makes every rank choose Gloo; the choice is an INFO
// line of DTRAIN_DEBUG). A write that fails after a successful probe fails the call on every rank (the group breaks:
// part of the data may have moved), naming the rank, the peer and errno.

namespace dtrain::comm {
namespace {

// The elements of one row (dim 0) of t: the unit of all_to_all's split sizes.
int64_t row_numel(const at::Tensor& t) {
  int64_t n = 1;
  for (int64_t d : t.dim() > 0 ? t.sizes().slice(1) : t.sizes()) n *= d;
  return n;
}

// Split sizes as c10d reads them: empty means equal parts of dim 0.
std::vector<int64_t> splits_or_equal(const std::vector<int64_t>& given, const at::Tensor& t, int n) {
  if (!given.empty()) return given;
  return std::vector<int64_t>(static_cast<size_t>(n), t.dim() > 0 ? t.size(0) / n : 0);
}

// Writes `bytes` at `local` into process `pid` at `remote`; false (errno set) when the kernel
// refuses.
bool a2a_cma_write(pid_t pid, const void* local, uint64_t remote, size_t bytes) {
  const char* src = static_cast<const char*>(local);
  while (bytes > 0) {
    iovec l{const_cast<char*>(src), bytes};
    iovec r{reinterpret_cast<void*>(remote), bytes};
    const ssize_t put = process_vm_writev(pid, &l, 1, &r, 1, 0);
    if (put < 0 && errno == EINTR) continue;
    if (put <= 0) {
      if (put == 0) errno = EFAULT;
      return false;
    }
    src += put;
    remote += static_cast<uint64_t>(put);
    bytes -= static_cast<size_t>(put);
  }
  return true;
}

// The word every peer writes into in the probe (each process's own: nothing reads it).
uint64_t a2a_probe_sink = 0;
const uint64_t kA2aProbe = 0x64747261696e5f31ull;

}  // namespace

// For all_to_all the guard of Note [Guarded Gloo collectives] goes further, since Gloo's transport
// aborts the process when rank i sends rank j more than j posted for it: every rank's splits travel
// in the call check's own exchange (agree()'s tail: a row's size and 2n counts, the same size
// everywhere), and each rank checks the whole matrix in the same order, so every rank finds the same
// first mismatch and refuses before anything is sent. Each rank's tail ends with its process id and
// output's address (Note [Single-copy all_to_all]).
std::vector<int64_t> ShmProcessGroup::a_to_a_tail(const at::Tensor& out, const at::Tensor& in,
                                                  const std::vector<int64_t>& os,
                                                  const std::vector<int64_t>& is) const {
  const int n = size_;
  const std::vector<int64_t> sends = splits_or_equal(is, in, n), gets = splits_or_equal(os, out, n);
  // The front end checked the lengths: a rank that threw here would leave the others in the exchange.
  DTRAIN_ASSERT(static_cast<int>(sends.size()) == n && static_cast<int>(gets.size()) == n,
                "all_to_all split sizes of the wrong length");
  std::vector<int64_t> tail{row_numel(in)};
  tail.insert(tail.end(), sends.begin(), sends.end());
  tail.insert(tail.end(), gets.begin(), gets.end());
  tail.push_back(getpid());
  tail.push_back(static_cast<int64_t>(reinterpret_cast<uintptr_t>(out.data_ptr())));
  return tail;
}

void ShmProcessGroup::agree_splits(const std::vector<at::Tensor>& tails) const {
  const int n = size_;
  auto cell = [&](int r, int k) { return tails[static_cast<size_t>(r)].data_ptr<int64_t>()[k]; };
  auto row = [&](int r, int from) {
    return at::IntArrayRef(tails[static_cast<size_t>(r)].data_ptr<int64_t>() + from, n);
  };
  for (int i = 0; i < n; ++i) {
    if (cell(i, 0) != cell(0, 0))
      throw CallMismatch(detail::cat("mismatched all_to_all: rank ", labels_.at(i), "'s rows hold ", cell(i, 0),
                                     " elements but rank ", labels_.at(0), "'s ", cell(0, 0),
                                     ": every rank must pass the same sizes past dim 0"));
    for (int j = 0; j < n; ++j) {
      if (cell(i, 1 + j) == cell(j, 1 + n + i)) continue;
      throw CallMismatch(detail::cat("mismatched all_to_all: rank ", labels_.at(i), " sends ", cell(i, 1 + j),
                                     " rows to rank ", labels_.at(j), ", which expects ", cell(j, 1 + n + i),
                                     " (input_split_sizes ", row(i, 1), " on rank ", labels_.at(i),
                                     ", output_split_sizes ", row(j, 1 + n), " on rank ", labels_.at(j),
                                     "): rank i's input_split_sizes[j] must equal rank j's output_split_sizes[i]"));
    }
  }
}

// On the worker, under exec_mu_ (so cma_ needs no lock of its own); collective over the segment.
bool ShmProcessGroup::single_copy_usable() {
  if (cma_ >= 0) return cma_ == 1;
  const int64_t mine[2] = {getpid(), static_cast<int64_t>(reinterpret_cast<uintptr_t>(&a2a_probe_sink))};
  std::vector<int64_t> all(2 * static_cast<size_t>(size_));
  std::vector<void*> outs;
  for (int r = 0; r < size_; ++r) outs.push_back(&all[2 * static_cast<size_t>(r)]);
  local_->all_gather(mine, sizeof mine, outs.data());
  double ok = env::flag("DTRAIN_SHM_SINGLE_COPY") ? 1 : 0;
  for (int r = 0; r < size_ && ok == 1; ++r)
    if (r != rank_ && !a2a_cma_write(static_cast<pid_t>(all[2 * r]), &kA2aProbe, static_cast<uint64_t>(all[2 * r + 1]),
                                     sizeof(kA2aProbe)))
      ok = 0;
  local_->all_reduce(&ok, 1, shm::DType::F64, shm::RedOp::MIN);
  cma_ = ok == 1 ? 1 : 0;
  if (rank_ == 0)
    info(cma_ ? detail::cat("[dtrain shm] all_to_all over ", size_, " ranks of group rank 0 = rank ", labels_.at(0),
                            ": each rank writes into its peers' outputs directly (one copy)")
              : detail::cat("[dtrain shm] all_to_all over ", size_, " ranks of group rank 0 = rank ", labels_.at(0),
                            ": through Gloo (",
                            env::flag("DTRAIN_SHM_SINGLE_COPY") ? "a rank may not write into its peers' memory"
                                                                : "DTRAIN_SHM_SINGLE_COPY=0",
                            ")"));
  return cma_ == 1;
}

// This rank's part for each peer written from its input into the peer's output, then the barrier
// (Note [Single-copy all_to_all]). `tails`: every rank's a_to_a_tail().
void ShmProcessGroup::all_to_all_single_copy(const at::Tensor& out, const at::Tensor& in,
                                             const std::vector<at::Tensor>& tails) {
  const int n = size_;
  auto cell = [&](int r, int k) { return tails[static_cast<size_t>(r)].data_ptr<int64_t>()[k]; };
  const int64_t row_bytes = cell(rank_, 0) * static_cast<int64_t>(in.element_size());
  std::string failure;
  for (int k = 0; k < n && failure.empty(); ++k) {
    const int j = (rank_ + k) % n;       // this rank first, then round the ring
    int64_t at_mine = 0, at_theirs = 0;  // my rows for j in my input; where they land in j's output
    for (int q = 0; q < j; ++q) at_mine += cell(rank_, 1 + q);
    for (int q = 0; q < rank_; ++q) at_theirs += cell(j, 1 + n + q);
    const char* src = static_cast<const char*>(in.data_ptr()) + at_mine * row_bytes;
    const size_t bytes = static_cast<size_t>(cell(rank_, 1 + j) * row_bytes);
    if (bytes == 0) continue;
    if (j == rank_) {
      std::memcpy(static_cast<char*>(out.data_ptr()) + at_theirs * row_bytes, src, bytes);
    } else if (!a2a_cma_write(static_cast<pid_t>(cell(j, 2 * n + 1)), src,
                              static_cast<uint64_t>(cell(j, 2 * n + 2) + at_theirs * row_bytes), bytes)) {
      failure =
          detail::cat("rank ", labels_.at(rank_), " could not write its ", bytes, " bytes of all_to_all into rank ",
                      labels_.at(j), "'s output with process_vm_writev: ", std::strerror(errno));
    }
  }
  double ok = failure.empty() ? 1 : 0;
  local_->all_reduce(&ok, 1, shm::DType::F64, shm::RedOp::MIN);  // the barrier: every output written
  if (!failure.empty()) throw std::runtime_error(failure);
  if (ok != 1) throw std::runtime_error("another rank could not write its part of this all_to_all into a peer");
}

// all_to_all: ranks legitimately send different amounts, so the call names only the operation and
// dtype (count -1); its tail carries the amounts themselves, which agree_splits() then checks.
c10::intrusive_ptr<c10d::Work> ShmProcessGroup::alltoall_base(at::Tensor& out, at::Tensor& in, std::vector<int64_t>& os,
                                                              std::vector<int64_t>& is,
                                                              const c10d::AllToAllOptions& o) {
  GlooCall c = call_of(kAllToAllSingle, {in});
  c.count = -1;
  const bool one_host = topo_.hosts == 1 && local_ && plain_cpu(in) && plain_cpu(out);
  return on_gloo({out}, c10d::OpType::ALLTOALL_BASE, c, a_to_a_tail(out, in, os, is), o.timeout,
                 [this, out, in, os, is, o, one_host,
                  gloo = gloo()](const std::vector<at::Tensor>& tails) mutable -> c10::intrusive_ptr<c10d::Work> {
                   agree_splits(tails);
                   if (!one_host || !single_copy_usable()) return gloo->alltoall_base(out, in, os, is, o);
                   all_to_all_single_copy(out, in, tails);
                   return c10::intrusive_ptr<c10d::Work>();  // moved here: nothing for Gloo
                 });
}

}  // namespace dtrain::comm
