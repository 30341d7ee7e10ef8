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
// has no arithmetic to do on the way, so on one host each rank reads what every peer sends it
// straight from the peer's input tensor into its own output with process_vm_readv (cross-memory
// attach: the kernel copies between the two address spaces once), and copies its own part with
// memcpy. The splits' exchange that checks the call (agree_splits) also carries each rank's process
// id and input address, so the exchange costs no extra round. A final MIN over the segment of every
// rank's success is the barrier that keeps each input alive and unchanged until every peer has read
// it. process_vm_readv needs ptrace permission over the peers (the same user, and no Yama scope or
// container policy that forbids it): the group's first all_to_all probes it (every rank reads a word
// of every peer, MIN over the segment), and when any rank cannot, the group keeps Gloo's exchange,
// the same choice on every rank (DTRAIN_SHM_SINGLE_COPY=0 makes every rank choose Gloo; the choice is
// an INFO line of DTRAIN_DEBUG). A read that fails after a successful probe fails the call on every
// rank (the group breaks: part of the data may have moved), naming the rank, the peer and errno.

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

// Reads `bytes` at `remote` in process `pid` into `local`; false (errno set) when the kernel refuses.
bool a2a_cma_read(pid_t pid, void* local, uint64_t remote, size_t bytes) {
  char* dst = static_cast<char*>(local);
  while (bytes > 0) {
    iovec l{dst, bytes};
    iovec r{reinterpret_cast<void*>(remote), bytes};
    const ssize_t got = process_vm_readv(pid, &l, 1, &r, 1, 0);
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) {
      if (got == 0) errno = EFAULT;
      return false;
    }
    dst += got;
    remote += static_cast<uint64_t>(got);
    bytes -= static_cast<size_t>(got);
  }
  return true;
}

// A word every peer reads in the probe: its address differs per process, its value does not.
const uint64_t kA2aProbe = 0x64747261696e5f31ull;

}  // namespace

