/* Plain C ABI of fdlite's custom all-reduce (see custom_all_reduce.cuh).
 *
 * Hand-written as C so that one shared library serves both the Paddle custom op
 * (paddle_binding.cc) and framework-neutral callers (ctypes in
 * fdlite/kernels/allreduce/custom_all_reduce.py, the GPU harness in tools/gpu). Streams
 * and device pointers cross as void*, so no CUDA header is needed to call it.
 *
 * Every function returns 0 on success or a nonzero code (a cudaError_t, or one of
 * FDAR_E_* below); fdar_last_error() describes the last failure of the calling thread.
 * A handle is used by one host thread at a time.
 *
 * Life of a group of `world` ranks:
 *   fdar_create                     on every rank (allocates signal flags + staging)
 *   fdar_ipc_handle -> exchange -> fdar_open_peers_ipc      (one process per GPU), or
 *   fdar_shared_base -> fdar_set_peers_local                  (all ranks in one process)
 *   fdar_all_reduce                 eager: input copied into staging inside the kernel
 *   fdar_begin_capture; capture the graph; fdar_end_capture
 *   fdar_pending_buffers -> (fdar_buffer_ipc_meta) -> exchange ->
 *   fdar_register_graph_ipc / fdar_register_graph_local     before the first replay
 *   fdar_gather                     all-gather / broadcast through the staging buffers
 *   fdar_destroy
 * The Python listing of these signatures (custom_all_reduce.py, _SIGNATURES) is
 * checked against this header by tests/test_custom_allreduce_cpu.py.
 */
#ifndef FDLITE_CUSTOM_ALL_REDUCE_CAPI_H_
#define FDLITE_CUSTOM_ALL_REDUCE_CAPI_H_

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(__GNUC__)
#define FDAR_API __attribute__((visibility("default")))
#else
#define FDAR_API
#endif

#define FDAR_ABI_VERSION 2
#define FDAR_IPC_HANDLE_BYTES 64

/* dtypes */
#define FDAR_BF16 0
#define FDAR_FP16 1
#define FDAR_FP32 2

/* algorithms for fdar_all_reduce_ex */
#define FDAR_ALGO_AUTO 0
#define FDAR_ALGO_ONE_SHOT 1
#define FDAR_ALGO_TWO_SHOT 2

/* error codes beyond cudaError_t's range */
#define FDAR_E_ARG 10001         /* bad argument */
#define FDAR_E_SIZE 10002        /* bytes not a multiple of 16, or above fdar_max_size */
#define FDAR_E_ALIGN 10003       /* pointer not 16-byte aligned */
#define FDAR_E_NO_PEERS 10004    /* peers not opened yet */
#define FDAR_E_CAPACITY 10005    /* registered-pointer table is full */
#define FDAR_E_STATE 10006       /* call out of order (e.g. register with nothing pending) */

/* counters of launches by path, for tests and logs */
#define FDAR_STAT_STAGING 0      /* input copied through the staging buffer */
#define FDAR_STAT_REGISTERED 1   /* input was a registered buffer */
#define FDAR_STAT_GRAPH 2        /* captured with its input recorded for registration */
#define FDAR_STAT_ONE_SHOT 3
#define FDAR_STAT_TWO_SHOT 4
#define FDAR_STAT_COUNT 5

typedef struct fdar_ctx fdar_ctx;

FDAR_API int fdar_abi_version(void);
FDAR_API const char* fdar_last_error(void);
/* cudaGetDeviceCount through this library's runtime; 0 devices is not an error. */
FDAR_API int fdar_device_count(int* out);

/* Allocates this rank's flags + staging buffer on the current device. staging_bytes
 * is the largest all-reduce the handle takes (callers fall back to NCCL above it).
 * max_blocks <= 0 picks the default; it must be equal on all ranks. */
FDAR_API int fdar_create(int rank, int world, int64_t staging_bytes, int max_blocks, fdar_ctx** out);
FDAR_API int fdar_destroy(fdar_ctx* ctx);

FDAR_API int64_t fdar_max_size(const fdar_ctx* ctx);
FDAR_API int fdar_world(const fdar_ctx* ctx);
FDAR_API int fdar_rank(const fdar_ctx* ctx);
FDAR_API int fdar_max_blocks(const fdar_ctx* ctx);
/* Largest message (bytes) that AUTO sends one-shot; override for tests / tuning. */
FDAR_API int64_t fdar_one_shot_max(const fdar_ctx* ctx);
FDAR_API int fdar_set_one_shot_max(fdar_ctx* ctx, int64_t bytes);

