// Process groups and collectives: torch.distributed for C++, thin over c10d (Gloo on CPU, NCCL on CUDA).
//
//   dtrain::init_process_group();                       // env:// from dtrain-run, torchrun, mpirun, srun
//   at::Tensor t = torch::ones({4}) * dtrain::rank();
//   dtrain::all_reduce(t);                              // SUM over the default group
//   auto sub = dtrain::new_group({0, 1});               // every rank calls new_group, in the same order
//   dtrain::Work w = dtrain::all_reduce(t, dtrain::ReduceOp::AVG, sub, /*async_op=*/true);
//   w.wait();
//   dtrain::destroy_process_group();
//
// Semantics follow torch.distributed: ranks given to collectives (src, dst) are GLOBAL ranks;
// a Group() default-constructed means the default (world) group; every member of a group must call
// the same collectives in the same order. Failures throw dtrain::Error naming the rank and the
// operation. ReduceOp::AVG works on Gloo too (sum, then divide; floating-point tensors only), and
// reduce_scatter, which Gloo 1.13 lacks, is composed from all_reduce.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/util/intrusive_ptr.h>

#include "dtrain/detail/arg.h"
#include "dtrain/errors.h"

namespace c10d {
class Store;
class Work;
}  // namespace c10d

namespace dtrain {
namespace detail {
struct GroupImpl;    // a group's backend, ranks and counters (the library's own)
struct GroupAccess;  // the library's way to build a Group and to reach its GroupImpl
struct WorkAccess;   // the library's way to attach a call's flight record to its Work
}  // namespace detail

// PyTorch's default process-group timeout: 30 minutes.
constexpr std::chrono::milliseconds kDefaultTimeout = std::chrono::minutes(30);

enum class ReduceOp { SUM, AVG, MIN, MAX, PRODUCT };
std::string to_string(ReduceOp op);

// Options of init_process_group, builder style:
//   dtrain::init_process_group(dtrain::InitOptions().backend("gloo").init_method("tcp://10.0.0.1:29500")
//                                  .rank(0).world_size(2).timeout(std::chrono::seconds(60)));
struct InitOptions {
  // "gloo" (CPU tensors) or "nccl" (CUDA builds only). Empty: "gloo", or $DTRAIN_BACKEND if set.
  DTRAIN_ARG(std::string, backend, "")
  // "env://" (MASTER_ADDR, MASTER_PORT), "tcp://host:port" or "file:///path".
  DTRAIN_ARG(std::string, init_method, "env://")
  // -1: from the environment (RANK / OMPI_COMM_WORLD_RANK / SLURM_PROCID).
  DTRAIN_ARG(int, rank, -1)
  // -1: from the environment (WORLD_SIZE / OMPI_COMM_WORLD_SIZE / SLURM_NTASKS).
  DTRAIN_ARG(int, world_size, -1)
  // Rendezvous and collective timeout (default 30 min, as PyTorch; $DTRAIN_TIMEOUT_S overrides the
  // default when this option is not set).
  DTRAIN_ARG(std::optional<std::chrono::milliseconds>, timeout, std::nullopt)
  // Some ranks of the job are Python programs (torch.distributed with "gloo" and env://, PyTorch 2.x,
  // the LibTorch dtrain was built against): join their default group as Python's init_process_group
  // does (PyTorch's TCPStore and key prefixes, Gloo only, no shared memory, no subgroups).
  // $DTRAIN_PYTORCH_PEERS=1 turns it on as well.
  DTRAIN_ARG(bool, pytorch_peers, false)
};

// A handle to an asynchronous operation. wait() blocks until it is done (rethrowing its failure with
// the rank and operation named); the result tensors are valid after wait(), or once is_completed()
// has returned true (it finishes the operation's last local step, e.g. AVG's division, without
// blocking; a failure is rethrown by wait()). Waiting twice is fine.
class Work {
 public:
  Work() = default;
  // work: the backend's handle, or null for an operation composed of others, whose `parts_done`
  // says whether they have finished; on_done: the last local step, run once.
  Work(c10::intrusive_ptr<c10d::Work> work, std::string what, std::function<void()> on_done = {},
       std::function<bool()> parts_done = {});
  void wait();
  bool is_completed();
  // Runs fn once the operation has finished (on the backend's thread, as soon as it completes; for
  // operations without a completion future, when wait() returns). fn must be cheap and must not
  // throw: it is for timing and bookkeeping (DDP's per-bucket communication times), not for work.
  void then(std::function<void()> fn);

