/* dtrain's C API: distributed training for any language that binds LibTorch (tch-rs, TorchSharp,
 * javacpp's pytorch presets, Ruby's torch.rb, R's torch) through a plain C surface. Implemented by
 * libdtrain_c, which exports only the dtrain_c_* functions below. docs/c_api.md is the guide.
 *
 *   dtrain_c_init_process_group(NULL, NULL, -1, -1, 0);     launcher env (dtrain-run, torchrun)
 *   dtrain_c_ddp* ddp; dtrain_c_ddp_new(params, n, NULL, NULL, NULL, &ddp);
 *   for each step:
 *     dtrain_c_ddp_forward_begin(ddp);  loss = your_forward(...);  dtrain_c_ddp_forward_end(ddp, &loss, 1);
 *     your_backward(loss);              the parameters' .grad now hold the average over the ranks
 *     your_optimizer_step();
 *   dtrain_c_ddp_free(ddp); dtrain_c_destroy_process_group();
 *
 * Tensors: a dtrain_c_tensor* IS an at::Tensor* (LibTorch's C++ tensor handle), the handle tch-rs
 * (Tensor::as_ptr, its C_tensor) and TorchSharp (Tensor.Handle) hold. The library never takes
 * ownership of a tensor passed in: it keeps its own reference while it needs one (an async work, a
 * DDP's parameters share the caller's storage and autograd state). A process must load one LibTorch:
 * the one libdtrain_c was linked against. dtrain_c_tensor_from_impl turns a c10::TensorImpl* (what
 * PyTorch's tensor._cdata gives) into an at::Tensor* the caller frees with dtrain_c_tensor_free.
 *
 * Added in this version (see docs/c_api.md for each call sequence): fully_shard over parameter
 * tensors (dtrain_c_fsdp_*), point-to-point send/recv, DistributedSampler's indices, clip_grad_norm_,
 * GradScaler, the training Monitor's step metrics, distributed checkpoints
 * (torch.distributed.checkpoint's folders) of named tensors, ZeroRedundancyOptimizer over parameter
 * tensors (dtrain_c_zero_*) and the CheckpointManager of named tensors (dtrain_c_checkpoint_*).
 *
 * Errors: every function returns a dtrain_c_status; on failure dtrain_c_last_error() gives one line
 * naming the function, the rank (once initialized) and what to do. No C++ exception leaves the
 * library. Handles are checked against the live ones: a NULL, freed or never-created handle (group,
 * work, ddp, fsdp, grad scaler, monitor, zero, checkpoint) is DTRAIN_C_INVALID_HANDLE, never a crash.
 * A NULL group means the world. Threads: the calls of one process group are collective; make them
 * from one thread at a time.
 */
#ifndef DTRAIN_C_H
#define DTRAIN_C_H

#include <stddef.h>
#include <stdint.h>

#if defined(__GNUC__)
#define DTRAIN_C_API __attribute__((visibility("default")))
#else
#define DTRAIN_C_API
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* Raised when a function's signature or meaning changes; dtrain_c_abi_version() says what the loaded
 * library implements, so a binding can refuse a library it was not written for. Adding functions,
 * or fields at the end of an options struct (struct_size tells them apart), keeps the version: a
 * binding that needs a function added later looks its symbol up (dlsym) and treats a missing one as
 * an older library of the same version. */
#define DTRAIN_C_ABI_VERSION 1

typedef enum dtrain_c_status {
  DTRAIN_C_OK = 0,
  DTRAIN_C_INVALID_ARGUMENT = 1, /* a NULL pointer, a bad value, a tensor of the wrong dtype/device/shape */
  DTRAIN_C_INVALID_HANDLE = 2,   /* a NULL, freed or unknown group/work/ddp handle */
  DTRAIN_C_NOT_INITIALIZED = 3,  /* called before dtrain_c_init_process_group (or after destroy) */
  DTRAIN_C_DIST_ERROR = 4,       /* the collective or rendezvous failed (a peer died, a timeout, ...) */
  DTRAIN_C_IO_ERROR = 5,         /* a checkpoint file could not be read or written */
  DTRAIN_C_INTERNAL_ERROR = 6    /* anything else LibTorch or dtrain threw */
} dtrain_c_status;

