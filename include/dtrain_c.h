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
 * Errors: every function returns a dtrain_c_status; on failure dtrain_c_last_error() gives one line
 * naming the function, the rank (once initialized) and what to do. No C++ exception leaves the
 * library. Handles (group, work, ddp) are checked against the live ones: a NULL, freed or
 * never-created handle is DTRAIN_C_INVALID_HANDLE, never a crash. A NULL group means the world.
 * Threads: the calls of one process group are collective; make them from one thread at a time. */
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
 * library implements, so a binding can refuse a library it was not written for. */
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

typedef struct dtrain_c_tensor dtrain_c_tensor; /* at::Tensor, never defined in C */
typedef struct dtrain_c_group dtrain_c_group;   /* a subgroup (NULL: the world) */
typedef struct dtrain_c_work dtrain_c_work;     /* an asynchronous collective */
typedef struct dtrain_c_ddp dtrain_c_ddp;       /* DistributedDataParallel over caller-owned parameters */

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
/* Frees an at::Tensor* made by dtrain_c_tensor_from_impl (the tensor lives on while others hold it). */
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

#ifdef __cplusplus
}
#endif

#endif /* DTRAIN_C_H */