// For all_to_all the guard of Note [Guarded Gloo collectives] goes further, since Gloo's transport
// aborts the process when rank i sends rank j more than j posted for it: every rank's splits are
// exchanged (a row's size and 2n counts, the same size everywhere) and each rank checks the whole
// matrix in the same order, so every rank finds the same first mismatch and refuses before
// anything is sent. Each rank's entry ends with its process id and input's address (Note
// [Single-copy all_to_all]).
std::vector<at::Tensor> ShmProcessGroup::agree_splits(compat::Backend& pg, const at::Tensor& out, const at::Tensor& in,
                                                      const std::vector<int64_t>& os, const std::vector<int64_t>& is,
                                                      std::chrono::milliseconds timeout) {
  const int n = pg.getSize();
  const std::vector<int64_t> sends = splits_or_equal(is, in, n), gets = splits_or_equal(os, out, n);
  // The front end checked the lengths: a rank that threw here would leave the others in the exchange.
  DTRAIN_ASSERT(static_cast<int>(sends.size()) == n && static_cast<int>(gets.size()) == n,
                "all_to_all split sizes of the wrong length");
  at::Tensor mine = at::empty({2 * n + 3}, at::kLong);
  auto* p = mine.data_ptr<int64_t>();
  p[0] = row_numel(in);
  std::copy(sends.begin(), sends.end(), p + 1);
  std::copy(gets.begin(), gets.end(), p + 1 + n);
  p[2 * n + 1] = getpid();
  p[2 * n + 2] = static_cast<int64_t>(reinterpret_cast<uintptr_t>(in.data_ptr()));
  std::vector<at::Tensor> all = exchange(pg, mine, timeout);
  auto cell = [&](int r, int k) { return all[static_cast<size_t>(r)].data_ptr<int64_t>()[k]; };
  auto row = [&](int r, int from) {
    return at::IntArrayRef(all[static_cast<size_t>(r)].data_ptr<int64_t>() + from, n);
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
  return all;
}

// On the worker, under exec_mu_ (so cma_ needs no lock of its own); collective over the segment.
bool ShmProcessGroup::single_copy_usable() {
  if (cma_ >= 0) return cma_ == 1;
  const int64_t mine[2] = {getpid(), static_cast<int64_t>(reinterpret_cast<uintptr_t>(&kA2aProbe))};
  std::vector<int64_t> all(2 * static_cast<size_t>(size_));
  std::vector<void*> outs;
  for (int r = 0; r < size_; ++r) outs.push_back(&all[2 * static_cast<size_t>(r)]);
  local_->all_gather(mine, sizeof mine, outs.data());
  double ok = env::flag("DTRAIN_SHM_SINGLE_COPY") ? 1 : 0;
  for (int r = 0; r < size_ && ok == 1; ++r) {
    uint64_t word = 0;
    if (r != rank_ &&
        (!a2a_cma_read(static_cast<pid_t>(all[2 * r]), &word, static_cast<uint64_t>(all[2 * r + 1]), sizeof word) ||
         word != kA2aProbe))
      ok = 0;
  }
  local_->all_reduce(&ok, 1, shm::DType::F64, shm::RedOp::MIN);
  cma_ = ok == 1 ? 1 : 0;
  if (rank_ == 0)
    info(cma_ ? detail::cat("[dtrain shm] all_to_all over ", size_, " ranks of group rank 0 = rank ", labels_.at(0),
                            ": each rank reads its peers' inputs directly (one copy)")
              : detail::cat("[dtrain shm] all_to_all over ", size_, " ranks of group rank 0 = rank ", labels_.at(0),
                            ": through Gloo (",
                            env::flag("DTRAIN_SHM_SINGLE_COPY") ? "a rank may not read its peers' memory"
                                                                : "DTRAIN_SHM_SINGLE_COPY=0",
                            ")"));
  return cma_ == 1;
}

// Each peer's part read from its input into this rank's output, then the barrier (Note
// [Single-copy all_to_all]). `all`: agree_splits' table.
void ShmProcessGroup::all_to_all_single_copy(const at::Tensor& out, const at::Tensor& in,
                                             const std::vector<at::Tensor>& all) {
  const int n = size_;
  auto cell = [&](int r, int k) { return all[static_cast<size_t>(r)].data_ptr<int64_t>()[k]; };
  const int64_t row_bytes = cell(rank_, 0) * static_cast<int64_t>(in.element_size());
  char* dst = static_cast<char*>(out.data_ptr());
  std::string failure;
  for (int j = 0; j < n; ++j) {
    int64_t at_sender = 0;  // where rank j's rows for this rank start in j's input
    for (int k = 0; k < rank_; ++k) at_sender += cell(j, 1 + k);
    const size_t bytes = static_cast<size_t>(cell(j, 1 + rank_) * row_bytes);
    if (bytes > 0 && j == rank_) {
      std::memcpy(dst, static_cast<const char*>(in.data_ptr()) + at_sender * row_bytes, bytes);
    } else if (bytes > 0 && failure.empty() &&
               !a2a_cma_read(static_cast<pid_t>(cell(j, 2 * n + 1)), dst,
                             static_cast<uint64_t>(cell(j, 2 * n + 2) + at_sender * row_bytes), bytes)) {
      failure = detail::cat("rank ", labels_.at(rank_), " could not read rank ", labels_.at(j), "'s ", bytes,
                            " bytes of all_to_all with process_vm_readv: ", std::strerror(errno));
    }
    dst += bytes;
  }
  double ok = failure.empty() ? 1 : 0;
  local_->all_reduce(&ok, 1, shm::DType::F64, shm::RedOp::MIN);  // the barrier: every input read
  if (!failure.empty()) throw std::runtime_error(failure);
  if (ok != 1) throw std::runtime_error("another rank could not read its part of this all_to_all from a peer");
}

// all_to_all: ranks legitimately send different amounts, so the call names only the operation and
// dtype (count -1); agree_splits() then checks the amounts themselves.
c10::intrusive_ptr<c10d::Work> ShmProcessGroup::alltoall_base(at::Tensor& out, at::Tensor& in, std::vector<int64_t>& os,
                                                              std::vector<int64_t>& is,
                                                              const c10d::AllToAllOptions& o) {
  GlooCall c = call_of(kAllToAll, {in});
  c.count = -1;
  const bool one_host = topo_.hosts == 1 && local_ && plain_cpu(in) && plain_cpu(out);
  return on_gloo({out}, c10d::OpType::ALLTOALL_BASE, c, o.timeout,
                 [this, out, in, os, is, o, one_host, gloo = gloo()]() mutable -> c10::intrusive_ptr<c10d::Work> {
                   const std::vector<at::Tensor> all = agree_splits(*gloo, out, in, os, is, o.timeout);
                   if (!one_host || !single_copy_usable()) return gloo->alltoall_base(out, in, os, is, o);
                   all_to_all_single_copy(out, in, all);
                   return c10::intrusive_ptr<c10d::Work>();  // moved here: nothing for Gloo
                 });
}

}  // namespace dtrain::comm