typedef enum dtrain_c_reduce_op {
  DTRAIN_C_SUM = 0,
  DTRAIN_C_AVG = 1,
  DTRAIN_C_MIN = 2,
  DTRAIN_C_MAX = 3,
  DTRAIN_C_PRODUCT = 4,
  /* Not an op: makes every int a value of the type, so a wrong number passed from another language is
     refused with DTRAIN_C_INVALID_ARGUMENT, not undefined behaviour in the library. */
  DTRAIN_C_REDUCE_OP_MAX_ENUM = 0x7FFFFFFF
} dtrain_c_reduce_op;

typedef struct dtrain_c_tensor dtrain_c_tensor;           /* at::Tensor, never defined in C */
typedef struct dtrain_c_group dtrain_c_group;             /* a subgroup (NULL: the world) */
typedef struct dtrain_c_work dtrain_c_work;               /* an asynchronous collective */
typedef struct dtrain_c_ddp dtrain_c_ddp;                 /* DistributedDataParallel over caller-owned parameters */
typedef struct dtrain_c_fsdp dtrain_c_fsdp;               /* fully_shard (FSDP2) over caller-owned parameters */
typedef struct dtrain_c_grad_scaler dtrain_c_grad_scaler; /* GradScaler (mixed precision's loss scaling) */
typedef struct dtrain_c_monitor dtrain_c_monitor;         /* the training Monitor (step metrics, files) */
typedef struct dtrain_c_zero dtrain_c_zero;               /* ZeroRedundancyOptimizer over caller-owned parameters */
typedef struct dtrain_c_checkpoint dtrain_c_checkpoint;   /* CheckpointManager of named tensors */

/* DDP's options; fill with dtrain_c_ddp_options_default (PyTorch's defaults), then change fields.
 * struct_size lets a later ABI add fields at the end. */
typedef struct dtrain_c_ddp_options {
  size_t struct_size;
  double bucket_cap_mb;        /* 25 */
  double first_bucket_cap_mb;  /* 1 */
  int broadcast_buffers;       /* 1 (no buffers here: kept for PyTorch's spelling) */
  int find_unused_parameters;  /* 0 */
  int gradient_as_bucket_view; /* 0 */
  int static_graph;            /* 0 */
} dtrain_c_ddp_options;

/* --- version and errors --------------------------------------------------------------------- */
DTRAIN_C_API int dtrain_c_abi_version(void);
/* The last failure's message on this thread ("" after a call that succeeded). Valid until the next
 * dtrain_c_* call on this thread. */
DTRAIN_C_API const char* dtrain_c_last_error(void);

/* --- tensors from other front ends ----------------------------------------------------------- */
/* impl: a c10::TensorImpl* (Python: tensor._cdata) of a live tensor. *out: a new at::Tensor* sharing
 * it (storage, autograd state), freed with dtrain_c_tensor_free. */
DTRAIN_C_API dtrain_c_status dtrain_c_tensor_from_impl(void* impl, dtrain_c_tensor** out);
/* Frees an at::Tensor* made by dtrain_c_tensor_from_impl or dtrain_c_grad_scaler_scale (the tensor lives
 * on while others hold it). */
DTRAIN_C_API dtrain_c_status dtrain_c_tensor_free(dtrain_c_tensor* tensor);

/* --- process group lifetime ------------------------------------------------------------------ */
/* backend: "gloo", "nccl" or NULL (gloo, or $DTRAIN_BACKEND); init_method: NULL for "env://" (the
 * launcher's MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE); rank, world_size: -1 from the environment;
 * timeout_ms: 0 for the default (30 min, or $DTRAIN_TIMEOUT_S). */
DTRAIN_C_API dtrain_c_status dtrain_c_init_process_group(const char* backend, const char* init_method, int rank,
                                                         int world_size, int64_t timeout_ms);
DTRAIN_C_API int dtrain_c_is_initialized(void);
/* Ends the process group. Every group, work and ddp handle dies with it (later use:
 * DTRAIN_C_INVALID_HANDLE). */
