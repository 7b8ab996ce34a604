"""The ``fused`` datapath chained over K in C (fp8ref/_kernels_hw.c), on whole batches of tiles.

Same integers as ``fdpa.fused_step`` (the C file says why every step is exact); used only where
its preconditions hold: f32 accumulator normalised toward zero, no FP16 output, power-of-two
(UE8M0) block scales one per step, and finite operands, scales and C. Anything else (NaN/Inf
inputs, ``grouped``/``pairwise`` datapaths, f16) returns None and the numpy model runs.
"""

from __future__ import annotations

from functools import cache

import numpy as np

from .._native import hw_job, kernels, parallel, threads
from ..formats import FloatFormat
from .fdpa import value_fields
from .isa import Instruction

_OUT_BITS = {"rz-e8m13": 13, "rz-f32": 23}
_PARALLEL_MIN = 1 << 22  # products below which one thread beats the hand-off


@cache
def _tables(fmt: FloatFormat) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(fp32 value, int32 alignment exponent, finite?) per code; FP8/6/4 values are fp32-exact."""
    v, e = value_fields(fmt)
    finite = np.isfinite(v)
    return np.where(finite, v, 0).astype(np.float32), e.astype(np.int32), finite


def _finite_codes(codes: np.ndarray, fmt: FloatFormat) -> bool:
    finite = _tables(fmt)[2]
    return bool(finite.all() or finite[codes].all())


def applies(ins: Instruction) -> bool:
    dp = ins.datapath
    return (kernels() is not None and dp.family == "fused" and ins.acc == "float32" and dp.output in _OUT_BITS
            and (ins.scale_fmt is None or (ins.scale_type == "ue8m0" and ins.block == dp.L)))


def fused_matmul(ins: Instruction, A, B, C, SA=None, SB=None) -> np.ndarray | None:
    """D for A (..., M, K), B (..., K, N) codes, C (..., M, N) float32, scales SA (..., M, K/L),
    SB (..., K/L, N) UE8M0 codes: the instruction chained over K from C. None where it does not
    apply (then the caller runs the numpy model)."""
    if not applies(ins):
        return None
    if not (_finite_codes(A, ins.a_fmt) and _finite_codes(B, ins.b_fmt) and np.isfinite(C).all()):
        return None
    if SA is not None and not (_finite_codes(SA, ins.scale_fmt) and _finite_codes(SB, ins.scale_fmt)):
        return None
    dp = ins.datapath
    M, K = A.shape[-2:]
    N = B.shape[-1]
    L = min(K, dp.L)
    batch = A.shape[:-2]
    nb = int(np.prod(batch, dtype=np.int64))
    va, ea, _ = _tables(ins.a_fmt)
    vb, eb, _ = _tables(ins.b_fmt)
    arrays = [va[A], ea[A], vb[B], eb[B]]
    if SA is not None:
        _, es, _ = _tables(ins.scale_fmt)
        arrays += [es[SA], es[SB]]
    else:
        arrays += [None, None]
    D = np.array(C, np.float32, order="C", copy=True)

    def ptr(x):
        return None if x is None else x.ctypes.data

    by_batch = nb >= threads()  # enough batches for every thread, else panels of 16 columns of each
    panel = 16
    job = hw_job(*[ptr(x) for x in arrays], D.ctypes.data, M, N, K, L, dp.F, _OUT_BITS[dp.output], dp.e_zero,
                 int(SA is not None or dp.e_zero > ins.a_fmt.emin + ins.b_fmt.emin), int(by_batch), nb, panel)
    work = nb * M * N * K
    # on the threads torch's ops use (OpenMP) where torch is loaded; one call below the threshold
    parallel("fp8ref_hw_fused_task", job, nb if by_batch else -(-N // panel), work=work,
             split=None if work >= _PARALLEL_MIN else 1, keep=(arrays, D))
    del arrays
    return D
