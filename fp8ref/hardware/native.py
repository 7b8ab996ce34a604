"""The ``fused`` and ``pairwise`` datapaths chained over K in C (fp8ref/_kernels_hw.c), on whole
batches of tiles, and a kernel's FP32 promotion.

Same integers as ``fdpa.fused_step`` / ``fdpa.pairwise_step`` (the C file says why every step is
exact); used only where its preconditions hold: f32 accumulator (fused: normalised toward zero;
pairwise: CDNA3's), power-of-two (UE8M0) block scales one per step, and finite operands, scales and
C. Anything else (NaN/Inf inputs, ``grouped`` datapaths, f16, UE4M3 scales) returns None and the
numpy model runs.
"""

from __future__ import annotations

import math
from functools import cache

import numpy as np

from .._native import hw_job, kernels, parallel
from ..formats import FloatFormat
from .fdpa import value_fields
from .isa import Instruction

_OUT_BITS = {"rz-e8m13": 13, "rz-f32": 23}
_NB = 128  # columns per C unit (NB in _kernels_hw.c)
_ZERO = -4096  # int16 alignment exponent of a zero operand (HW_ZERO in _kernels_hw.c)
_LMAX = 64  # longest step the C loops hold (HW_LMAX)


@cache
def _tables(fmt: FloatFormat) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(fp32 value, int16 alignment exponent, finite?) per code; FP8/6/4 values are fp32-exact."""
    v, e = value_fields(fmt)
    finite = np.isfinite(v)
    x = np.where(e < -(1 << 19), _ZERO, e).astype(np.int16)
    return np.where(finite, v, 0).astype(np.float32), x, finite


@cache
def _non_finite(fmt: FloatFormat) -> tuple[int, tuple[int, ...]]:
    """(t, rest): a code is NaN/Inf iff its magnitude bits are >= t, or it is one of ``rest`` (the
    fnuz NaN 0x80); read off the table (tests/hardware/test_fused_c.py checks every code)."""
    finite = _tables(fmt)[2]
    codes = np.arange(256)
    mag = codes & (fmt.magnitude_mask | ~(fmt.n_codes - 1) & 0xFF)
    bad_mag = mag[~finite & (mag > 0)]
    t = int(bad_mag.min()) if bad_mag.size else 256
    rest = tuple(int(c) for c in codes[~finite & (mag < t)])
    return t, rest


@cache
def _pointers(fmt: FloatFormat) -> tuple[int, int]:
    """Addresses of the cached (read-only, never freed) value and exponent tables."""
    v, x, _ = _tables(fmt)
    return v.ctypes.data, x.ctypes.data


@cache
def _bad_bytes(fmt: FloatFormat) -> tuple[bytes, ...]:
    return tuple(bytes([c]) for c in range(256) if not _tables(fmt)[2][c])


def _finite_codes(codes: np.ndarray, fmt: FloatFormat) -> bool:
    """No NaN/Inf code (a max and a compare or two over the codes: no gather, except for one
    instruction's few codes, where the table lookup is quicker)."""
    if codes.size <= 8192:  # memchr over a copy of the bytes: no numpy call per code
        b = codes.tobytes()
        return not any(c in b for c in _bad_bytes(fmt))
    t, rest = _non_finite(fmt)
    mask = fmt.magnitude_mask | ~(fmt.n_codes - 1) & 0xFF
    if codes.size == 0:
        return True
    if t < 256 and int(np.bitwise_and(codes, mask).max()) >= t:
        return False
    return not any(bool((codes == c).any()) for c in rest)


def applies(ins: Instruction) -> bool:
    dp = ins.datapath
    if kernels() is None or ins.acc != "float32" or min(ins.k, dp.L) > _LMAX:
        return False
    if dp.family == "pairwise":
        return dp.output == "rne-f32"
    return dp.family == "fused" and dp.output in _OUT_BITS and \
        (ins.scale_fmt is None or (ins.scale_type == "ue8m0" and ins.block == dp.L))


def _finite(ins: Instruction, A, B, C, SA, SB) -> bool:
    """Every code, scale and C finite, and K whole steps (the C loops take no partial step)."""
    K = A.shape[-1]
    if K % min(K, ins.datapath.L):
        return False
    if not (_finite_codes(A, ins.a_fmt) and _finite_codes(B, ins.b_fmt)):
        return False
    if C is not None and not math.isfinite(C.sum(dtype=np.float64)):  # a NaN/Inf C makes the sum NaN/Inf
        return False
    return SA is None or (_finite_codes(SA, ins.scale_fmt) and _finite_codes(SB, ins.scale_fmt))


def _run(ins: Instruction, A, B, D, SA=None, SB=None, acc=None, promote=0, psa=None, psb=None, fma=False):
    """The C loop over contiguous A (nb, M, K), B (nb, K, N), D (nb, M, N) (C in, result out)."""
    dp = ins.datapath
    *batch, M, K = A.shape
    N = B.shape[-1]
    nb = math.prod(batch)
    L = min(K, dp.L)
    pa, pb = _pointers(ins.a_fmt), _pointers(ins.b_fmt)
    keep = [None if x is None else np.ascontiguousarray(x) for x in (A, B, SA, SB)] + [psa, psb, D, acc]
    A, B, SA, SB, psa, psb, D, acc = (None if x is None else x.ctypes.data for x in keep)
    chunks = -(-N // _NB)
    if dp.family == "pairwise":
        F, out_bits, e_zero, zero_in, task = dp.F, dp.F2, 0, 0, "fp8ref_hw_pairwise"
    else:
        F, out_bits, e_zero, task = dp.F, _OUT_BITS[dp.output], dp.e_zero, "fp8ref_hw_fused"
        zero_in = int(SA is not None or dp.e_zero > ins.a_fmt.emin + ins.b_fmt.emin)
    job = hw_job(A, B, SA, SB, pa[0], pb[0], pa[1], pb[1], None if SA is None else _pointers(ins.scale_fmt)[1],
                 psa, psb, D, acc, M, N, K, L, chunks, promote, 0 if keep[4] is None else keep[4].shape[1],
                 F, out_bits, e_zero, zero_in, int(fma))
    parallel(task, job, nb * chunks, work=nb * M * N * K // 4, keep=keep)


def chained_matmul(ins: Instruction, A, B, C, SA=None, SB=None) -> np.ndarray | None:
    """D for A (..., M, K), B (..., K, N) codes, C (..., M, N) float32, scales SA (..., M, K/L),
    SB (..., K/L, N) UE8M0 codes: the instruction chained over K from C. None where it does not
    apply (then the caller runs the numpy model)."""
    if not applies(ins) or not _finite(ins, A, B, C, SA, SB):
        return None
    D = np.array(C, np.float32, order="C", copy=True)
    _run(ins, A, B, D, SA, SB)
    return D


def promoted_matmul(ins: Instruction, A, B, SA=None, SB=None, *, promote_every: int | None,
                    psa=None, psb=None, fma: bool = False) -> np.ndarray | None:
    """A kernel's K loop over A (M, K), B (K, N) codes from C = 0: the instruction's accumulator
    carries ``promote_every`` elements of K (None: all of K, fast accumulation), then goes into an
    FP32 register accumulator, acc = fp32(acc + fp32(d * s)) or fma(d, s, acc), s = fp32(psa[m, p] *
    psb[p, n]) per promotion block p (psa (M, P), psb (P, N) float32; 1 when None). None where the
    C loop does not apply."""
    if not applies(ins) or ins.datapath.family != "fused" or not _finite(ins, A, B, None, SA, SB):
        return None
    M, K = A.shape
    L = min(K, ins.datapath.L)
    if promote_every is not None and promote_every % L:
        return None
    D = np.zeros((M, B.shape[1]), np.float32)
    if promote_every is None:
        _run(ins, A, B, D, SA, SB)
        return D
    acc = np.zeros_like(D)
    for x in (psa, psb):
        if x is not None and not (x.dtype == np.float32 and x.flags.c_contiguous):
            raise TypeError("promotion scales: contiguous float32 expected")  # internal contract
    _run(ins, A, B, D, SA, SB, acc, promote_every // L, psa, psb, fma)
    return acc