DTRAIN_C_API dtrain_c_status dtrain_c_destroy_process_group(void);
DTRAIN_C_API dtrain_c_status dtrain_c_rank(int* out);
DTRAIN_C_API dtrain_c_status dtrain_c_world_size(int* out);
DTRAIN_C_API dtrain_c_status dtrain_c_local_rank(int* out);

/* A subgroup of the given global ranks; every rank of the world calls it, members or not, in the
 * same order. n = 0: the whole world. */
DTRAIN_C_API dtrain_c_status dtrain_c_new_group(const int* ranks, size_t n, dtrain_c_group** out);
/* This rank's rank in the group (-1 if not a member) and its size. */
DTRAIN_C_API dtrain_c_status dtrain_c_group_rank(dtrain_c_group* group, int* out);
DTRAIN_C_API dtrain_c_status dtrain_c_group_size(dtrain_c_group* group, int* out);
DTRAIN_C_API dtrain_c_status dtrain_c_group_free(dtrain_c_group* group);

/* --- collectives ----------------------------------------------------------------------------- */
/* group: NULL for the world. work: NULL to block until done; else *work receives a handle to wait on
 * (the tensors must not be read before it completes), freed with dtrain_c_work_free. src is a global
 * rank. Tensors: on the backend's device (the CPU for gloo), contiguous. */
DTRAIN_C_API dtrain_c_status dtrain_c_all_reduce(dtrain_c_tensor* tensor, dtrain_c_reduce_op op, dtrain_c_group* group,
                                                 dtrain_c_work** work);
DTRAIN_C_API dtrain_c_status dtrain_c_broadcast(dtrain_c_tensor* tensor, int src, dtrain_c_group* group,
                                                dtrain_c_work** work);
/* output: [group size * d0, ...] (or [group size, d0, ...]), input's dtype and device. */
DTRAIN_C_API dtrain_c_status dtrain_c_all_gather_into_tensor(dtrain_c_tensor* output, dtrain_c_tensor* input,
                                                             dtrain_c_group* group, dtrain_c_work** work);
/* input: group size parts shaped like output, along dim 0. */
DTRAIN_C_API dtrain_c_status dtrain_c_reduce_scatter_tensor(dtrain_c_tensor* output, dtrain_c_tensor* input,
                                                            dtrain_c_reduce_op op, dtrain_c_group* group,
                                                            dtrain_c_work** work);
DTRAIN_C_API dtrain_c_status dtrain_c_barrier(dtrain_c_group* group, dtrain_c_work** work);

/* Point-to-point, as torch.distributed.send/recv (isend/irecv with a work handle): dst and src are
 * global ranks; tag pairs a send with the recv of the same tag. recv: src -1 receives from any rank
 * (blocking only); *sender (may be NULL) gets the sender's global rank. */
DTRAIN_C_API dtrain_c_status dtrain_c_send(dtrain_c_tensor* tensor, int dst, dtrain_c_group* group, int tag,
                                           dtrain_c_work** work);
DTRAIN_C_API dtrain_c_status dtrain_c_recv(dtrain_c_tensor* tensor, int src, dtrain_c_group* group, int tag,
                                           int* sender, dtrain_c_work** work);

DTRAIN_C_API dtrain_c_status dtrain_c_work_wait(dtrain_c_work* work);
/* *out: 1 once finished (then the results may be read), else 0. */
DTRAIN_C_API dtrain_c_status dtrain_c_work_is_completed(dtrain_c_work* work, int* out);
DTRAIN_C_API dtrain_c_status dtrain_c_work_free(dtrain_c_work* work);

/* --- DistributedDataParallel ------------------------------------------------------------------ */
DTRAIN_C_API void dtrain_c_ddp_options_default(dtrain_c_ddp_options* options);
/* params: the model's n parameters (floating point, requires_grad, one device), in the same order on
 * every rank. names: NULL ("param_0", ...) or n names without '.'. options: NULL for the defaults.
 * Collective: every rank ends up with rank 0's values, written into the caller's tensors. DDP then
 * averages their gradients during the caller's own backward (hooks on their gradient accumulators). */
DTRAIN_C_API dtrain_c_status dtrain_c_ddp_new(dtrain_c_tensor* const* params, size_t n, const char* const* names,
                                              const dtrain_c_ddp_options* options, dtrain_c_group* group,
                                              dtrain_c_ddp** out);
