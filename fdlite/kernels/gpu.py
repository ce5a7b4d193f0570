"""fdlite's own GPU ops (fdlite/kernels/csrc/ops_*.cu) behind thin Python functions.

Hand-written CUDA because PyPI's paddlepaddle-gpu has no sm_90 code: on the Hopper GPUs every
Paddle built-in kernel (fills, casts, gathers, math, nn layers) silently does nothing, so the GPU
path must run only ops of its own, as FastDeploy's GPU path runs its compiled custom_ops. Each
function checks what the kernel relies on (GPU place, contiguity, dtypes, shapes) and calls the
custom op; the kernels run on the current stream and are safe inside a Paddle CUDAGraph capture
(outputs come from Paddle's allocator, which inside a capture is the graph's pool). The first call
of `linear` on a device must be eager (it creates the cuBLAS handles and workspace).

Contiguity matters: Paddle hands a non-contiguous input to a custom op through its own
`contiguous` kernel, which does nothing on sm_90. Row slices (`x[a:b]`) are contiguous views and
fine; column slices are not (split columns inside the kernels instead, as `rope_qk_norm_cache`
does for the fused qkv).

`load()` registers the ops once per process: from $FDLITE_GPU_OPS_LIB, else from the on-disk build
cache (fdlite.kernels.build, compiled on first use), and passes the library its run-time switches from
fdlite/envs.py (FDLITE_PDL, FDLITE_GEMV, FDLITE_ATTN_MMA, FDLITE_DECODE_MMA, FDLITE_DECODE_SPLIT_KEYS: the C++ side
reads no environment; `set_options` changes
them later, for side-by-side measurements). The models reach them through the CPU/GPU dispatch of `fdlite/layers/` (`CustomOp`, `fdlite/kernels/custom_op.py`).

Cost: the checks are Python attribute reads on Paddle tensors (measured on the H100 machine's host
with Paddle 2.6.2: an eager `rms_norm` call costs 56-113 us of wall time, against 1.8 us per op in a
graph replay, where no Python runs). An engine that has validated its buffers once (say at
capture) can turn them off for its eager hot path with `set_checks(False)`, or
FDLITE_GPU_OPS_CHECKS=0.
"""

from __future__ import annotations

import ctypes
import threading

import numpy as np

from fdlite import envs
from fdlite.kernels import native

_lock = threading.Lock()
_state: dict = {}

FLOAT_DTYPES = ("float32", "float16", "bfloat16")
HEAD_DIMS = (64, 128, 256)  # the attention kernels' instantiations (ops_attention.cu)


_checks = envs.FDLITE_GPU_OPS_CHECKS
_dtype_names: dict = {}


class GpuOpsError(RuntimeError):
    pass


def set_checks(enabled: bool) -> None:
    """Turn the wrappers' argument checks on or off (on by default; see the module docstring)."""
    global _checks
    _checks = bool(enabled)


# ------------------------------------------------------------------ loading
_vp, _int, _size = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t
# The plain C entry points of ops_capi.cu: name -> (restype, argtypes).
CAPI_SIGNATURES: dict[str, tuple[object, list[object]]] = {
    "fdl_ops_abi_version": (_int, []),
    "fdl_set_options": (_int, [_int, _int, _int, _int, _int]),
    "fdl_event_create": (_vp, []),
    "fdl_event_record": (_int, [_vp, _vp]),
    "fdl_event_elapsed_ms": (ctypes.c_float, [_vp, _vp]),
    "fdl_event_destroy": (_int, [_vp]),
    "fdl_memcpy_d2h": (_int, [_vp, _vp, _size]),
    "fdl_memcpy_h2d_async": (_int, [_vp, _vp, _size, _vp]),
    "fdl_memcpy_h2d_many": (_int, [_int, _vp, _vp]),
    "fdl_memcpy_h2d_many_pinned": (_int, [_int, _vp, _vp, _vp, _size, _vp]),
    "fdl_host_alloc": (_vp, [_size]),
    "fdl_host_free": (_int, [_vp]),
    "fdl_memcpy_d2h_async": (_int, [_vp, _vp, _size, _vp, _vp]),
    "fdl_event_synchronize": (_int, [_vp]),
}
# Entry points that queue work or read a flag and return in microseconds: called holding the GIL (native.py). The
# others block (event waits, synchronous copies) and let the engine's other thread run meanwhile.
CAPI_KEEP_GIL = frozenset({"fdl_ops_abi_version", "fdl_set_options", "fdl_event_create", "fdl_event_record",
                           "fdl_event_destroy", "fdl_memcpy_h2d_async", "fdl_memcpy_h2d_many",
                           "fdl_memcpy_h2d_many_pinned", "fdl_memcpy_d2h_async"})
ABI_VERSION = 15  # fdl_ops_abi_version() of the sources this module speaks to (7: MoE ops; 8: fdl_add_; 9: FP8 KV;
#                  10: fdl_memcpy_h2d_many_pinned; 11: attn_mma 0 / 1 / 2; 12: decode_mma; 13: moe_experts' shared;
#                  14: paged attention's graph_tokens / max_kv_len; 15: decode_split_keys)


