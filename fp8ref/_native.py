"""The optional C loops (fp8ref/_kernels.c), loaded through ctypes, and a helper that splits a loop
across cores. ctypes releases the GIL during each call, so plain threads run in parallel.
``FP8REF_NO_KERNELS=1`` disables them (the numpy paths then run)."""

from __future__ import annotations

import ctypes
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np

_PARALLEL_MIN = 1 << 20  # elements below which one C call beats the thread hand-off
_vp, _sz = ctypes.c_void_p, ctypes.c_size_t
_SIGNATURES = {
    "fp8ref_encode_f32": [_vp, _vp, _sz, _vp],
    "fp8ref_gather_u16": [_vp, _vp, _sz, _vp],
    "fp8ref_gather_f32_rto16": [_vp, _vp, _sz, _vp],
    "fp8ref_decode_f32": [_vp, _vp, _sz, _vp],
    "fp8ref_seq_acc_f32": [_vp, _vp, _vp] + [_sz] * 7,
}


def _load():
    if os.environ.get("FP8REF_NO_KERNELS"):
        return None
    try:
        from . import _kernels
    except ImportError:
        return None
    lib = ctypes.CDLL(_kernels.__file__)
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


def seq_acc_f32(A: np.ndarray, B: np.ndarray, k0: int, k1: int) -> np.ndarray:
    """part[m, n] = sequential fp32 sum over k in [k0, k1) of fp32(A[m, k] * B[k, n]) (see _kernels.c);
    columns are split across cores (each accumulator still adds in k order)."""
    M, K = A.shape
    N = B.shape[1]
    part = np.empty((M, N), np.float32)
    w = workers() if M * N * max(k1 - k0, 1) >= _PARALLEL_MIN else 1
    step = -(-N // w)
    cuts = [(n0, min(N, n0 + step)) for n0 in range(0, N, step)] or [(0, 0)]
    jobs = [pool().submit(KERNELS.fp8ref_seq_acc_f32, A.ctypes.data, B.ctypes.data, part.ctypes.data,
                          M, K, N, k0, k1, n0, n1) for n0, n1 in cuts]
    for job in jobs:
        job.result()
    return part