/* Around each forward, as DDP's forward() does: begin before it, end after it with its outputs (the
 * loss will do; find_unused_parameters searches the graph from them). */
DTRAIN_C_API dtrain_c_status dtrain_c_ddp_forward_begin(dtrain_c_ddp* ddp);
DTRAIN_C_API dtrain_c_status dtrain_c_ddp_forward_end(dtrain_c_ddp* ddp, dtrain_c_tensor* const* outputs, size_t n);
/* DDP's no_sync(): forwards and backwards between begin and end accumulate gradients locally; the
 * next synchronized backward averages the sum. */
DTRAIN_C_API dtrain_c_status dtrain_c_ddp_no_sync_begin(dtrain_c_ddp* ddp);
DTRAIN_C_API dtrain_c_status dtrain_c_ddp_no_sync_end(dtrain_c_ddp* ddp);
DTRAIN_C_API dtrain_c_status dtrain_c_ddp_free(dtrain_c_ddp* ddp);

/* --- checkpoints (safetensors, readable by Python's safetensors) ------------------------------- */
/* Writes the n tensors under their names (atomically). */
DTRAIN_C_API dtrain_c_status dtrain_c_save_safetensors(const char* path, const char* const* names,
                                                       dtrain_c_tensor* const* tensors, size_t n);
/* Copies the file's tensors into the given ones by name (as load_state_dict(strict=True)): a name
 * missing from the file or the list, or a shape that differs, is an error and nothing is changed. */
DTRAIN_C_API dtrain_c_status dtrain_c_load_safetensors(const char* path, const char* const* names,
                                                       dtrain_c_tensor* const* tensors, size_t n);

/* --- fully_shard (FSDP2, ZeRO-3) --------------------------------------------------------------- */
/* The unit of dtrain_c_fsdp_forward_begin/end and unshard/reshard that is the root (the parameters
 * no other unit holds). */
#define DTRAIN_C_FSDP_ROOT (-1)

/* Fill with dtrain_c_fsdp_options_default, then change fields. */
typedef struct dtrain_c_fsdp_options {
  size_t struct_size;
  /* FSDP2's reshard_after_forward: -1 its default (true, the root false), 0 false, 1 true, n > 1 the
     size of the groups a unit stays sharded over between forward and backward (n divides the group's). */
  int reshard_after_forward;
} dtrain_c_fsdp_options;

DTRAIN_C_API void dtrain_c_fsdp_options_default(dtrain_c_fsdp_options* options);
/* params: the model's n parameters (floating point, requires_grad, one device), the same on every
 * rank in the same order (not broadcast: seed every rank alike, as FSDP2). names: NULL ("param_0",
 * ...) or n unique names without '.'. unit_of: NULL (one unit, the root) or, per parameter, the unit
 * 0 .. K-1 that holds it (FSDP2's fully_shard(block) per block) or DTRAIN_C_FSDP_ROOT; units are
 * numbered without gaps and run in their number's order. Collective. Afterwards EACH CALLER TENSOR
 * HOLDS THIS RANK'S SHARD (rows r*ceil(d0/N) .. of dim 0, maybe none) between steps, and the whole
 * parameter only while its unit is gathered: build the optimizer state on the shards, and read the
 * whole with dtrain_c_fsdp_full_parameter. */
DTRAIN_C_API dtrain_c_status dtrain_c_fsdp_new(dtrain_c_tensor* const* params, size_t n, const char* const* names,
                                               const int* unit_of, const dtrain_c_fsdp_options* options,
                                               dtrain_c_group* group, dtrain_c_fsdp** out);
/* Around the forward of the root and, nested inside it, of each unit (bindings have no module hooks):
 *   begin(ROOT); begin(0); h = unit 0's layers(x); end(0, &h, 1); begin(1); ... end(1, &y, 1);
 *   loss = ...; end(ROOT, &loss, 1); your_backward(loss);
 * begin gathers the unit's whole parameters into the caller's tensors; end follows its outputs into
 * backward and reshards (per reshard_after_forward). During backward each unit gathers again and
 * reduce-scatters its gradients: when backward returns, each tensor's .grad is the shard of the
 * gradient averaged over the group. */