 private:
  friend struct detail::WorkAccess;
  struct State;
  std::shared_ptr<State> state_;
};

// A process group: the world, or a subgroup from new_group(). Cheap to copy (shared handle).
class Group {
 public:
  Group() = default;  // the default group
  bool is_default() const { return impl_ == nullptr; }
  // Whether the calling process belongs to this group.
  bool is_member() const;
  int rank() const;  // rank inside the group (-1 for non-members)
  int size() const;
  const std::vector<int>& ranks() const;  // global ranks of the members, sorted
  std::string backend() const;
  // Whether this rank's collectives in the group run over shared memory with the other ranks of
  // its host (backend "gloo", DTRAIN_SHM unset or 1, at least two of the group's ranks on the host).
  bool uses_shared_memory() const;
  int group_rank(int global_rank) const;  // throws if not a member
  // The group's name, the same on every rank: "default" for the world, "group<N>" for the job's N-th
  // new_group, "<parent>.split<I>.c<color>" for split_group's (I: the parent's object index).
  const std::string& name() const;
  // The number of the object the members are constructing together on this group (0, 1, ...; see
  // Note [Group-agreed ids]). Each member calls it once per such object; throws for non-members.
  int64_t next_object_index() const;

 private:
  friend struct detail::GroupAccess;
  explicit Group(std::shared_ptr<detail::GroupImpl> impl) : impl_(std::move(impl)) {}
  std::shared_ptr<detail::GroupImpl> impl_;  // null: the default group
};

// Note [Group-agreed ids]: an object that a group's members construct together (a
// DistributedDataParallel, a Pipeline) and that names things its peers must name alike (message
// tags, store keys) takes its number from the group, never from a count kept per process. Ranks
// outside a subgroup build nothing on it, so a per-process count would already differ between them
// and the subgroup's members when the next object on the world is built: neighbours would wait on
// different tags and ranks would read store keys nobody writes. Construction is collective, like
// the group's collectives (every member, in the same order), so next_object_index() returns the same
// number on every member; with the group's name, which every rank agrees on, it names the object
// across the job (store keys "<kind>/<group name>/<index>/..."). Message tags need only the index:
// each group has its own transport.

// --- lifetime -------------------------------------------------------------------------------------
void init_process_group(const InitOptions& options = InitOptions());
bool is_initialized();
void destroy_process_group();

int rank();
int world_size();
int local_rank();
int local_world_size();
// How many times the launcher has restarted the job: DTRAIN_RESTART_COUNT from dtrain-run, else
// TORCHELASTIC_RESTART_COUNT from torchrun, else 0.
int restart_count();
std::string backend();
// The device whose tensors a group's collectives take: the CPU for "gloo"; for "nccl" the calling
// thread's current CUDA device, which each rank sets to its own GPU first (PyTorch's recipe,
// torch.cuda.set_device(local_rank); here set_cuda_device(local_rank())).
at::Device collective_device(const Group& group = Group());
// Makes cuda:index the calling thread's current CUDA device (torch.cuda.set_device). Throws when
// this LibTorch or machine has no CUDA device, or index is not one of the visible devices.
void set_cuda_device(int index);
// The store every rank of this job shares (for small out-of-band exchanges).
c10::intrusive_ptr<c10d::Store> default_store();

// A subgroup of the given global ranks (sorted, unique, each < world_size). Every rank of the world
// must call new_group with the same ranks in the same order, members or not. An empty list = world.
Group new_group(std::vector<int> ranks, std::optional<std::chrono::milliseconds> timeout = std::nullopt);
// Splits `parent` as MPI_Comm_split and c10d's ProcessGroup::split do: the members that pass the same
// color form one new group; a negative color joins none (the result has is_member() false). Every
// member of `parent` calls it, in the same order as the parent's collectives; ranks outside `parent`
// do not. A group numbers its ranks by global rank, so `key` may only confirm that order: keys that
// order a color's members otherwise are refused (pass the parent rank, or any increasing value).
//   auto row = dtrain::split_group(/*color=*/dtrain::rank() / 2, /*key=*/dtrain::rank());  // {0,1} {2,3}
Group split_group(int color, int key, const Group& parent = Group(),
                  std::optional<std::chrono::milliseconds> timeout = std::nullopt);

// --- debug level (PyTorch's TORCH_DISTRIBUTED_DEBUG as DTRAIN_DEBUG) ---------------------------------
//   OFF     nothing extra.
//   INFO    DistributedDataParallel logs its setup and buckets (sizes, parameter names) on rank 0.
//   DETAIL  INFO, and before every collective all ranks of the group check that they call the same
//           operation with the same shapes, dtypes, reduce op and root (through the job store); a
//           mismatch throws dtrain::Error on every rank, naming the ranks and both calls, instead of
//           hanging or corrupting tensors. Costs a few store round trips per collective.
// The level is read from $DTRAIN_DEBUG the first time it is needed (init_process_group rejects a bad
// value); set_debug_level overrides it for this process.
enum class DebugLevel { OFF = 0, INFO = 1, DETAIL = 2 };
DebugLevel get_debug_level();
void set_debug_level(DebugLevel level);
// Re-reads $DTRAIN_DEBUG (unset or empty: OFF); throws dtrain::Error naming a bad value.
void set_debug_level_from_env();
std::string to_string(DebugLevel level);

// --- flight recorder (PyTorch's NCCL flight recorder, for every backend) ------------------------------
// Every rank keeps its last $DTRAIN_FLIGHT_ENTRIES (2000) calls per group and writes them to
// $DTRAIN_FLIGHT_DIR/dtrain_trace_rank_<rank> when a call fails or times out, when nothing moved for
// $DTRAIN_FLIGHT_STALL_S while a call waits, on SIGUSR1 and when dtrain-run asks; `dtrain-run --analyze
// DIR` and PyTorch's `python -m torch.distributed.flight_recorder.fr_trace DIR` read the files.
//   std::string path = dtrain::dump_flight_record("before checkpoint");  // "" when it is off
// dump_flight_record writes this rank's record now and returns its path; set_flight_recorder_enabled
// pauses and resumes recording (for measuring its cost; calls made while paused are not in the record).
std::string dump_flight_record(const std::string& reason = "requested");
void set_flight_recorder_enabled(bool on);

// --- collectives (src/dst are global ranks) ------------------------------------------------------
Work all_reduce(at::Tensor& tensor, ReduceOp op = ReduceOp::SUM, const Group& group = Group(), bool async_op = false);
Work broadcast(at::Tensor& tensor, int src, const Group& group = Group(), bool async_op = false);
// DistributedDataParallel's average as one blocking collective: every rank divides its `tensors` (one
// floating-point dtype, one device) by `divisor`, and the group sums them as if they were one flat
// tensor, in rank order; the results are written back into `tensors`. Over shared memory the
// collective reads and writes the tensors themselves (float32, float64, contiguous CPU tensors);
// otherwise they go through one flat tensor (`scratch` when it is contiguous, large enough and of
// their dtype and device, else a new one): divided into it, all_reduce(SUM) of it, copied back. The
// bits are the same either way, and the ranks of one call may take different ways.
void all_reduce_divided(std::vector<at::Tensor>& tensors, int64_t divisor, const Group& group = Group(),
                        const at::Tensor& scratch = at::Tensor());
Work reduce(at::Tensor& tensor, int dst, ReduceOp op = ReduceOp::SUM, const Group& group = Group(),
            bool async_op = false);
// outputs: group.size() tensors shaped like input.
Work all_gather(std::vector<at::Tensor>& outputs, const at::Tensor& input, const Group& group = Group(),
                bool async_op = false);
// inputs: group.size() tensors shaped like output; output gets the reduction of everyone's inputs[rank].
Work reduce_scatter(at::Tensor& output, std::vector<at::Tensor>& inputs, ReduceOp op = ReduceOp::SUM,
                    const Group& group = Group(), bool async_op = false);
// torch.distributed's all_gather_into_tensor: `output` receives every member's `input` in group-rank
// order, concatenated along dim 0 ([n * d0, d1, ...]) or stacked ([n, d0, d1, ...]); one dtype and
// device, contiguous. `input` may be this rank's slice of `output` (the in-place form).
Work all_gather_into_tensor(at::Tensor& output, const at::Tensor& input, const Group& group = Group(),
                            bool async_op = false);
// torch.distributed's reduce_scatter_tensor: `input` is group.size() parts shaped like `output`,
// concatenated or stacked along dim 0; group rank r's `output` gets the reduction of every member's
// part r. Over shared memory each rank reduces only its own part, in rank order (the same bits on
// every rank and as all_reduce); on Gloo 1.13, which lacks it, it is an all_reduce of a copy of
// `input` followed by a copy of this rank's part (n times the traffic).
Work reduce_scatter_tensor(at::Tensor& output, const at::Tensor& input, ReduceOp op = ReduceOp::SUM,
                           const Group& group = Group(), bool async_op = false);
// gather_list: group.size() tensors on dst, empty elsewhere.
Work gather(const at::Tensor& input, std::vector<at::Tensor>& gather_list, int dst = 0, const Group& group = Group(),
            bool async_op = false);
// scatter_list: group.size() tensors on src, empty elsewhere.
Work scatter(at::Tensor& output, std::vector<at::Tensor>& scatter_list, int src = 0, const Group& group = Group(),
             bool async_op = false);
// torch.distributed's all_to_all_single: group rank j gets input_split_sizes[j] rows (along dim 0)
// of `input`, in order, and `output` receives output_split_sizes[i] rows from each group rank i,
// concatenated in group-rank order. Empty split sizes mean equal parts (dim 0 divisible by the
// group size). Every member's input_split_sizes[j] must equal member j's output_split_sizes[i];
// input and output have one dtype and device and the same sizes past dim 0. Over Gloo (and a
// shared-memory group, which hands it to Gloo) the members first agree on the whole split matrix,
// so a mismatch fails on every rank, naming both sides, before anything is sent.
//   dtrain::all_to_all_single(out, in, /*output_split_sizes=*/{1, 3}, /*input_split_sizes=*/{2, 0});
Work all_to_all_single(at::Tensor& output, const at::Tensor& input, std::vector<int64_t> output_split_sizes = {},
                       std::vector<int64_t> input_split_sizes = {}, const Group& group = Group(),
                       bool async_op = false);
// torch.distributed's all_to_all: input_tensor_list[j] goes to group rank j, and
// output_tensor_list[i] receives group rank i's input_tensor_list[me] (which must have as many
// elements). One tensor per rank in each list, of one dtype and device, any shapes. It runs as one
// all_to_all_single of the lists' tensors flattened into one buffer each (Gloo 1.13 has no list form).
Work all_to_all(std::vector<at::Tensor>& output_tensor_list, const std::vector<at::Tensor>& input_tensor_list,
                const Group& group = Group(), bool async_op = false);
Work barrier(const Group& group = Group(), bool async_op = false);
// Like barrier, but on timeout throws naming the ranks that did not arrive. Gloo only (as PyTorch).
void monitored_barrier(const Group& group = Group(), std::optional<std::chrono::milliseconds> timeout = std::nullopt,
                       bool wait_all_ranks = false);

// --- small control messages (flags, counts, hashes, short texts) ---------------------------------
// Plain C++ values in and out, as torch.distributed's all_gather_object and broadcast_object_list:
// each call moves them to collective_device(group) (the CPU under Gloo, CUDA under NCCL, which takes
// no CPU tensor), runs the collective and copies the result back. Blocking; every member calls it.
// For bulk data use the tensor collectives above.
//   bool all_ok = dtrain::all_reduce_values(std::vector<int64_t>{ok ? 1 : 0}, dtrain::ReduceOp::MIN)[0] == 1;
// Element-wise reduction of every member's vector (each member passes the same length).
std::vector<int64_t> all_reduce_values(const std::vector<int64_t>& mine, ReduceOp op = ReduceOp::SUM,
                                       const Group& group = Group());
std::vector<double> all_reduce_values(const std::vector<double>& mine, ReduceOp op = ReduceOp::SUM,
                                      const Group& group = Group());
// Every member's vector, in group-rank order (each member passes the same length).
std::vector<std::vector<int64_t>> all_gather_values(const std::vector<int64_t>& mine, const Group& group = Group());
std::vector<std::vector<double>> all_gather_values(const std::vector<double>& mine, const Group& group = Group());
// Byte strings of any length. broadcast_bytes: the global rank src's bytes (the argument is read on
// src only). all_gather_bytes: every member's, in group-rank order. gather_bytes: every member's on
// the global rank dst, an empty vector elsewhere.
std::string broadcast_bytes(const std::string& bytes, int src, const Group& group = Group());
std::vector<std::string> all_gather_bytes(const std::string& mine, const Group& group = Group());
std::vector<std::string> gather_bytes(const std::string& mine, int dst, const Group& group = Group());

// Point to point. tag distinguishes concurrent messages between the same pair; tags >= 0x6F000000 are dtrain's.
void send(const at::Tensor& tensor, int dst, const Group& group = Group(), int tag = 0);
// src = -1 receives from any rank. Returns the global rank of the sender.
int recv(at::Tensor& tensor, int src = -1, const Group& group = Group(), int tag = 0);
Work isend(const at::Tensor& tensor, int dst, const Group& group = Group(), int tag = 0);
Work irecv(at::Tensor& tensor, int src, const Group& group = Group(), int tag = 0);

}  // namespace dtrain