/* Peers, by CUDA IPC (one process per GPU) ... */
FDAR_API int fdar_ipc_handle(const fdar_ctx* ctx, void* out_handle);
FDAR_API int fdar_open_peers_ipc(fdar_ctx* ctx, const void* handles /* world * 64 bytes, by rank */);
/* ... or by plain pointers (all ranks in one process: P2P, or one GPU simulating). */
FDAR_API void* fdar_shared_base(const fdar_ctx* ctx);
FDAR_API int fdar_set_peers_local(fdar_ctx* ctx, void* const* bases /* world, by rank */);

/* IPC handle of the allocation holding ptr, and ptr's offset into it. */
FDAR_API int fdar_buffer_ipc_meta(const void* ptr, void* out_handle, int64_t* out_offset);

/* A long-lived input buffer, registered once: all-reduces reading it skip the copy.
 * Its address on every rank, by pointers or by IPC (handles/offsets by rank). */
FDAR_API int fdar_register_buffer_local(fdar_ctx* ctx, void* const* ptrs);
FDAR_API int fdar_register_buffer_ipc(fdar_ctx* ctx, const void* own_ptr, const void* handles,
                             const int64_t* offsets);

/* Graph capture. Between begin and end, an out-of-place all-reduce on a capturing
 * stream reads its inputs through a fresh slot of the registered-pointer table and
 * records its input pointer; after capture every rank registers the recorded
 * pointers of all ranks, in capture order, before the graph is replayed. */
FDAR_API int fdar_begin_capture(fdar_ctx* ctx);
FDAR_API int fdar_end_capture(fdar_ctx* ctx, int64_t* n_pending);
FDAR_API int fdar_pending_buffers(const fdar_ctx* ctx, void** out_ptrs, int64_t cap, int64_t* n);
FDAR_API int fdar_register_graph_local(fdar_ctx* ctx, void* const* ptrs /* world*n, rank-major */,
                              int64_t n);
FDAR_API int fdar_register_graph_ipc(fdar_ctx* ctx, const void* handles /* world*n*64 */,
                            const int64_t* offsets /* world*n */, int64_t n);
FDAR_API int fdar_drop_pending(fdar_ctx* ctx);

/* out = sum over ranks of in, on `stream` (a cudaStream_t; NULL is the legacy
 * stream). in == out is allowed (it goes through the staging buffer). */
FDAR_API int fdar_all_reduce(fdar_ctx* ctx, const void* in, void* out, int64_t numel, int dtype,
                    void* stream);
FDAR_API int fdar_all_reduce_ex(fdar_ctx* ctx, const void* in, void* out, int64_t numel, int dtype,
                       void* stream, int algo);

/* Gather through the staging buffers (eager or inside a capture alike). root < 0: all-gather,
 * every rank's `rows` rows of in_row_bytes side by side in rank order; root >= 0: broadcast,
 * the root's rows (in may be NULL elsewhere). Output rows are out_row_bytes long, at most the
 * gathered width: columns past it are dropped (a padded vocabulary). rows * in_row_bytes must
 * fit fdar_max_size; rows and pointers multiples of 4 bytes (16 take the wide path). */
FDAR_API int fdar_gather(fdar_ctx* ctx, const void* in, void* out, int64_t rows, int64_t in_row_bytes,
                         int64_t out_row_bytes, int root, void* stream);

/* Error bits left by kernels (1: graph replayed before registration; 2: spin
 * timeout). Synchronises the device. clear != 0 resets them. */
FDAR_API int fdar_device_errors(fdar_ctx* ctx, uint32_t* out, int clear);
FDAR_API int fdar_stats(const fdar_ctx* ctx, int64_t* out /* FDAR_STAT_COUNT */);
/* Smallest number of resident blocks per SM over the kernels of this world size:
 * a single-GPU simulation of `world` ranks needs world*max_blocks resident at once. */
FDAR_API int fdar_blocks_per_sm(int world, int* out);

#ifdef __cplusplus
}
#endif

#endif /* FDLITE_CUSTOM_ALL_REDUCE_CAPI_H_ */