DTRAIN_C_API dtrain_c_status dtrain_c_fsdp_forward_begin(dtrain_c_fsdp* fsdp, int unit);
DTRAIN_C_API dtrain_c_status dtrain_c_fsdp_forward_end(dtrain_c_fsdp* fsdp, int unit, dtrain_c_tensor* const* outputs,
                                                       size_t n);
/* FSDPModule.unshard()/reshard(): gather the unit's parameters now (kept whole until reshard or its
 * next backward), or free them. */
DTRAIN_C_API dtrain_c_status dtrain_c_fsdp_unshard(dtrain_c_fsdp* fsdp, int unit);
DTRAIN_C_API dtrain_c_status dtrain_c_fsdp_reshard(dtrain_c_fsdp* fsdp, int unit);
/* FSDPModule.set_requires_gradient_sync (FSDP2's no_sync) for every unit. */
DTRAIN_C_API dtrain_c_status dtrain_c_fsdp_set_requires_gradient_sync(dtrain_c_fsdp* fsdp, int requires_sync);
/* Collective: copies the whole parameter `index` (the order of params) into out (its whole shape). */
DTRAIN_C_API dtrain_c_status dtrain_c_fsdp_full_parameter(dtrain_c_fsdp* fsdp, size_t index, dtrain_c_tensor* out);
/* The caller's tensors keep their shards. */
DTRAIN_C_API dtrain_c_status dtrain_c_fsdp_free(dtrain_c_fsdp* fsdp);

/* --- training loop helpers --------------------------------------------------------------------- */
/* DistributedSampler(dataset, num_replicas, rank, shuffle, seed, drop_last) after set_epoch(epoch):
 * this rank's indices, the same as PyTorch's list(sampler). num_replicas, rank: -1 from the process
 * group. out NULL: only *count; else out holds capacity >= *count int64s. */
DTRAIN_C_API dtrain_c_status dtrain_c_sampler_indices(size_t dataset_size, int num_replicas, int rank, int shuffle,
                                                      int64_t seed, int drop_last, int64_t epoch, int64_t* out,
                                                      size_t capacity, size_t* count);
/* torch.nn.utils.clip_grad_norm_ over the parameters' gradients (parameters without one are skipped).
 * Parameters that dtrain_c_fsdp_new sharded count as the whole gradient (collective over their group,
 * as PyTorch's over DTensors); others are whole on this rank. *total_norm (may be NULL): the norm
 * before clipping. max_norm: infinity to measure only. */
DTRAIN_C_API dtrain_c_status dtrain_c_clip_grad_norm_(dtrain_c_tensor* const* params, size_t n, double max_norm,
                                                      double norm_type, double* total_norm);

typedef struct dtrain_c_grad_scaler_options {
  size_t struct_size;
  double init_scale;       /* 65536 */
  double growth_factor;    /* 2 */
  double backoff_factor;   /* 0.5 */
  int64_t growth_interval; /* 2000 */
  int enabled;             /* 1 */
} dtrain_c_grad_scaler_options;

DTRAIN_C_API void dtrain_c_grad_scaler_options_default(dtrain_c_grad_scaler_options* options);
/* GradScaler whose inf/NaN check is agreed over the group (NULL: the world; collective in unscale_ and
 * step): an overflow on any rank makes every rank skip and back off together. */
DTRAIN_C_API dtrain_c_status dtrain_c_grad_scaler_new(const dtrain_c_grad_scaler_options* options,
                                                      dtrain_c_group* group, dtrain_c_grad_scaler** out);
/* scaler.scale(loss): *scaled is a new tensor (free it with dtrain_c_tensor_free) to run backward on.
 * Call it once per iteration before unscale_/step. */
DTRAIN_C_API dtrain_c_status dtrain_c_grad_scaler_scale(dtrain_c_grad_scaler* scaler, dtrain_c_tensor* loss,
                                                        dtrain_c_tensor** scaled);
/* scaler.unscale_(optimizer) over the parameters the caller's optimizer steps: their .grad divided by
 * the scale in place (before clipping). At most once per iteration. */
DTRAIN_C_API dtrain_c_status dtrain_c_grad_scaler_unscale_(dtrain_c_grad_scaler* scaler, dtrain_c_tensor* const* params,
                                                           size_t n);