def load(path: str | None = None) -> str:
    """Register the ops library (building it if needed); returns its path. Idempotent."""
    with _lock:
        if "path" in _state:
            return _state["path"]
        if path is None:
            from fdlite.kernels import build  # noqa: PLC0415

            path = build.build()
        try:
            capi = native.load_ctypes(path, CAPI_SIGNATURES, CAPI_KEEP_GIL)
        except AttributeError as e:
            raise GpuOpsError(f"{path} is older than fdlite/kernels/gpu.py ({e}): rebuild it") from None
        if capi.fdl_ops_abi_version() != ABI_VERSION:
            raise GpuOpsError(f"{path}: ABI version {capi.fdl_ops_abi_version()}, this module speaks {ABI_VERSION}: "
                              "rebuild it")
        run = native.load_paddle_ops(path)
        _apply_options(capi)  # before any op runs
        _state.update(path=path, run=run, capi=capi)
        return path


def _apply_options(capi, pdl: int | None = None, gemv: bool | None = None, attn_mma: int | None = None,
                   decode_mma: bool | None = None, decode_split_keys: int | None = None) -> None:
    """The library's switches: the given values, the rest from fdlite/envs.py."""
    vals = (envs.FDLITE_PDL if pdl is None else pdl, int(envs.FDLITE_GEMV if gemv is None else gemv),
            int(envs.FDLITE_ATTN_MMA if attn_mma is None else attn_mma),
            int(envs.FDLITE_DECODE_MMA if decode_mma is None else decode_mma),
            int(envs.FDLITE_DECODE_SPLIT_KEYS if decode_split_keys is None else decode_split_keys))
    rc = capi.fdl_set_options(*vals)
    if rc == 2:
        raise GpuOpsError(f"fdl_set_options refused decode_split_keys={vals[4]} (FDLITE_DECODE_SPLIT_KEYS: 0 or a multiple of "
                          "64 up to 4096)")
    if rc:
        raise GpuOpsError(f"fdl_set_options refused pdl={vals[0]}, attn_mma={vals[2]} (FDLITE_PDL and FDLITE_ATTN_MMA: "
                          "0, 1 or 2)")


def set_options(pdl: int | None = None, gemv: bool | None = None, attn_mma: int | None = None,
                decode_mma: bool | None = None, decode_split_keys: int | None = None) -> None:
    """Change the ops library's switches after load (None keeps the value from fdlite/envs.py). Launches after
    the call follow it; captured graphs keep what they captured. For side-by-side measurements in one process."""
    load()
    _apply_options(_state["capi"], pdl, gemv, attn_mma, decode_mma, decode_split_keys)


def _run(name: str, *args):
    if "run" not in _state:
        load()
    return _state["run"](name, *args)


def capi() -> ctypes.CDLL:
    """The library's plain C entry points (events, copies); see ops_capi.cu."""
    if "capi" not in _state:
        load()
    return _state["capi"]


# ------------------------------------------------------------------ checks
try:  # True while SOT translates the caller (Paddle's own marker), False when it runs
    from paddle.jit.sot.psdb import in_sot as _in_sot
except ImportError:  # a Paddle without SOT
    def _in_sot() -> bool:
        return False


def _dtype(t) -> str:
    d = t.dtype
    name = _dtype_names.get(d)
    if name is None:
        name = _dtype_names[d] = str(d).replace("paddle.", "")
    return name


def _check(t, name: str, dtypes=None, ndim: int | None = None) -> None:
    if not _checks or _in_sot():  # SOT simulates tensors: their place is not a value it can give
        return
    if not t.place.is_gpu_place():
        raise GpuOpsError(f"{name} must be on the GPU, got {t.place}")
    if not t.is_contiguous():
        raise GpuOpsError(f"{name} must be contiguous (a column slice or transpose is not; Paddle's own "
                          "contiguous() does nothing on sm_90)")
    if dtypes is not None and _dtype(t) not in dtypes:
        raise GpuOpsError(f"{name} must be one of {dtypes}, got {_dtype(t)}")
    if ndim is not None and len(t.shape) != ndim:
        raise GpuOpsError(f"{name} must be {ndim}-D, got shape {list(t.shape)}")


# ------------------------------------------------------------------ (a) fill / cast / copy / gather
def fill_(x, value) -> None:
    """x[...] = value, in place (float and int32/int64/bool tensors)."""
    _check(x, "x")
    _run("fdl_fill_", x, float(value), int(value) if not isinstance(value, float) or value.is_integer() else 0)


def cast_(dst, src) -> None:
    """dst = src converted to dst's dtype (float32/float16/bfloat16/int32/int64), in place."""
    _check(dst, "dst")
    _check(src, "src")
    if _checks and int(np.prod(dst.shape)) != int(np.prod(src.shape)):
        raise GpuOpsError(f"cast_: sizes differ: {list(dst.shape)} vs {list(src.shape)}")
    _run("fdl_cast_", dst, src)


