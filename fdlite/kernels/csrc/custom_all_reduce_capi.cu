// extern "C" face of fdar::Group (custom_all_reduce.cu): turns exceptions into codes
// plus a per-thread message, so ctypes, Paddle's op binding and any other framework
// can call one library. Declarations and the calling sequence: custom_all_reduce_capi.h.
#include <string>

#include "custom_all_reduce.cuh"
#include "custom_all_reduce_capi.h"

namespace fdar {
void buffer_ipc_meta(const void* ptr, void* out_handle, int64_t* out_offset);
}

struct fdar_ctx {
  fdar::Group g;
  fdar_ctx(int r, int w, int64_t s, int b) : g(r, w, s, b) {}
};

namespace {
thread_local std::string g_last_error;

template <typename F>
int guarded(F&& f) {
  try {
    f();
    return 0;
  } catch (const fdar::Error& e) {
    g_last_error = e.what();
    return e.code;
  } catch (const std::exception& e) {
    g_last_error = e.what();
    return FDAR_E_STATE;
  }
}

int null_ctx() {
  g_last_error = "null fdar_ctx";
  return FDAR_E_ARG;
}
}  // namespace

extern "C" {

int fdar_abi_version(void) { return FDAR_ABI_VERSION; }
const char* fdar_last_error(void) { return g_last_error.c_str(); }

int fdar_device_count(int* out) {
  if (!out) return null_ctx();
  *out = 0;
  const cudaError_t e = cudaGetDeviceCount(out);
  if (e == cudaErrorNoDevice || e == cudaErrorInsufficientDriver) {
    cudaGetLastError();  // not sticky; report zero devices
    *out = 0;
    return 0;
  }
  if (e != cudaSuccess) {
    g_last_error = cudaGetErrorString(e);
    return (int)e;
  }
  return 0;
}

int fdar_create(int rank, int world, int64_t staging_bytes, int max_blocks, fdar_ctx** out) {
  if (!out) return null_ctx();
  *out = nullptr;
  return guarded([&] { *out = new fdar_ctx(rank, world, staging_bytes, max_blocks); });
}

int fdar_destroy(fdar_ctx* ctx) {
  delete ctx;
  return 0;
}

int64_t fdar_max_size(const fdar_ctx* ctx) { return ctx ? ctx->g.max_size() : 0; }
int fdar_world(const fdar_ctx* ctx) { return ctx ? ctx->g.world() : 0; }
int fdar_rank(const fdar_ctx* ctx) { return ctx ? ctx->g.rank() : -1; }
int fdar_max_blocks(const fdar_ctx* ctx) { return ctx ? ctx->g.max_blocks() : 0; }
int64_t fdar_one_shot_max(const fdar_ctx* ctx) { return ctx ? ctx->g.one_shot_max() : 0; }

int fdar_set_one_shot_max(fdar_ctx* ctx, int64_t bytes) {
  if (!ctx) return null_ctx();
  ctx->g.set_one_shot_max(bytes);
  return 0;
}

int fdar_ipc_handle(const fdar_ctx* ctx, void* out_handle) {
  if (!ctx || !out_handle) return null_ctx();
  return guarded([&] { ctx->g.ipc_handle(out_handle); });
}

int fdar_open_peers_ipc(fdar_ctx* ctx, const void* handles) {
  if (!ctx || !handles) return null_ctx();
  return guarded([&] { ctx->g.open_peers_ipc(static_cast<const char*>(handles)); });
}

void* fdar_shared_base(const fdar_ctx* ctx) { return ctx ? ctx->g.shared_base() : nullptr; }

int fdar_set_peers_local(fdar_ctx* ctx, void* const* bases) {
  if (!ctx || !bases) return null_ctx();
  return guarded([&] { ctx->g.set_peers_local(bases); });
}

int fdar_buffer_ipc_meta(const void* ptr, void* out_handle, int64_t* out_offset) {
  if (!ptr || !out_handle || !out_offset) return null_ctx();
  return guarded([&] { fdar::buffer_ipc_meta(ptr, out_handle, out_offset); });
}

int fdar_register_buffer_local(fdar_ctx* ctx, void* const* ptrs) {
  if (!ctx || !ptrs) return null_ctx();
  return guarded([&] { ctx->g.register_buffer(ptrs); });
}

int fdar_register_buffer_ipc(fdar_ctx* ctx, const void* own_ptr, const void* handles,
                             const int64_t* offsets) {
  if (!ctx || !own_ptr || !handles || !offsets) return null_ctx();
  return guarded([&] {
    ctx->g.register_buffer_ipc(own_ptr, static_cast<const char*>(handles), offsets);
  });
}

int fdar_begin_capture(fdar_ctx* ctx) {
  if (!ctx) return null_ctx();
  ctx->g.begin_capture();
  return 0;
}

int fdar_end_capture(fdar_ctx* ctx, int64_t* n_pending) {
  if (!ctx) return null_ctx();
  const int64_t n = ctx->g.end_capture();
  if (n_pending) *n_pending = n;
  return 0;
}

int fdar_pending_buffers(const fdar_ctx* ctx, void** out_ptrs, int64_t cap, int64_t* n) {
  if (!ctx) return null_ctx();
  const auto& pend = ctx->g.pending();
  if (n) *n = (int64_t)pend.size();
  if (out_ptrs) {
    if (cap < (int64_t)pend.size()) {
      g_last_error = "fdar_pending_buffers: cap smaller than the pending count";
      return FDAR_E_ARG;
    }
    for (size_t i = 0; i < pend.size(); ++i) out_ptrs[i] = const_cast<void*>(pend[i].second);
  }
  return 0;
}

int fdar_register_graph_local(fdar_ctx* ctx, void* const* ptrs, int64_t n) {
  if (!ctx || (n > 0 && !ptrs)) return null_ctx();
  return guarded([&] { ctx->g.register_graph(ptrs, n); });
}

int fdar_register_graph_ipc(fdar_ctx* ctx, const void* handles, const int64_t* offsets,
                            int64_t n) {
  if (!ctx || (n > 0 && (!handles || !offsets))) return null_ctx();
  return guarded([&] {
    ctx->g.register_graph_ipc(static_cast<const char*>(handles), offsets, n);
  });
}

int fdar_drop_pending(fdar_ctx* ctx) {
  if (!ctx) return null_ctx();
  ctx->g.drop_pending();
  return 0;
}

int fdar_all_reduce(fdar_ctx* ctx, const void* in, void* out, int64_t numel, int dtype,
                    void* stream) {
  return fdar_all_reduce_ex(ctx, in, out, numel, dtype, stream, FDAR_ALGO_AUTO);
}

int fdar_all_reduce_ex(fdar_ctx* ctx, const void* in, void* out, int64_t numel, int dtype,
                       void* stream, int algo) {
  if (!ctx) return null_ctx();
  return guarded([&] {
    ctx->g.all_reduce(in, out, numel, dtype, static_cast<cudaStream_t>(stream), algo);
  });
}

int fdar_gather(fdar_ctx* ctx, const void* in, void* out, int64_t rows, int64_t in_row_bytes,
                int64_t out_row_bytes, int root, void* stream) {
  if (!ctx) return null_ctx();
  return guarded([&] {
    ctx->g.gather(in, out, rows, in_row_bytes, out_row_bytes, root, static_cast<cudaStream_t>(stream));
  });
}

int fdar_device_errors(fdar_ctx* ctx, uint32_t* out, int clear) {
  if (!ctx || !out) return null_ctx();
  return guarded([&] { *out = ctx->g.device_errors(clear != 0); });
}

int fdar_stats(const fdar_ctx* ctx, int64_t* out) {
  if (!ctx || !out) return null_ctx();
  for (int i = 0; i < FDAR_STAT_COUNT; ++i) out[i] = ctx->g.stats()[i];
  return 0;
}

int fdar_blocks_per_sm(int world, int* out) {
  if (!out) return null_ctx();
  return guarded([&] { *out = fdar::blocks_per_sm(world); });
}

}  // extern "C"