/* scaler.step(optimizer)'s decision: unscales if not done yet; *should_step = 1 when no gradient was
 * inf/NaN on any rank: then run your optimizer's step; 0: skip it. */
DTRAIN_C_API dtrain_c_status dtrain_c_grad_scaler_step(dtrain_c_grad_scaler* scaler, dtrain_c_tensor* const* params,
                                                       size_t n, int* should_step);
/* scaler.update(new_scale): new_scale 0 lets the scaler back off or grow; > 0 sets it. */
DTRAIN_C_API dtrain_c_status dtrain_c_grad_scaler_update(dtrain_c_grad_scaler* scaler, double new_scale);
DTRAIN_C_API dtrain_c_status dtrain_c_grad_scaler_get_scale(dtrain_c_grad_scaler* scaler, double* out);
DTRAIN_C_API dtrain_c_status dtrain_c_grad_scaler_free(dtrain_c_grad_scaler* scaler);

/* --- the training monitor --------------------------------------------------------------------- */
typedef enum dtrain_c_phase {
  DTRAIN_C_PHASE_FORWARD = 0,
  DTRAIN_C_PHASE_BACKWARD = 1,
  DTRAIN_C_PHASE_OPTIMIZER = 2,
  DTRAIN_C_PHASE_MAX_ENUM = 0x7FFFFFFF /* not a phase: any int is refused as an argument, not UB */
} dtrain_c_phase;

/* One rank's step, milliseconds; NaN where not known. Set struct_size = sizeof before reading. */
typedef struct dtrain_c_step_metrics {
  size_t struct_size;
  int64_t step; /* 1-based over the run */
  double step_ms, forward_ms, backward_ms, optimizer_ms, comm_ms, comm_wait_ms;
  double loss, lr, grad_norm;
  int64_t samples;
  double samples_per_s, rss_mb;
} dtrain_c_step_metrics;

/* dtrain's Monitor: output_dir NULL for no files (else metrics.jsonl, trace.json, plot.svg there);
 * log_every: steps per window aggregated over the group (0: 10); progress: a progress line on rank 0.
 * Collective over the group (NULL: the world). */
DTRAIN_C_API dtrain_c_status dtrain_c_monitor_new(const char* output_dir, int64_t log_every, int progress,
                                                  dtrain_c_group* group, dtrain_c_monitor** out);
/* The parameters whose gradients' norm each step records (names NULL: by position). */
DTRAIN_C_API dtrain_c_status dtrain_c_monitor_watch_parameters(dtrain_c_monitor* monitor,
                                                               dtrain_c_tensor* const* params, size_t n,
                                                               const char* const* names);
/* Per step: begin_step (optional), each phase between phase_begin and phase_end (one open at a time),
 * end_step with what the loop knows (loss and lr NaN, samples 0: unknown); every log_every steps it
 * aggregates over the ranks (collective). */
DTRAIN_C_API dtrain_c_status dtrain_c_monitor_begin_step(dtrain_c_monitor* monitor);
DTRAIN_C_API dtrain_c_status dtrain_c_monitor_phase_begin(dtrain_c_monitor* monitor, dtrain_c_phase phase);
DTRAIN_C_API dtrain_c_status dtrain_c_monitor_phase_end(dtrain_c_monitor* monitor, dtrain_c_phase phase);
DTRAIN_C_API dtrain_c_status dtrain_c_monitor_end_step(dtrain_c_monitor* monitor, double loss, int64_t samples,
                                                       double lr);
/* This rank's last ended step. */
DTRAIN_C_API dtrain_c_status dtrain_c_monitor_last_step(dtrain_c_monitor* monitor, dtrain_c_step_metrics* out);
/* Collective: aggregates the last partial window and writes the merged files. Free after it. */
DTRAIN_C_API dtrain_c_status dtrain_c_monitor_close(dtrain_c_monitor* monitor);
DTRAIN_C_API dtrain_c_status dtrain_c_monitor_free(dtrain_c_monitor* monitor);