def cast(x, dtype: str):
    import paddle  # noqa: PLC0415

    out = paddle.empty(x.shape, dtype=dtype)
    cast_(out, x)
    return out


def copy_(dst, src) -> None:
    """dst = src (same dtype and size) on dst's stream; src may be a host tensor (pinned inside a capture)."""
    if _checks:
        _check(dst, "dst")
        if not src.is_contiguous():
            raise GpuOpsError("src must be contiguous")
        if _dtype(dst) != _dtype(src) or int(np.prod(dst.shape)) != int(np.prod(src.shape)):
            raise GpuOpsError("copy_: dtype or size mismatch")
    _run("fdl_copy_", dst, src)


def add_(dst, src) -> None:
    """dst += src elementwise (same float dtype and size), summed in float32 and rounded once, as Paddle's add."""
    if _checks:
        _check(dst, "dst", FLOAT_DTYPES)
        _check(src, "src", (_dtype(dst),))
        if int(np.prod(dst.shape)) != int(np.prod(src.shape)):
            raise GpuOpsError(f"add_: sizes differ: {list(dst.shape)} vs {list(src.shape)}")
    _run("fdl_add_", dst, src)


def current_stream_handle() -> int:
    """The cudaStream_t of Paddle's current stream (what our ops launch on: `x.stream()` in C++)."""
    import paddle  # noqa: PLC0415

    get = getattr(paddle.base.core, "_get_current_stream", None)  # what paddle.device.current_stream() calls, 3x cheaper
    if get is not None:
        return get(paddle.framework._current_expected_place().get_device_id()).cuda_stream
    return paddle.device.current_stream().stream_base.cuda_stream


def copy_from_host(dst, values: np.ndarray) -> None:
    """dst[...] = values (host numpy, dst's dtype and size) on the current stream through ctypes, no Paddle op and
    no host tensor; small copies are staged through pinned memory (`PinnedUploads`), so the call never waits for
    the stream."""
    a = np.ascontiguousarray(values)
    if _checks:
        _check(dst, "dst")
        if a.nbytes != int(np.prod(dst.shape)) * dst.element_size():
            raise GpuOpsError(f"copy_from_host: {a.nbytes} bytes for a {list(dst.shape)} {_dtype(dst)} tensor")
    if a.nbytes:
        copy_from_host_many([dst.data_ptr()], [a.ctypes.data], [a.nbytes])


def upload(values, dtype):
    """A new device tensor holding host `values` as numpy `dtype`, queued without waiting for the stream:
    `paddle.empty` and one copy through a pinned slot (`copy_from_host`).
    Paddle 2.6's `paddle.to_tensor` copies synchronously, which holds the step thread until the GPU has drained;
    with async scheduling the next step then waits for that thread (and for the GIL) before it is launched. The
    sampler's per-step row parameters come through here."""
    import paddle  # noqa: PLC0415

    a = np.ascontiguousarray(values, dtype=dtype)
    t = paddle.empty(list(a.shape), dtype=a.dtype.name)
    copy_from_host(t, a)
    return t


def copy_from_host_many(dst_ptrs: list[int], src_ptrs: list[int], nbytes: list[int]) -> None:
    """Host -> device copies dst_ptrs[i] <- src_ptrs[i] (nbytes[i] each) on the current stream, in one ctypes
    call: the runner's step inputs (`runner/forward_buffers.py`), the sampler's row parameters. Sources may be
    reused on return. Up to `PinnedUploads.MAX_BYTES` in all they go through a pinned slot (`PinnedUploads`: the
    call does not wait for the stream); larger ones (weights) straight from the sources."""
    n = len(dst_ptrs)
    table = (ctypes.c_uint64 * (3 * n))(*dst_ptrs, *src_ptrs, *nbytes)
    total = sum(nbytes)
    if total <= PinnedUploads.MAX_BYTES:
        _uploads.copy(n, table, total + 16 * n)
        return
    rc = capi().fdl_memcpy_h2d_many(n, table, current_stream_handle())
    if rc:
        raise GpuOpsError(f"cudaMemcpyAsync host to device failed: error {rc}")


