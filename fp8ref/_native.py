"""The optional C loops (fp8ref/_kernels.c), loaded through ctypes, and a helper that splits a loop
across cores. ctypes releases the GIL during each call, so plain threads run in parallel.
``FP8REF_NO_KERNELS=1`` disables them (the numpy paths then run)."""

from __future__ import annotations

import ctypes
import os
import warnings
from concurrent.futures import ThreadPoolExecutor

import numpy as np

_PARALLEL_MIN = 1 << 20  # elements below which one C call beats the thread hand-off
_MM_KC, _MM_NR = 256, 32  # k chunk and widest register panel of _kernels_matmul.c
_vp, _sz = ctypes.c_void_p, ctypes.c_size_t
_SIGNATURES = {
    "fp8ref_encode_f32": [_vp, _vp, _sz, _vp],
    "fp8ref_encode_f32_rne": [_vp, _vp, _sz, _vp],
    "fp8ref_gather_u16": [_vp, _vp, _sz, _vp],
    "fp8ref_gather_f32_rto16": [_vp, _vp, _sz, _vp],
    "fp8ref_decode_f32": [_vp, _vp, _sz, _vp],
    "fp8ref_quant_exact": [_vp, _sz, _sz, _vp],
    "fp8ref_quant_f32": [_vp, _sz, _sz, _vp],
    "fp8ref_amax_u16": [_vp, _vp] + [_sz] * 4,
    "fp8ref_amax_u32": [_vp, _vp] + [_sz] * 4,
    "fp8ref_mm_seq_f32": [_vp] * 9 + [_sz] * 9,
}


def _load():
    if os.environ.get("FP8REF_NO_KERNELS"):
        return None
    try:
        from . import _kernels
    except ImportError:
        return None
    lib = ctypes.CDLL(_kernels.__file__)
    missing = [name for name in _SIGNATURES if not hasattr(lib, name)]
    if missing:  # a build older than this source tree: run the numpy paths rather than crash
        warnings.warn(f"fp8ref: {_kernels.__file__} lacks {', '.join(missing)}; rebuild it with "
                      "`pip install -e .`. Using the numpy paths.", RuntimeWarning, stacklevel=2)
        return None
    for name, argtypes in _SIGNATURES.items():
        getattr(lib, name).argtypes = argtypes
        getattr(lib, name).restype = None
    return lib


KERNELS = _load()
_POOL: ThreadPoolExecutor | None = None


def kernels_available() -> bool:
    """True when the compiled C loops are in use (else the numpy paths run)."""
    return KERNELS is not None


def workers() -> int:
    return os.cpu_count() or 1


def pool() -> ThreadPoolExecutor:
    global _POOL
    if _POOL is None:
        _POOL = ThreadPoolExecutor(max_workers=workers(), thread_name_prefix="fp8ref")
    return _POOL


def run_c(func, src: np.ndarray, dst: np.ndarray, arg) -> None:
    """Call an elementwise C loop ``func(src, dst, n, arg)`` over flat contiguous arrays, split
    across cores for large inputs. ``arg`` is a ctypes Structure or a numpy table."""
    n = src.size
    arg_ptr = ctypes.addressof(arg) if isinstance(arg, ctypes.Structure) else arg.ctypes.data
    w = workers()
    if n < _PARALLEL_MIN or w == 1:
        func(src.ctypes.data, dst.ctypes.data, n, arg_ptr)
        return
    bounds = [n * i // w for i in range(w + 1)]
    jobs = [pool().submit(func, src[lo:hi].ctypes.data, dst[lo:hi].ctypes.data, hi - lo, arg_ptr)
            for lo, hi in zip(bounds, bounds[1:]) if hi > lo]
    for job in jobs:
        job.result()


def seq_acc_f32(A: np.ndarray, B: np.ndarray, tab_a, tab_b, sa, sb, block: int, bk: int,
                fused: bool = False) -> np.ndarray:
    """The declared-order fp32 model of fp8ref.matmul (see _kernels_matmul.c): A (M, K) and B (K, N)
    are float32 values, or uint8 codes when their value table ``tab_*`` (256 float32) is given;
    sa (M, KB) / sb (KB, N) float32 epilogue scales, or both None (blocks added unscaled); ``block``
    is the accumulation block length, ``bk`` the scale block length. ``fused``: the caller has
    proved every product exact in fp32, so a fused multiply-add gives the same bits. Column panels
    are split across cores; each output still adds in k order."""
    M, K = A.shape
    N = B.shape[1]
    total = np.empty((M, N), np.float32)
    part = np.empty((M, N), np.float32)
    KB = 1 if sa is None else sa.shape[1]
    w = workers() if M * N * max(K, 1) >= _PARALLEL_MIN else 1
    step = -(-N // (w * _MM_NR)) * _MM_NR  # whole register panels per thread
    cuts = [(n0, min(N, n0 + step)) for n0 in range(0, N, step)] or [(0, 0)]
    keep = [A, B, tab_a, tab_b, sa, sb]  # alive until the calls return

    def ptr(x):
        return None if x is None else x.ctypes.data

    def call(n0, n1):
        # packed A block (256 rows), packed B chunk (whole register panels), alignment slack
        scratch = np.empty(256 * _MM_KC + _MM_KC * -(-(n1 - n0) // _MM_NR) * _MM_NR + 16, np.float32)
        KERNELS.fp8ref_mm_seq_f32(*map(ptr, keep), total.ctypes.data, part.ctypes.data, scratch.ctypes.data,
                                  M, K, N, block, bk, KB, n0, n1, int(fused))

    for job in [pool().submit(call, n0, n1) for n0, n1 in cuts]:
        job.result()
    return total