/* --- distributed checkpoints (torch.distributed.checkpoint folders) ------------------------------ */
/* Collective over the group (NULL: the world): each name a flat key, as Python's
 * dcp.save({name: tensor, ...}). A tensor dtrain_c_fsdp_new sharded is written as this rank's chunk of
 * the whole (a DTensor's Shard(0)), read back by Python's dcp.load into whole or sharded tensors on any
 * world size; other tensors are whole, written once. */
DTRAIN_C_API dtrain_c_status dtrain_c_dcp_save(const char* dir, const char* const* names,
                                               dtrain_c_tensor* const* tensors, size_t n, dtrain_c_group* group);
/* Fills the tensors in place from the folder (any world size that saved it); a name missing from it
 * or a whole shape that differs fails before anything changed. Names the folder has beyond these are
 * ignored, as DCP's. */
DTRAIN_C_API dtrain_c_status dtrain_c_dcp_load(const char* dir, const char* const* names,
                                               dtrain_c_tensor* const* tensors, size_t n, dtrain_c_group* group);

/* --- ZeroRedundancyOptimizer (ZeRO stage 1) ----------------------------------------------------- */
/* The optimizer ZeRO wraps, as torch.optim's: "sgd" (lr, momentum, dampening, weight_decay, nesterov),
 * "adam" and "adamw" (lr, betas, eps, weight_decay, amsgrad). Fill with dtrain_c_optimizer_options_default
 * (PyTorch's defaults for that optimizer), then change fields. */
typedef struct dtrain_c_optimizer_options {
  size_t struct_size;
  double lr;           /* 1e-3 (SGD's too, as torch.optim.SGD's default) */
  double momentum;     /* SGD: 0 */
  double dampening;    /* SGD: 0 */
  int nesterov;        /* SGD: 0 (needs momentum > 0 and dampening 0) */
  double beta1, beta2; /* Adam, AdamW: 0.9, 0.999 */
  double eps;          /* Adam, AdamW: 1e-8 */
  double weight_decay; /* 0; AdamW: 0.01 */
  int amsgrad;         /* Adam, AdamW: 0 */
} dtrain_c_optimizer_options;

/* optimizer: "sgd", "adam" or "adamw"; anything else is DTRAIN_C_INVALID_ARGUMENT. */
DTRAIN_C_API dtrain_c_status dtrain_c_optimizer_options_default(const char* optimizer,
                                                                dtrain_c_optimizer_options* options);
/* torch.distributed.optim.ZeroRedundancyOptimizer(params, optimizer_class, **options): params, the n
 * parameters (one floating dtype, on the group's device, requires_grad), the same on every rank in the
 * same order, are partitioned over the group's ranks as PyTorch's (largest first, each to the rank with
 * the fewest elements so far); each rank keeps the optimizer state of its share only. options: NULL for
 * the defaults. Collective over the group (NULL: the world). The gradients must already be the same on
 * every rank (dtrain_c_ddp_* averaged them). */
DTRAIN_C_API dtrain_c_status dtrain_c_zero_new(dtrain_c_tensor* const* params, size_t n, const char* optimizer,
                                               const dtrain_c_optimizer_options* options, dtrain_c_group* group,
                                               dtrain_c_zero** out);
/* Collective: steps this rank's share, then every share is broadcast from its owner, so every rank
 * ends with all parameters updated (in the caller's tensors). */
DTRAIN_C_API dtrain_c_status dtrain_c_zero_step(dtrain_c_zero* zero);
/* optimizer.zero_grad(set_to_none) over all the parameters (PyTorch's default: set_to_none 1). */
DTRAIN_C_API dtrain_c_status dtrain_c_zero_zero_grad(dtrain_c_zero* zero, int set_to_none);
/* param_groups[0]["lr"] (a scheduler's): read, or set for the following steps. */
DTRAIN_C_API dtrain_c_status dtrain_c_zero_get_lr(dtrain_c_zero* zero, double* out);
DTRAIN_C_API dtrain_c_status dtrain_c_zero_set_lr(dtrain_c_zero* zero, double lr);
/* Collective: gathers every share's state on global rank `to`, as the state of the wrapped optimizer
 * over all parameters (what an unsharded one would hold). */
DTRAIN_C_API dtrain_c_status dtrain_c_zero_consolidate_state_dict(dtrain_c_zero* zero, int to);
/* On the rank that consolidated last: writes that state to path (LibTorch's torch::save of the wrapped
 * optimizer, loadable by it unsharded too). */