class PinnedUploads:
    """Host -> device copies staged through pinned memory: a ring of `depth` page-locked slots, each reused once the
    copies that read it have run (its event). Owned by this module (`copy_from_host_many`); thread-safe (the step
    thread and the engine's thread both upload).

    Why: a cudaMemcpyAsync from pageable memory may wait for the stream to drain before it returns (the runtime
    stages it); with async scheduling the next step's input copy then holds the step thread until the GPU has
    finished the step before, and the GPU idles while that step is launched (H100, batch 1: execute took 1.12 of
    the 1.15 ms period). The slots are small (a step's changed input ranges); 16 of them outlast the one step in
    flight by far, so waiting for a slot's event returns at once in practice."""

    MAX_BYTES = 4 << 20

    def __init__(self, depth: int = 16):
        self._slots = [[None, 0, None] for _ in range(depth)]  # [pinned pointer, capacity in bytes, event]
        self._next = 0
        self._lock = threading.Lock()

    def copy(self, n: int, table, need: int) -> None:
        lib = capi()
        with self._lock:
            slot = self._slots[self._next]
            self._next = (self._next + 1) % len(self._slots)
            if slot[2] is None:
                slot[2] = lib.fdl_event_create()
            else:
                lib.fdl_event_synchronize(slot[2])  # the copies that last read this slot have run
            if slot[1] < need:
                if slot[0]:
                    lib.fdl_host_free(slot[0])
                size = max(need, 1 << 14)
                slot[0], slot[1] = lib.fdl_host_alloc(size), size
                if not slot[0]:
                    slot[1] = 0
                    raise GpuOpsError(f"cudaHostAlloc of {size} bytes failed")
            rc = lib.fdl_memcpy_h2d_many_pinned(n, table, current_stream_handle(), slot[0], slot[1], slot[2])
        if rc:
            raise GpuOpsError(f"cudaMemcpyAsync host to device failed: error {rc}")


_uploads = PinnedUploads()


def gather_rows(src, index, offset: int = 0, out=None):
    """out[i] = src[index[i] - offset], zeros where that row is outside src (vocab-parallel shards)."""
    _check(src, "src")
    _check(index, "index", ("int32", "int64"))
    if out is None:
        return _run("fdl_gather_rows", src, index, int(offset))[0]
    _check(out, "out")
    _run("fdl_gather_rows_", out, src, index, int(offset))
    return out


def embedding(ids, weight, vocab_start: int = 0, out=None):
    """Rows of weight [vocab_shard, hidden] for ids [T]; ids outside this shard give zeros."""
    return gather_rows(weight, ids, vocab_start, out)


# ------------------------------------------------------------------ (b) norms, activation
def rms_norm(x, weight, eps: float):
    _check(x, "x", FLOAT_DTYPES)
    _check(weight, "weight", (_dtype(x),))
    return _run("fdl_rms_norm", x, weight, float(eps))[0]


def fused_add_rms_norm_(x, residual, weight, eps: float) -> None:
    """In place: residual = x + residual; x = rms_norm(residual) * weight (vLLM's fused_add_rms_norm)."""
    _check(x, "x", FLOAT_DTYPES)
    _check(residual, "residual", (_dtype(x),))
    _check(weight, "weight", (_dtype(x),))
    _run("fdl_fused_add_rms_norm_", x, residual, weight, float(eps))


def silu_and_mul(x):
    """[..., 2I] -> [..., I]: silu(gate) * up."""
    _check(x, "x", FLOAT_DTYPES)
    return _run("fdl_silu_and_mul", x)[0]


# ------------------------------------------------------------------ (c) linear
def linear(x, weight, bias=None, trans_w: bool = False, out=None, static_w: bool = False):
    """x [..., K] @ weight [K, N] (+ bias [N]); trans_w: weight is [N, K] (fdlite's GPU Linear layout, or a
    tied embedding). With trans_w and at most 4 rows, a GEMV kernel runs instead of cuBLASLt.

    out: a preallocated [M, N] tensor of x's dtype or float32 (e.g. logits). static_w: no kernel still in
    flight writes `weight` (model weights), so the GEMV may read it before the previous kernel ends."""
    _check(x, "x", FLOAT_DTYPES)
    _check(weight, "weight", (_dtype(x),), ndim=2)
    has_bias = bias is not None
    if has_bias:
        _check(bias, "bias", (_dtype(x),))
    b = bias if has_bias else weight
    if out is None:
        return _run("fdl_linear", x, weight, b, bool(trans_w), has_bias, bool(static_w))[0]
    _check(out, "out", (_dtype(x), "float32"))
    _run("fdl_linear_", out, x, weight, b, bool(trans_w), has_bias, bool(static_w))
    return out


# ------------------------------------------------------------------ (d) rotary + q/k norm + cache write
def rope_qk_norm_cache(qkv, positions, slot_mapping, cos, sin, k_cache, v_cache, num_heads: int,
                       q_norm_weight=None, k_norm_weight=None, eps: float = 1e-6):
    """qkv [T, (h + 2 kvh) d] -> q [T, h, d] rotated (after the optional per-head q/k RMSNorm);
    k (rotated) and v written into the caches [blocks + 1, kvh, block_size, d] at slot_mapping
    (negative slots write nothing)."""
    _check(k_cache, "k_cache", (_dtype(qkv),), ndim=4)
    _check(v_cache, "v_cache", (_dtype(qkv),), ndim=4)
    qw, kw, norm = _rope_inputs(qkv, positions, slot_mapping, cos, sin, q_norm_weight, k_norm_weight)
    return _run("fdl_rope_qk_norm_cache", qkv, positions, slot_mapping, cos, sin, qw, kw, k_cache, v_cache,
                int(num_heads), norm, float(eps))[0]


