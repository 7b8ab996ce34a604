"""The ``fused``, ``grouped`` and ``pairwise`` datapaths chained over K in C (fp8ref/_csrc/hw.c, and
_csrc/hw_avx512.c for the FP8 units it serves), on whole batches of tiles, a kernel's FP32
promotion, and one instruction's call by a cached plan.

Same integers as ``fdpa.fused_step`` / ``fdpa.pairwise_step`` (the C file says why every step is
exact); used where the published model's rule is one the loops hold: fused normalised toward zero
(f32) or to nearest f16 (.f16), power-of-two (UE8M0) block scales one per step; grouped (MXFP4 /
NVFP4: UE8M0 or UE4M3 scales per 16 or 32 elements); CDNA3's pairwise. The loops flag every code
that is NaN/Inf (or not a code of its format) and every NaN/Inf C as they read them: then the caller
discards the result and runs the numpy model, which owns the rules of the specials.
"""

from __future__ import annotations

import ctypes
import math
from functools import cache

import numpy as np

from .._native import _PARALLEL_MIN, hw_call, hw_job, kernels, parallel
from ..formats import FloatFormat
from .fdpa import code_fields, value_fields
from .isa import Instruction

_OUT_BITS = {"rz-e8m13": 13, "rz-f32": 23}
_NB = 128  # columns per C unit (HW_NB in _csrc/kernels.h)
_ZERO = -4096  # int16 alignment exponent of a zero operand (HW_ZERO in _csrc/kernels.h)
_LMAX = 64  # longest step the C loops hold (HW_LMAX)
NON_FINITE, NOT_A_CODE = 1, 2  # the flags the loops return (hw_job.bad)
_U8 = np.dtype(np.uint8)


@cache
def tables(fmt: FloatFormat, ignore_sign: bool = False) -> tuple[np.ndarray, ...]:
    """(fp32 value, int16 alignment exponent, uint8 flag, int16 significand) per code (read-only,
    never freed: the C loops get their addresses). FP8/6/4 values are fp32-exact; NaN/Inf codes
    read as zeros and flag NON_FINITE; bytes past a 4/6-bit format's codes flag NOT_A_CODE."""
    v, e = value_fields(fmt, ignore_sign)
    sig = np.abs(code_fields(fmt, ignore_sign)[0]).astype(np.int16)
    finite = np.isfinite(v)
    flags = np.where(finite, 0, NON_FINITE).astype(np.uint8)
    flags[fmt.n_codes:] = NOT_A_CODE
    x = np.where((e < -(1 << 19)) | ~finite, _ZERO, e).astype(np.int16)
    out = (np.where(finite, v, 0).astype(np.float32), x, flags, np.where(finite, sig, 0).astype(np.int16))
    for arr in out:
        arr.setflags(write=False)
    return out


@cache
def integers(fmt: FloatFormat) -> np.ndarray:
    """int16 value per code in units of the format's last bit, 2**(emin - mantissa_bits) (read-only;
    the grouped loop sums products of them exactly); NaN/Inf codes read as 0, as in ``tables``."""
    q = np.ldexp(tables(fmt)[0].astype(np.float64), -(fmt.emin - fmt.mantissa_bits))
    out = q.astype(np.int16)
    if not np.array_equal(out, q):
        raise ValueError(f"{fmt.name}: values are not int16 multiples of its last bit")  # internal contract
    out.setflags(write=False)
    return out


@cache
def _group_sums_fit(ins: Instruction) -> bool:
    """The grouped loop's int16 group sums hold G products of the largest integers."""
    ma, mb = (int(np.abs(integers(f).astype(np.int32)).max()) for f in (ins.a_fmt, ins.b_fmt))
    return ins.datapath.G * ma * mb < 1 << 15


def applies(ins: Instruction) -> bool:
    dp = ins.datapath
    if kernels() is None or min(ins.k, dp.L) > _LMAX:
        return False
    if dp.family == "pairwise":
        return ins.acc == "float32" and dp.output == "rne-f32"
    if dp.family == "grouped":  # e2m1 products: exact int16 group sums (_csrc/hw.c)
        return ins.acc == "float32" and dp.output == "rz-f32" and dp.G == 16 and ins.block % dp.G == 0 \
            and ins.a_fmt.bits == ins.b_fmt.bits == 4 and dp.L % dp.G == 0 and _group_sums_fit(ins)
    if dp.F > 25:  # the fused loops' int32 partial sums hold 16 terms below 2**(F + 2)
        return False
    out_ok = dp.output in _OUT_BITS if ins.acc == "float32" else dp.output == "rne-f16"
    return dp.family == "fused" and out_ok and \
        (ins.scale_fmt is None or (ins.scale_type == "ue8m0" and ins.block == dp.L))