DTRAIN_C_API dtrain_c_status dtrain_c_zero_save(dtrain_c_zero* zero, const char* path);
/* Every rank: reads a whole state (from dtrain_c_zero_save, or an unsharded LibTorch optimizer of the
 * same kind over the same parameters) and keeps its own share. */
DTRAIN_C_API dtrain_c_status dtrain_c_zero_load(dtrain_c_zero* zero, const char* path);
DTRAIN_C_API dtrain_c_status dtrain_c_zero_free(dtrain_c_zero* zero);

/* --- CheckpointManager of named tensors ----------------------------------------------------------- */
/* Fill with dtrain_c_checkpoint_options_default, then change fields. */
typedef struct dtrain_c_checkpoint_options {
  size_t struct_size;
  int64_t keep;     /* 2: checkpoints kept in the folder, the newest writes (>= 1) */
  int64_t interval; /* 1: save and save_async write only at steps that are a multiple of it */
  int rng;          /* 1: save and restore LibTorch's RNG states (the generators the binding draws from) */
} dtrain_c_checkpoint_options;

DTRAIN_C_API void dtrain_c_checkpoint_options_default(dtrain_c_checkpoint_options* options);
/* dtrain's CheckpointManager on folder dir (made at the first save). Each checkpoint is
 * dir/checkpoint_<step, 10 digits>.pt (the step, RNG states, a CRC-checked manifest) beside
 * dir/checkpoint_<step>.dcp/, a torch.distributed.checkpoint folder holding the tensors under the keys
 * "model.<name>" (Python: dcp.load({"model": {name: tensor, ...}}, checkpoint_id=that folder)). Names may
 * hold '.' (nested keys, as a module's state_dict). Not collective. */
DTRAIN_C_API dtrain_c_status dtrain_c_checkpoint_new(const char* dir, const dtrain_c_checkpoint_options* options,
                                                     dtrain_c_checkpoint** out);
/* Collective over the world: writes the named tensors at `step` when step % interval == 0 (*saved,
 * may be NULL: 1 if written), then removes all but the newest `keep`. Tensors as dtrain_c_dcp_save's
 * (fully_shard's shards written as their chunks of the whole). A save killed at any point leaves the
 * previous checkpoints as they were. */
DTRAIN_C_API dtrain_c_status dtrain_c_checkpoint_save(dtrain_c_checkpoint* checkpoint, int64_t step,
                                                      const char* const* names, dtrain_c_tensor* const* tensors,
                                                      size_t n, int* saved);
/* The same, in the background: returns once the tensors are copied (change them freely then); the
 * next save, save_async, wait or load_latest finishes it first, and fails on every rank if it did.
 * Call dtrain_c_checkpoint_wait on every rank before freeing the manager. */
DTRAIN_C_API dtrain_c_status dtrain_c_checkpoint_save_async(dtrain_c_checkpoint* checkpoint, int64_t step,
                                                            const char* const* names, dtrain_c_tensor* const* tensors,
                                                            size_t n, int* saved);
/* Collective: waits for the last save_async. */
DTRAIN_C_API dtrain_c_status dtrain_c_checkpoint_wait(dtrain_c_checkpoint* checkpoint);
/* Collective: fills the named tensors in place from the latest checkpoint (the newest write; a damaged
 * one is skipped with a warning for the previous) and *step (may be NULL) with its step; *found = 0
 * and nothing changed when the folder holds none. Every name, dtype and shape must match the saved
 * ones (the first mismatch is the error, nothing changed). */
DTRAIN_C_API dtrain_c_status dtrain_c_checkpoint_load_latest(dtrain_c_checkpoint* checkpoint, const char* const* names,
                                                             dtrain_c_tensor* const* tensors, size_t n, int64_t* step,
                                                             int* found);
/* A save_async not waited for is left unfinished (no checkpoint; the previous stays the latest). */
DTRAIN_C_API dtrain_c_status dtrain_c_checkpoint_free(dtrain_c_checkpoint* checkpoint);

#ifdef __cplusplus
}
#endif

#endif /* DTRAIN_C_H */