def _check_fp8(op: str, x, k_data, v_data, k_scale, v_scale) -> None:
    """FP8 caches (fdlite/kvcache/fp8_cache.py): uint8 e4m3 bits, float32 scales per cache row; bf16 / fp16 models
    at head_dim 64 / 128 (the kernels' instantiations)."""
    if not _checks:
        return
    _check(k_data, "k_cache", ("uint8",), ndim=4)
    _check(v_data, "v_cache", ("uint8",), ndim=4)
    _check(k_scale, "k_scale", ("float32",), ndim=3)
    _check(v_scale, "v_scale", ("float32",), ndim=3)
    d = k_data.shape[-1]
    if _dtype(x) not in ("bfloat16", "float16") or d not in (64, 128):
        raise GpuOpsError(f"{op}: kv_cache_dtype='fp8' on the GPU takes bf16 / fp16 models at head_dim 64 or 128, "
                          f"got {_dtype(x)} at head_dim {d}")
    if list(k_scale.shape) != list(k_data.shape[:3]) or list(v_scale.shape) != list(v_data.shape[:3]):
        raise GpuOpsError(f"{op}: scales {list(k_scale.shape)} must be the caches' first three dims {list(k_data.shape[:3])}")


def rope_qk_norm_cache_fp8(qkv, positions, slot_mapping, cos, sin, k_cache, v_cache, num_heads: int,
                           q_norm_weight=None, k_norm_weight=None, eps: float = 1e-6):
    """`rope_qk_norm_cache` into FP8 caches (`Fp8Cache`s): k / v rounded to the model dtype, then e4m3 bits of
    value / scale with scale = amax / 448 per (token, KV head) written beside them."""
    _check_fp8("rope_qk_norm_cache_fp8", qkv, k_cache.data, v_cache.data, k_cache.scale, v_cache.scale)
    qw, kw, norm = _rope_inputs(qkv, positions, slot_mapping, cos, sin, q_norm_weight, k_norm_weight)
    return _run("fdl_rope_qk_norm_cache_fp8", qkv, positions, slot_mapping, cos, sin, qw, kw, k_cache.data,
                v_cache.data, k_cache.scale, v_cache.scale, int(num_heads), norm, float(eps))[0]


def _rope_inputs(qkv, positions, slot_mapping, cos, sin, q_norm_weight, k_norm_weight):
    """The rotary ops' checks of everything but the caches; (q norm weight, k norm weight, qk_norm) as the op takes
    them (any GPU tensor for the weights without a norm)."""
    _check(qkv, "qkv", FLOAT_DTYPES, ndim=2)
    _check(positions, "positions", ("int64",))
    _check(slot_mapping, "slot_mapping", ("int64",))
    _check(cos, "cos", ("float32", _dtype(qkv)), ndim=2)
    _check(sin, "sin", (_dtype(cos),), ndim=2)
    norm = q_norm_weight is not None
    if norm:
        _check(q_norm_weight, "q_norm_weight", (_dtype(qkv),))
        _check(k_norm_weight, "k_norm_weight", (_dtype(qkv),))
    return (q_norm_weight if norm else cos), (k_norm_weight if norm else cos), norm


# ------------------------------------------------------------------ (e) paged attention
def paged_attention(q, k_cache, v_cache, block_tables, seq_lens_kv, cu_seqlens_q, scale: float,
                    max_q_len: int = 0, num_splits: int = 0, graph_tokens: int = 0, max_kv_len: int = 0):
    """q [T, h, d] over the paged caches -> [T, h * d]; see ops_attention.cu for the batch layout.

    max_q_len: known bound on any row's query length (1 in decode-only graphs), 0 = unknown.
    num_splits: KV splits for the per-token kernel, 0 = from the shapes.
    graph_tokens, max_kv_len: the padded token count of the CUDA graph the step runs in (or would: eager steps pass
    it too) and a row's longest KV (max_model_len), which choose the kernel and KV splits of each row in place of T
    and the block tables' width, so that eager and replayed steps give the same bits; 0 = this call's."""
    _check(q, "q", FLOAT_DTYPES, ndim=3)
    if _checks and q.shape[-1] not in HEAD_DIMS:
        raise GpuOpsError(f"paged_attention: head_dim {q.shape[-1]} has no GPU kernel (head_dim {HEAD_DIMS})")
    _check(k_cache, "k_cache", (_dtype(q),), ndim=4)
    _check(v_cache, "v_cache", (_dtype(q),), ndim=4)
    _check(block_tables, "block_tables", ("int32",), ndim=2)
    _check(seq_lens_kv, "seq_lens_kv", ("int32",))
    _check(cu_seqlens_q, "cu_seqlens_q", ("int32",))
    return _run("fdl_paged_attention", q, k_cache, v_cache, block_tables, seq_lens_kv, cu_seqlens_q, float(scale),
                int(max_q_len), int(num_splits), int(graph_tokens), int(max_kv_len))[0]