def _address(x) -> int:
    return x.ctypes.data


@cache
def _template(ins: Instruction) -> tuple[hw_job, str, tuple]:
    """The job fields that depend on the instruction only (tables, datapath parameters), its C task,
    and the tables it points into."""
    dp = ins.datapath
    ta, tb = tables(ins.a_fmt), tables(ins.b_fmt)
    ts = tables(ins.scale_fmt, ins.scale_type == "ue4m3") if ins.scale_fmt is not None else tables(ins.a_fmt)
    tabs = (ta, tb, ts)
    job = hw_job(va=_address(ta[0]), vb=_address(tb[0]), xa=_address(ta[1]), xb=_address(tb[1]),
                 xs=_address(ts[1]), ss=_address(ts[3]), fa=_address(ta[2]), fb=_address(tb[2]), fs=_address(ts[2]),
                 F=dp.F, f16=int(ins.acc == "float16"))
    if dp.family == "pairwise":
        job.out_bits, task = dp.F2, "fp8ref_hw_pairwise"
    else:
        job.out_bits = _OUT_BITS.get(dp.output, 10)
        job.e_zero = dp.e_zero
        if dp.family == "grouped":
            task = "fp8ref_hw_grouped"
            ia, ib = integers(ins.a_fmt), integers(ins.b_fmt)
            job.ia, job.ib, tabs = _address(ia), _address(ib), (ta, tb, ts, ia, ib)
            job.G, job.block = dp.G, ins.block
            job.unit = ins.a_fmt.emin - ins.a_fmt.mantissa_bits + ins.b_fmt.emin - ins.b_fmt.mantissa_bits
            job.smb = ins.scale_fmt.mantissa_bits
        else:
            task = "fp8ref_hw_fused"
            job.zero_in = int(ins.scale_fmt is not None or dp.e_zero > ins.a_fmt.emin + ins.b_fmt.emin)
    return job, task, tabs


def _run(ins: Instruction, A, B, D, SA=None, SB=None, acc=None, promote=0, psa=None, psb=None, fma=False) -> int:
    """The C loop over contiguous A (nb, M, K), B (nb, K, N), D (nb, M, N) float32 (C in, result
    out); returns the flags of what it read (0: every code and C finite, the result stands)."""
    template, task, _ = _template(ins)
    *batch, M, K = A.shape
    N = B.shape[-1]
    nb = math.prod(batch)
    job = hw_job.from_buffer_copy(template)
    keep = [None if x is None else np.ascontiguousarray(x) for x in (A, B, SA, SB)] + [psa, psb, D, acc]
    job.A, job.B, job.SA, job.SB, job.psa, job.psb, job.D, job.acc = \
        (None if x is None else x.ctypes.data for x in keep)
    job.M, job.N, job.K, job.L = M, N, K, min(K, ins.datapath.L)
    job.chunks = -(-N // _NB)
    job.promote, job.np, job.fma = promote, 0 if psa is None else psa.shape[1], int(fma)
    parallel(task, job, nb * job.chunks, work=nb * M * N * K // 4, keep=keep)
    return job.bad


def _whole_steps(ins: Instruction, K: int) -> bool:
    return K % min(K, ins.datapath.L) == 0  # the C loops take no partial step


def chained_matmul(ins: Instruction, A, B, C, SA=None, SB=None) -> np.ndarray | None:
    """D for A (..., M, K), B (..., K, N) codes, C (..., M, N) in the accumulator dtype, scales SA
    (..., M, K/block), SB (..., K/block, N) codes: the instruction chained over K from C. None where
    it does not apply or an operand, scale or C is NaN/Inf (then the caller runs the numpy model)."""
    if not applies(ins) or not _whole_steps(ins, A.shape[-1]):
        return None
    D = np.array(C, np.float32, order="C", copy=True)
    if _run(ins, A, B, D, SA, SB):
        return None
    return D.astype(np.float16) if ins.acc == "float16" else D


def promoted_matmul(ins: Instruction, A, B, SA=None, SB=None, *, promote_every: int | None,
                    psa=None, psb=None, fma: bool = False) -> np.ndarray | None:
    """A kernel's K loop over A (M, K), B (K, N) codes from C = 0: the instruction's accumulator
    carries ``promote_every`` elements of K (None: all of K, fast accumulation), then goes into an
    FP32 register accumulator, acc = fp32(acc + fp32(d * s)) or fma(d, s, acc), s = fp32(psa[m, p] *
    psb[p, n]) per promotion block p (psa (M, P), psb (P, N) float32; 1 when None). None where the
    C loop does not apply or an operand or scale is NaN/Inf."""
    if not applies(ins) or ins.datapath.family == "pairwise" or ins.acc != "float32" or \
            not _whole_steps(ins, A.shape[-1]):
        return None  # the pairwise loop has no promotion
    M, K = A.shape
    L = min(K, ins.datapath.L)
    if promote_every is not None and promote_every % L:
        return None
    D = np.zeros((M, B.shape[1]), np.float32)
    if promote_every is None:
        return None if _run(ins, A, B, D, SA, SB) else D
    acc = np.zeros_like(D)
    for x in (psa, psb):
        if x is not None and not (x.dtype == np.float32 and x.flags.c_contiguous):
            raise TypeError("promotion scales: contiguous float32 expected")  # internal contract
    return None if _run(ins, A, B, D, SA, SB, acc, promote_every // L, psa, psb, fma) else acc


class Plan:
    """One instruction's call, D = A·B + C, with everything that depends on the instruction alone
    done once: the job's fields, the shapes and dtypes to accept, the C task. ``__call__`` takes
    only the plain case, C-contiguous or not: numpy uint8 codes and a numpy accumulator of exactly
    the instruction's shapes and dtypes; anything else, and any NaN/Inf or invalid code, returns None
    and the caller takes the checked path (which validates and says what is wrong)."""

    __slots__ = ("job", "fn", "template", "call", "shapes", "acc", "scaled", "f16", "keep")

    def __init__(self, ins: Instruction):
        template, task, tabs = _template(ins)
        self.job = hw_job.from_buffer_copy(template)  # hw_call copies it per call: plans are shared
        self.job.M, self.job.N, self.job.K, self.job.L = ins.m, ins.n, ins.k, min(ins.k, ins.datapath.L)
        self.job.chunks = -(-ins.n // _NB)
        self.fn = ctypes.cast(getattr(kernels(), task), ctypes.c_void_p).value
        self.template = ctypes.addressof(self.job)
        self.call = hw_call()  # the arrays' addresses read in C: numpy's .ctypes and ctypes' conversions cost more
        self.keep = tabs
        nb = ins.k // ins.block if ins.block else 0
        self.shapes = ((ins.m, ins.k), (ins.k, ins.n), (ins.m, ins.n), (ins.m, nb), (nb, ins.n))
        self.acc = np.dtype(ins.acc)
        self.scaled = ins.scale_fmt is not None
        self.f16 = ins.acc == "float16"

    def __call__(self, a, b, c, sa, sb) -> np.ndarray | None:
        sh = self.shapes
        if not (type(a) is np.ndarray and type(b) is np.ndarray and type(c) is np.ndarray and a.dtype is _U8
                and b.dtype is _U8 and c.dtype is self.acc and a.shape == sh[0] and b.shape == sh[1]
                and c.shape == sh[2]):
            return None
        D = c.astype(np.float32, order="C") if self.f16 else c.copy()  # C-contiguous: the loop writes it
        if self.scaled:
            if not (type(sa) is np.ndarray and type(sb) is np.ndarray and sa.dtype is _U8 and sb.dtype is _U8
                    and sa.shape == sh[3] and sb.shape == sh[4]):
                return None
            bad = self.call(self.fn, self.template, np.ascontiguousarray(a), np.ascontiguousarray(b), D,
                            np.ascontiguousarray(sa), np.ascontiguousarray(sb))
        elif sa is not None or sb is not None:
            return None
        else:
            bad = self.call(self.fn, self.template, np.ascontiguousarray(a), np.ascontiguousarray(b), D)
        if bad:
            return None
        return D.astype(np.float16) if self.f16 else D


@cache
def plan(ins: Instruction) -> Plan | None:
    """The cached plan of one instruction's call, or None where the C loops do not serve it or its
    work is large enough to split over threads (then ``chained_matmul`` runs it)."""
    if not applies(ins) or not _whole_steps(ins, ins.k) or ins.m * ins.n * ins.k // 4 >= _PARALLEL_MIN:
        return None
    return Plan(ins)