def paged_attention_fp8(q, k_cache, v_cache, block_tables, seq_lens_kv, cu_seqlens_q, scale: float,
                        max_q_len: int = 0, num_splits: int = 0, graph_tokens: int = 0, max_kv_len: int = 0):
    """`paged_attention` over FP8 caches (`Fp8Cache`s: e4m3 bits and a scale per row, multiplied in after
    widening)."""
    _check(q, "q", FLOAT_DTYPES, ndim=3)
    _check_fp8("paged_attention_fp8", q, k_cache.data, v_cache.data, k_cache.scale, v_cache.scale)
    _check(block_tables, "block_tables", ("int32",), ndim=2)
    _check(seq_lens_kv, "seq_lens_kv", ("int32",))
    _check(cu_seqlens_q, "cu_seqlens_q", ("int32",))
    return _run("fdl_paged_attention_fp8", q, k_cache.data, v_cache.data, k_cache.scale, v_cache.scale, block_tables,
                seq_lens_kv, cu_seqlens_q, float(scale), int(max_q_len), int(num_splits), int(graph_tokens),
                int(max_kv_len))[0]


# ------------------------------------------------------------------ (f) logits and sampling
def lm_head_logits(hidden, rows, weight, trans_w: bool = False, out=None, static_w: bool = False):
    """Float32 logits [S, V] for the rows that sample: gather `rows` of hidden, then the LM head
    (static_w as in `linear`)."""
    import paddle  # noqa: PLC0415

    picked = gather_rows(hidden, rows)
    n = weight.shape[0] if trans_w else weight.shape[1]
    if out is None:
        out = paddle.empty([picked.shape[0], n], dtype="float32")
    return linear(picked, weight, None, trans_w, out=out, static_w=static_w)


def argmax(logits):
    """[S, V] float32 -> [S] int64 (first index of the maximum)."""
    _check(logits, "logits", ("float32",), ndim=2)
    return _run("fdl_argmax", logits)[0]


def sample(logits, temperature, top_k, top_p, min_p, seeds, positions):
    """One token per row of float32 logits [S, V]; per-row tensors [S]: temperature/top_p/min_p
    float32, top_k int32, seeds/positions int64. See ops_sampling.cu / sampling_ref.py for the rule."""
    _check(logits, "logits", ("float32",), ndim=2)
    for t, n, d in ((temperature, "temperature", "float32"), (top_k, "top_k", "int32"), (top_p, "top_p", "float32"),
                    (min_p, "min_p", "float32"), (seeds, "seeds", "int64"), (positions, "positions", "int64")):
        _check(t, n, (d,))
    return _run("fdl_sample", logits, temperature, top_k, top_p, min_p, seeds, positions)[0]


# ------------------------------------------------------------------ (g) logits processors (ops_logits.cu)
def apply_penalties_(logits, rows, slots, counts, prompt, rep, freq, pres):
    """Repetition / frequency / presence penalties on rows `rows` of float32 logits [R, V], in place; row p
    reads the token tables' row slots[p] (counts [S, V] float32, prompt [S, V] uint8). rows/slots int64 [P],
    rep/freq/pres float32 [P]. The CPU sampler's arithmetic, bit for bit (ops_logits.cu)."""
    _check(logits, "logits", ("float32",), ndim=2)
    for t, n in ((rows, "rows"), (slots, "slots")):
        _check(t, n, ("int64",))
    _check(counts, "counts", ("float32",), ndim=2)
    _check(prompt, "prompt", ("uint8",), ndim=2)
    for t, n in ((rep, "rep"), (freq, "freq"), (pres, "pres")):
        _check(t, n, ("float32",))
    _run("fdl_apply_penalties_", logits, rows, slots, counts, prompt, rep, freq, pres)


def scatter_(dst, rows, cols, values, add: bool = False):
    """dst[rows[i], cols[i]] = values[i] (or += with add; float32 dst only), in place: dst [N, V] float32 or
    uint8, rows/cols int64 [K], values float32 [K]."""
    _check(dst, "dst", ("float32", "uint8"), ndim=2)
    for t, n in ((rows, "rows"), (cols, "cols")):
        _check(t, n, ("int64",))
    _check(values, "values", ("float32",))
    _run("fdl_scatter_", dst, rows, cols, values, bool(add))


def apply_bitmask_(logits, rows, mask):
    """-inf into float32 logits [R, V] wherever the row's bit is 0: rows int64 [C], mask int32 [C, ceil(V / 32)]
    (bit j of word i is token 32 i + j), in place."""
    _check(logits, "logits", ("float32",), ndim=2)
    _check(rows, "rows", ("int64",))
    _check(mask, "mask", ("int32",), ndim=2)
    _run("fdl_apply_bitmask_", logits, rows, mask)


def logprobs(logits, rows, targets, target_of, k: int):
    """Raw logprobs of rows `rows` of float32 logits [N, V] at targets[target_of[a]], with their ranks and the
    top-k (0 <= k <= 20): int32 [M + A (2 + 2k)], the targets [M] first (ops_logprobs.cu; read it back with
    fdlite.sample.logprobs.unpack). rows / targets / target_of int64."""
    _check(logits, "logits", ("float32",), ndim=2)
    for t, n in ((rows, "rows"), (targets, "targets"), (target_of, "target_of")):
        _check(t, n, ("int64",))
    return _run("fdl_logprobs", logits, rows, targets, target_of, int(k))[0]


# ------------------------------------------------------------------ (h) mixture of experts (ops_moe*.cu)
MOE_MAX_EXPERTS = 1024
# 0: the kernels choose (128, the wgmma kernels, for bf16 / fp16 on an sm_90 GPU; else 16 while experts average
# at most 16 rows, then 64); 128 forced needs bf16 / fp16 on sm_90
MOE_BLOCK_M = (0, 16, 64, 128)


def moe_route(logits, top_k: int, renormalize: bool, norm_min: float = 0.0, correction_bias=None,
              balanced: bool = False):
    """Router logits [T, E] (the gate's dtype) -> (ids [T, top_k] int32, weights [T, top_k] float32): fp32 softmax,
    the top_k of the scores (+ correction_bias [E] or [1, E] float32, for choosing only; equal values to the lower
    id), weights the plain scores, divided by their sum (floored at norm_min > 0) with renormalize. balanced: the
    profiling run's round-robin routing (`fdlite.layers.moe.balanced_routing`). See ops_moe_route.cu."""
    _check(logits, "logits", FLOAT_DTYPES, ndim=2)
    if _checks:
        e = logits.shape[1]
        if not 1 <= e <= MOE_MAX_EXPERTS or not 1 <= int(top_k) <= e:
            raise GpuOpsError(f"moe_route: need 1 <= top_k ({top_k}) <= E ({e}) <= {MOE_MAX_EXPERTS}")
    has_bias = correction_bias is not None
    if has_bias:
        _check(correction_bias, "correction_bias", ("float32",))
        if _checks and int(np.prod(correction_bias.shape)) != logits.shape[1]:
            raise GpuOpsError(f"moe_route: correction_bias has {list(correction_bias.shape)}, want E = {logits.shape[1]}")
    return tuple(_run("fdl_moe_route", logits, correction_bias if has_bias else logits, int(top_k), bool(renormalize),
                      float(norm_min), has_bias, bool(balanced)))


def _check_block_m(block_m: int) -> None:
    if _checks and block_m not in MOE_BLOCK_M:
        raise GpuOpsError(f"block_m must be one of {MOE_BLOCK_M}, got {block_m}")


def moe_align(ids, num_experts: int, block_m: int = 0):
    """(sorted_rows, tile_expert) int32 for ids [T, k] int32: the choices t k + j sorted by expert, each expert's
    rows padded with -1 to a multiple of the M tile, and each tile's expert (-1 past the last). What
    `moe_experts` does first; for checks (ops_moe.cu, moe_align.cuh)."""
    _check(ids, "ids", ("int32",), ndim=2)
    _check_block_m(block_m)
    if _checks and not 1 <= num_experts <= MOE_MAX_EXPERTS:
        raise GpuOpsError(f"moe_align: num_experts must be in [1, {MOE_MAX_EXPERTS}], got {num_experts}")
    return tuple(_run("fdl_moe_align", ids, int(num_experts), int(block_m)))


def moe_experts(x, ids, weights, w13, w2, block_m: int = 0, shared=None):
    """The routed experts: out [T, H] = sum over j of weights[t, j] * expert ids[t, j]'s SwiGLU MLP of x[t].
    x [T, H]; ids [T, k] int32, weights [T, k] float32 (`moe_route`); w13 [E, 2I, H] (each expert's gate rows
    then up rows) and w2 [E, H, I]: [E, out, in], x's dtype; H and I multiples of 8. block_m: the GEMMs' M tile
    (`MOE_BLOCK_M`; side-by-side measurements and checks force one). shared: None, or [T, H] in x's dtype added
    to the fp32 sum before its one rounding (the shared experts' output, with no add pass of its own). See
    ops_moe.cu."""
    _check(x, "x", FLOAT_DTYPES, ndim=2)
    _check(ids, "ids", ("int32",), ndim=2)
    _check(weights, "weights", ("float32",), ndim=2)
    _check(w13, "w13", (_dtype(x),), ndim=3)
    _check(w2, "w2", (_dtype(x),), ndim=3)
    _check_block_m(block_m)
    if _checks:
        t, h = x.shape
        e, i2, h13 = w13.shape
        if (list(ids.shape) != list(weights.shape) or ids.shape[0] != t or h13 != h or i2 % 2
                or list(w2.shape) != [e, h, i2 // 2]):
            raise GpuOpsError(f"moe_experts: shapes x {list(x.shape)}, ids {list(ids.shape)}, weights "
                              f"{list(weights.shape)}, w13 {list(w13.shape)}, w2 {list(w2.shape)}: want x [T, H], ids "
                              "and weights [T, k], w13 [E, 2I, H], w2 [E, H, I]")
        if h % 8 or (i2 // 2) % 8 or not i2:
            raise GpuOpsError(f"moe_experts: the hidden size ({h}) and expert width ({i2 // 2}) must be multiples of 8")
        if not 1 <= e <= MOE_MAX_EXPERTS:
            raise GpuOpsError(f"moe_experts: at most {MOE_MAX_EXPERTS} experts, got {e}")
    has_shared = shared is not None
    if has_shared:
        _check(shared, "shared", (_dtype(x),), ndim=2)
        if _checks and list(shared.shape) != list(x.shape):
            raise GpuOpsError(f"moe_experts: shared is {list(shared.shape)}, want x's shape {list(x.shape)}")
    return _run("fdl_moe_experts", x, ids, weights, w13, w2, shared if has_shared else x, int(block_m), has_shared)[0]


def to_host(x) -> np.ndarray:
    """A device tensor's values on the host (a blocking copy): every device-to-host copy of the sampler goes
    through here or `PinnedCopies`, so the emulated GPU path can count them."""
    return x.numpy()


class PinnedCopies:
    """Device -> host copies that do not block: each goes into one of a few pinned host buffers (a ring: at most
    `depth - 1` copies may be waited for later) with an event after it. Owned by the GPU sampler."""

    def __init__(self, depth: int = 3):
        self._slots = [[None, 0, None] for _ in range(depth)]  # [pinned pointer, capacity in bytes, event]
        self._next = 0

    def start(self, x) -> "PendingCopy":
        """Start copying device tensor `x` (contiguous) to the host; the values come from `.wait()`."""
        slot = self._slots[self._next]
        self._next = (self._next + 1) % len(self._slots)
        nbytes = int(np.prod(x.shape)) * x.element_size()
        lib = capi()
        if slot[1] < nbytes:
            if slot[0]:
                lib.fdl_host_free(slot[0])
            slot[0], slot[1] = lib.fdl_host_alloc(max(nbytes, 1 << 16)), max(nbytes, 1 << 16)
            if not slot[0]:
                raise GpuOpsError(f"cudaHostAlloc of {slot[1]} bytes failed")
        if slot[2] is None:
            slot[2] = lib.fdl_event_create()
        rc = lib.fdl_memcpy_d2h_async(slot[0], x.data_ptr(), nbytes, current_stream_handle(), slot[2])
        if rc:
            raise GpuOpsError(f"cudaMemcpyAsync device to host failed: error {rc}")
        return PendingCopy(slot[0], slot[2], nbytes, np.dtype(_dtype(x)), tuple(x.shape))

    def close(self) -> None:
        lib = capi()
        for slot in self._slots:
            if slot[0]:
                lib.fdl_host_free(slot[0])
            if slot[2] is not None:
                lib.fdl_event_destroy(slot[2])
        self._slots = [[None, 0, None] for _ in self._slots]


class PendingCopy:
    """One `PinnedCopies.start`: `.wait()` blocks until the copy is done and returns the values (a numpy copy)."""

    def __init__(self, ptr, event, nbytes: int, dtype, shape):
        self._ptr, self._event, self._nbytes, self._dtype, self._shape = ptr, event, nbytes, dtype, shape

    def wait(self) -> np.ndarray:
        rc = capi().fdl_event_synchronize(self._event)
        if rc:
            raise GpuOpsError(f"cudaEventSynchronize failed: error {rc}")
        raw = (ctypes.c_char * self._nbytes).from_address(self._ptr)
        return np.frombuffer(raw, dtype=self._dtype).reshape(self._shape).copy()


def uniform(seeds, positions, round_: int = 0):
    """The sampler's noise u(seed, position, round) as float32 [S] (fdlite.sample.random.uniforms, float32, on the GPU)."""
    _check(seeds, "seeds", ("int64",))
    _check(positions, "positions", ("int64",))
    return _run("fdl_uniform", seeds, positions, int(round_))[0]


__all__ = ["load", "capi", "GpuOpsError", "set_checks", "fill_", "cast_", "cast", "copy_", "copy_from_host",
           "current_stream_handle", "gather_rows", "embedding", "rms_norm",
           "fused_add_rms_norm_", "silu_and_mul", "linear", "rope_qk_norm_cache", "paged_attention",
           "lm_head_logits", "argmax", "sample", "uniform", "apply_penalties_", "scatter_", "apply_bitmask_", "logprobs",
           "moe_route", "moe_align", "moe_experts", "to_host", "add_", "upload", "rope_qk_norm_cache_fp8",
           "paged_attention_fp8"]
