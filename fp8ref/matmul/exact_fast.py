"""accumulate="exact" at the cost of one float64 GEMM: the fast path of exact.py (docs/matmul.md, "Speed").

It applies when one integer piece per operand suffices for the formats' whole code spans
(``_piece_count``: every finite value is an integer times 2**g and every partial sum of a K-block
dot product stays below 2**53) and no NaN/Inf code occurs. Then:

- scales constant along K: T = A @ B (one float64 GEMM of the decoded values, b decoded whole into
  a reused workspace or taken from a ``DecodedCodes`` record) is the exact dot product in any
  BLAS order, with or without FMA; x = s * T + bias with s = sa * sb exact (two float32 values).
  The C epilogue (fp8ref/_csrc/exact.c) rounds x once, correctly, for every element: s * T as
  an exact TwoProduct, the bias by TwoSums, a round-to-odd float64 then the output's rounding.
  Without the C loops (or for code outputs) y = fl(fl(s * T) + bias) decides almost every
  element from its float64 bits (epilogue._decide_sum) and the rest take the exact rounding.
- K-blocked scales: with a' = a * sa and b' = b * sb (exact: folded in while decoding),
  y = bias + A' @ B' (one float64 GEMM over the whole K) satisfies |y - x| <= gamma_n (|bias| + S),
  n = K + 2, S = sum_k |a' b'| <= sum_b |a'_(m,b)| |b'_(b,n)| (Cauchy-Schwarz per scale block; the
  block norms come out of the decode, their product is a small GEMM). The elements this leaves
  undecided get their exact block sums from their own row and column, TwoProducts with the block
  scales and the exact rounding.

Anything else (NaN/Inf, e5m2-wide spans, K past the bound) returns None: exact.py's general path,
which is also the oracle of this one (tests/unit/matmul/test_matmul_fast.py).
"""

from __future__ import annotations

import math
import threading
from contextlib import ExitStack, contextmanager
from functools import lru_cache

import numpy as np

from .. import _arrays
from .._arrays import aligned_empty, torch
from .._native import bsum_job, dec_job, dot_job, epi_job, kernels, parallel, threads
from ..codec import decode
from ..errors import ShapeError
from ..exact import extract, two_product
from ..formats import FloatFormat
from ..rounding import OutFormat
from .epilogue import CodeOut, _decide_bound, _decide_sum, _round_exact
from .exact import _piece_count, _span
from .fp32 import _products_exact_in_fp32
from .operands import DecodedCodes, _check_codes, _code_values

_WORKSPACE_BYTES = 1 << 28  # b's float64 values up to this size go to one reused (already touched) buffer
_GROUP_K = 1024  # K of each GEMM of the blocked path: the bound shrinks with it, shorter GEMMs run slower
_REPAIR_BYTES = 1 << 25  # bytes of repair products (numpy) or terms per repair step
_DOT_MAX_M = 8  # rows of a the on-the-fly product takes (DOT_MAX_M of _csrc/kernels.h)
_SPLIT = 8  # tasks per thread of the C loops: a descheduled thread delays one small task, not half the loop
# codes x rows of an M <= 8 product below which it runs on the calling thread (a 512 x 2048 k_proj):
# on a loaded machine waking and joining the OpenMP team costs more than such a product; larger ones
# gain from the team (docs/models.md, "The 1-token step")
_DOT_PARALLEL_MIN = 1 << 21


class _NonFinite(Exception):
    """A NaN or Inf code occurs: the general path decides."""


def _fast_exact(ca, cb, fa: FloatFormat, fb: FloatFormat, sa, sb, bk: int, bias, out):
    """The exact model's result, or None where the general path must run. cb: codes or a
    ``DecodedCodes`` record (its float64 forms are decoded once and kept there)."""
    record = cb if isinstance(cb, DecodedCodes) else None
    cb = cb.codes if record is not None else cb
    M, K = ca.shape
    if not _one_piece(fa, fb, min(bk, K)):
        return None
    finite_bias = None if bias is None else np.where(np.isfinite(bias), bias, 0.0)
    try:
        if sa.shape[1] == 1:
            result = _scaled(ca, fa, cb, fb, record, sa, sb, finite_bias, out)
        else:
            result = _blocked(ca, fa, cb, fb, record, sa, sb, bk, finite_bias, out)
    except _NonFinite:
        return None
    if bias is not None and not np.isfinite(bias).all():  # a non-finite bias is the sum (IEEE)
        result = np.where(~np.isfinite(bias), bias + np.zeros((M, 1)), result)
    return result


@lru_cache(maxsize=64)
def _one_piece(fa: FloatFormat, fb: FloatFormat, k: int) -> bool:
    """One integer piece per operand suffices for the formats' whole code spans and K-blocks of k
    (per formats and k, not per call: a decode step makes hundreds of calls)."""
    every = np.ones(fa.n_codes, bool), np.ones(fb.n_codes, bool)
    try:
        return _piece_count(_span(fa, every[0]), _span(fb, every[1]), fa.mantissa_bits, fb.mantissa_bits,
                            k) == (1, 1)
    except ShapeError:
        return False


# --- operands ------------------------------------------------------------------------------------------
class _Workspace:
    """One float64 buffer reused across calls (its pages touched once: no page faults per call),
    for b's values up to _WORKSPACE_BYTES; larger ones, or a second thread while it is in use,
    get a buffer of their own. It holds on to the largest size used (<= _WORKSPACE_BYTES)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.buf = np.empty(0)

    @contextmanager
    def take(self, n: int):
        if 8 * n > _WORKSPACE_BYTES or not self.lock.acquire(blocking=False):
            yield np.empty(n)
            return
        try:
            if self.buf.size < n:
                self.buf = np.empty(0)
                self.buf = aligned_empty((n,), np.float64)  # whole lines: the decode may stream into it
            yield self.buf[:n]
        finally:
            self.lock.release()


_WORKSPACE = _Workspace()
_PARTS = _Workspace()  # the blocked path's per-group GEMM results


@lru_cache(maxsize=32)
def _lut(fmt: FloatFormat) -> np.ndarray:
    """256 float32 values (every value of a format float32 holds is exact there); NaN for NaN/Inf
    codes and codes past 2**bits, so the decode flags a row that holds one. Made once per format
    (read-only)."""
    v = _code_values(fmt)
    table = np.full(256, np.nan, np.float32)
    table[:fmt.n_codes] = np.where(np.isfinite(v), v, np.nan)
    table.setflags(write=False)
    return table


def _stage(codes: np.ndarray, fmt: FloatFormat, what: str, dst: np.ndarray, scale=None, norms=None,
           stream: bool = False) -> None:
    """dst[r, c] = value of codes[r, c] (times scale[0][r // scale[1], c // scale[2]] when given;
    norms = (array, rb, cb): array[r // rb, c // cb] += dst[r, c]**2, array zeroed by the caller).
    stream: dst's pages are touched and it is too large to stay cached (_arrays.STREAM_BYTES).
    codes: any strides; dst: rows contiguous. _NonFinite on a NaN/Inf code (FormatError on codes
    past 2**bits, as on the general path)."""
    R, C = codes.shape
    if kernels() is not None and codes.size:
        flags = np.empty(R, np.uint8)
        table = _lut(fmt)
        s, s_rb, s_cb = (np.ascontiguousarray(scale[0], np.float64), *scale[1:]) if scale is not None else (None, 1, 1)
        n, n_rb, n_cb = norms if norms is not None else (None, 1, 1)

        def ptr(x):
            return None if x is None else x.ctypes.data

        job = dec_job(codes.ctypes.data, dst.ctypes.data, table.ctypes.data, flags.ctypes.data, ptr(s), ptr(n),
                      codes.strides[0], codes.strides[1], dst.strides[0] // 8, R, C, n_rb,
                      0 if s is None else s.shape[1], s_rb, s_cb, 0 if n is None else n.shape[1], n_rb, n_cb,
                      int(stream))
        parallel("fp8ref_decode_f64", job, -(-R // n_rb), work=codes.size, split=_SPLIT * threads(),
                 keep=(codes, dst, table, flags, s, n))
        if not flags.any():
            return
    if _check_codes(codes, fmt, what):
        raise _NonFinite
    if not codes.size:
        return
    dst[...] = decode(codes, fmt)
    if scale is not None:
        dst *= np.repeat(np.repeat(scale[0], scale[1], axis=0), scale[2], axis=1)[:R, :C]
    if norms is not None:
        n, n_rb, n_cb = norms
        sq = dst * dst
        n += np.add.reduceat(np.add.reduceat(sq, np.arange(0, R, n_rb), axis=0), np.arange(0, C, n_cb), axis=1)


def _values(codes: np.ndarray, fmt: FloatFormat, what: str, scale=None, norms=None) -> np.ndarray:
    values = np.empty(codes.shape)
    _stage(codes, fmt, what, values, scale, norms)
    return values


@contextmanager
def _b_values(cb: np.ndarray, fb: FloatFormat, record, bk: int = 1, sb=None):
    """b's float64 values (times sb, (KB, N) per K-block, with the (KB, N) squared block norms
    when sb is given): (values, norms) from the record's cache, or decoded into the workspace.
    Codes stored transposed (a (N, K) weight's .T) are decoded in their own order and used as a
    transposed view: the GEMM takes it as it is."""
    if record is not None and record.keep:
        yield record.cached(("b", bk, None if sb is None else sb.tobytes()), lambda: _decode_b(cb, fb, bk, sb, None))
        return
    with _WORKSPACE.take(cb.size) as buf:
        yield _decode_b(cb, fb, bk, sb, buf)


def _decode_b(cb, fb, bk, sb, buf):
    K, N = cb.shape
    flip = not cb.flags.c_contiguous and cb.T.flags.c_contiguous
    src = cb.T if flip else cb
    dst = (np.empty(src.shape) if buf is None else buf.reshape(src.shape))
    stream = buf is not None and dst.nbytes >= _arrays.STREAM_BYTES  # the reused workspace, touched
    norms = None
    if sb is None:
        _stage(src, fb, "b", dst, stream=stream)
    elif flip:  # (N, K): scale and norms per row and K-block
        norms = np.zeros((N, sb.shape[0]))
        _stage(src, fb, "b", dst, (sb.T, 1, bk), (norms, 1, bk), stream)
        norms = norms.T
    else:
        norms = np.zeros(sb.shape)
        _stage(src, fb, "b", dst, (sb, bk, 1), (norms, bk, 1), stream)
    return (dst.T if flip else dst), norms


def _lut_product(A: np.ndarray, cb: np.ndarray, fb: FloatFormat) -> np.ndarray | None:
    """A @ B for a few rows of A (M <= DOT_MAX_M: a decode step) with b a weight's transposed view
    (its (N, K) codes row-major): the C loop looks each code up as it reads it, so no float64 copy
    of b is made (decoding it would cost more than the product). The same exact sums as the GEMM on
    the decoded b. None where it does not apply (more rows, another layout, no C loops)."""
    M, K = A.shape
    w = cb.T
    if kernels() is None or not 0 < M <= _DOT_MAX_M or not w.flags.c_contiguous or not cb.size:
        return None
    T = np.empty((M, w.shape[0]))
    flags = np.empty(w.shape[0], np.uint8)
    table = _lut(fb)
    job = dot_job(A.ctypes.data, w.ctypes.data, table.ctypes.data, T.ctypes.data, flags.ctypes.data, M, K,
                  w.shape[0], w.strides[0], int(_sign_symmetric(fb)))
    parallel("fp8ref_lut_dot", job, w.shape[0], work=w.size * M, split=_SPLIT * threads(),
             keep=(A, w, table, T, flags), min_work=_DOT_PARALLEL_MIN)
    if flags.any():
        _check_codes(cb, fb, "b")  # codes past 2**bits: FormatError, as on the general path
        raise _NonFinite
    return T


@lru_cache(maxsize=32)
def _sign_symmetric(fmt: FloatFormat) -> bool:
    """_lut(fmt)[c | 0x80] is _lut(fmt)[c] with the sign bit flipped for every c < 128 (both NaN
    counts: the lookup still gives a NaN, which is flagged)."""
    table = _lut(fmt)
    lo, hi = table[:128], table[128:]
    return bool(np.all((hi.view(np.uint32) == lo.view(np.uint32) ^ np.uint32(0x80000000))
                       | (np.isnan(lo) & np.isnan(hi))))


def _gemm(A: np.ndarray, B: np.ndarray) -> np.ndarray:
    """A @ B in float64 (torch's BLAS, the faster one here, else numpy's), a new (M, N) array."""
    T = np.empty((A.shape[0], B.shape[1]))
    t = _torch()
    if t is None:
        np.matmul(A, B, out=T)
    else:
        t.mm(t.from_numpy(A), t.from_numpy(B), out=t.from_numpy(T))
    return T


def _torch():
    """torch (its BLAS is the faster one here), or None: numpy's matmul then."""
    try:
        return torch()
    except ImportError:
        return None


# --- scales constant along K -----------------------------------------------------------------------------
def _scaled(ca, fa, cb, fb, record, sa, sb, finite_bias, out) -> np.ndarray:
    A = _values(np.ascontiguousarray(ca), fa, "a")
    T = _lut_product(A, cb, fb)
    if T is None:
        with _b_values(cb, fb, record) as (B, _):
            T = _gemm(A, B)
    if kernels() is not None and not isinstance(out, CodeOut):
        c, unsure = _epilogue(T, 0, out, finite_bias, sa=sa[:, 0], sb=sb[0])
        if unsure.any():  # outside the C loop's proof (never met by FP8 data): c holds the exact T there
            idx = np.nonzero(unsure)
            s_u = np.broadcast_to(sa * sb, c.shape)[idx]
            terms = [np.zeros(idx[0].size) if finite_bias is None else finite_bias[idx[1]], *two_product(s_u, c[idx])]
            c[idx] = _overflow(_round_exact(extract(np.stack(terms)), out), out)
        return c
    s = sa * sb  # (M, 1) * (1, N) or (1, 1): exact, two float32 values
    return _round_scaled(T, s, finite_bias, out, _tiny_possible(s, finite_bias, fa, fb, out))


def _epilogue(T: np.ndarray, mode: int, out: OutFormat, finite_bias, *, sa=None, sb=None, norm=None,
              slack: float = 0.0):
    """The C epilogue: (the rounded (M, N) result, the mask of the elements it left undecided,
    which keep their input). Mode 0: T (M, N) exact, x = sa[m] * sb[n] * T + bias, in place.
    Mode 1: T (ng, M, N) the K-group products, y = their sum + bias with |y - x| <= slack *
    (norm + |bias|); in place into T[0] for one group, else into a new array."""
    parts = T.shape[0] if mode == 1 else 1
    src = T if mode == 0 else T[0]
    M, N = src.shape
    res = src if parts == 1 else np.empty((M, N))
    unsure = np.empty((M, N), np.uint8)

    def vec(x):
        return None if x is None else np.ascontiguousarray(x, np.float64)

    sa, sb, bias, norm = vec(sa), vec(sb), vec(finite_bias), vec(norm)

    def ptr(x):
        return None if x is None else x.ctypes.data

    job = epi_job(src.ctypes.data, res.ctypes.data, unsure.ctypes.data, ptr(sa), ptr(sb), ptr(bias), ptr(norm),
                  slack, out.max, M, N, N, int(sa is not None and sa.size > 1), int(sb is not None and sb.size > 1),
                  mode, out.precision, out.emin, parts, M * N)
    parallel("fp8ref_exact_epilogue", job, M, work=M * N * 8 * parts, split=_SPLIT * threads(),
             keep=(T, res, unsure, sa, sb, bias, norm))
    return res, unsure.view(bool)


def _round_scaled(T: np.ndarray, s: np.ndarray, finite_bias, out, tiny: bool) -> np.ndarray:
    """One rounding of x = s * T + bias (s exact, T exact), without the C loops."""
    p = s * T
    y = p if finite_bias is None else p + finite_bias
    if isinstance(out, CodeOut):
        bound = np.abs(y) if finite_bias is None else np.abs(p) + np.abs(y)
        c, sure = out.candidate(y, bound * 2.0 ** -52)  # >= ulp(p)/2 + ulp(y)/2
    else:
        c, sure = _decide_sum(y, out, None if finite_bias is None else p, tiny)
    if not sure.all():
        unsure = np.nonzero(~sure)
        s_u = np.broadcast_to(s, T.shape)[unsure]
        terms = [np.zeros(s_u.size) if finite_bias is None else finite_bias[unsure[1]],
                 *two_product(s_u, T[unsure])]
        c[unsure] = _overflow(_round_exact(extract(np.stack(terms)), out), out)
    return c


def _tiny_possible(s, finite_bias, fa: FloatFormat, fb: FloatFormat, out: OutFormat) -> bool:
    """False when no nonzero s * T (T a multiple of the smallest product q) lies below
    2**(emin + 2) and no nonzero bias below 2**emin: then _decide_sum needs no per-element test."""
    if isinstance(out, CodeOut):
        return True  # not used: CodeOut decides its own candidates
    q = _smallest(fa) * _smallest(fb)
    if float(np.min(s)) * q < math.ldexp(1.0, out.emin + 2):
        return True
    if finite_bias is None:
        return False
    nz = np.abs(finite_bias[finite_bias != 0])
    return bool(nz.size) and float(nz.min()) < math.ldexp(1.0, out.emin)


def _smallest(fmt: FloatFormat) -> float:
    """Smallest positive finite value of fmt."""
    v = np.abs(_code_values(fmt))
    return float(v[np.isfinite(v) & (v > 0)].min())


def _overflow(c: np.ndarray, out) -> np.ndarray:
    """Values of the exact path past a float output's max are +-Inf (the grid continues above)."""
    return c if isinstance(out, CodeOut) else np.where(np.abs(c) > out.max, np.copysign(np.inf, c), c)


# --- K-blocked scales ------------------------------------------------------------------------------------
def _blocked(ca, fa, cb, fb, record, sa, sb, bk: int, finite_bias, out) -> np.ndarray:
    """K-blocked scales: float64 GEMMs of the scaled operands over K-groups with a proven bound,
    the undecided elements exactly (module docstring)."""
    M, K = ca.shape
    kb = sa.shape[1]
    ca = np.ascontiguousarray(ca)
    a_norms = np.zeros((M, kb))
    A = _values(ca, fa, "a", (sa, 1, bk), (a_norms, 1, bk))  # a' = a * sa: exact
    gk = max(1, _GROUP_K // bk) * bk  # K of each GEMM: whole scale blocks
    # |y - x| <= gamma_n (|bias| + S), n = gk + ng + 1 (gk products and additions per GEMM, any
    # order, FMA or not; the ng GEMM results and the bias added); S <= norm (Cauchy-Schwarz per scale
    # block). gamma_n = n u / (1 - n u) with u = 2**-53, and the computed norms, their product and the
    # bound itself are below the exact ones by a relative (bk + kb + 8) u at most: the factor
    # 1 + 4 (n + bk + kb + 8) u covers both
    n = min(gk, K) + -(-K // gk) + 1
    lut = _lut_block_parts(ca, fa, cb, fb, record, sa, sb, bk)
    if lut is not None:  # kb parts, each rounded once, and the bias added: gamma_(kb + 2) covers them too
        n = max(n, kb + 2)
    slack = n * 2.0 ** -53 * (1 + 4 * (n + bk + kb + 8) * 2.0 ** -53)
    with ExitStack() as held:
        if lut is not None:
            parts, b_norms = lut
        else:
            B, b_norms = held.enter_context(_b_values(cb, fb, record, bk, sb))  # b' = b * sb
            parts = held.enter_context(_group_products(A, B, gk))
        norm = _gemm(np.sqrt(a_norms), np.sqrt(b_norms))
        if kernels() is not None and not isinstance(out, CodeOut):
            c, unsure = _epilogue(parts, 1, out, finite_bias, norm=norm, slack=slack)  # sums the parts too
            sure = ~unsure
        else:
            y = parts[0] if parts.shape[0] == 1 else parts.sum(axis=0)
            bound = norm * slack
            if finite_bias is not None:
                y += finite_bias
                bound += np.abs(finite_bias) * slack
            c, sure = out.candidate(y, bound) if isinstance(out, CodeOut) else _decide_bound(y, bound, out)
    if not sure.all():
        unsure = np.nonzero(~sure)
        c[unsure] = _overflow(_repair(ca, fa, cb, fb, sa, sb, bk, finite_bias, unsure, out), out)
    return c


def _lut_block_parts(ca, fa, cb, fb, record, sa, sb, bk: int):
    """(parts, b_norms) of the blocked model for a few rows (M <= DOT_MAX_M: a decode step) of a
    weight held in a ``DecodedCodes`` record (its transposed view, (N, K) codes row-major), without
    decoding the weight: parts[blk] = fl(sa[:, blk] sb[blk] T_blk), T_blk the K-block's sum of
    products of the unscaled values (the lookup loop, each row's blocks in turn: exact, one piece
    per K-block, any order),
    the scale product exact, so each part is within u of its exact value; b's block norms are
    per weight and scales, made once and kept on the record. None where it does not apply."""
    M, K = ca.shape
    w = cb.T
    if (record is None or kernels() is None or not 0 < M <= _DOT_MAX_M or not w.flags.c_contiguous
            or not cb.size):
        return None
    kb, N = sa.shape[1], w.shape[0]
    A = _values(ca, fa, "a")
    T = np.empty((kb, M, N))
    flags = np.empty(N, np.uint8)
    table = _lut(fb)
    job = dot_job(A.ctypes.data, w.ctypes.data, table.ctypes.data, T.ctypes.data, flags.ctypes.data, M, K, N,
                  w.strides[0], int(_sign_symmetric(fb)), bk)
    parallel("fp8ref_lut_dot", job, N, work=w.size * M, split=_SPLIT * threads(), keep=(A, w, table, T, flags),
             min_work=_DOT_PARALLEL_MIN)
    if flags.any():
        _check_codes(cb, fb, "b")  # codes past 2**bits: FormatError, as on the general path
        raise _NonFinite
    T *= np.asarray(sa).T[:, :, None] * np.asarray(sb)[:, None, :]  # the scale products: exact
    return T, record.cached(("b_norms", bk, sb.tobytes()), lambda: _b_norms(cb, fb, bk, sb))


def _b_norms(cb, fb, bk: int, sb) -> np.ndarray:
    """b's (KB, N) squared block norms of b * sb, as _decode_b computes them (the values decoded
    into the workspace and dropped)."""
    with _WORKSPACE.take(cb.size) as buf:
        return np.ascontiguousarray(_decode_b(cb, fb, bk, sb, buf)[1])


@contextmanager
def _group_products(A: np.ndarray, B: np.ndarray, gk: int):
    """(ng, M, N): A[:, g] @ B[g] for the K-groups of gk, one GEMM each into its own array (summed
    by the epilogue): the error bound grows with gk plus the number of groups, not with K. One
    group: a new array; more: the _PARTS workspace (use it inside the with block)."""
    K = A.shape[1]
    if K <= gk:
        yield _gemm(A, B)[None]
        return
    ng = -(-K // gk)
    with _PARTS.take(ng * A.shape[0] * B.shape[1]) as buf:
        parts = buf.reshape(ng, A.shape[0], B.shape[1])
        t = _torch()
        for g, k0 in enumerate(range(0, K, gk)):
            a, b = A[:, k0:k0 + gk], B[k0:k0 + gk]
            if t is None:
                np.matmul(a, b, out=parts[g])
            else:
                t.mm(t.from_numpy(a), t.from_numpy(b), out=t.from_numpy(parts[g]))
        yield parts


def _repair(ca, fa, cb, fb, sa, sb, bk: int, finite_bias, idx, out) -> np.ndarray:
    """Exact rounding of the elements (idx[0], idx[1]): per scale block the integer dot product of
    the element's own row and column of values (exact in any order, one piece), times its block
    scale as an exact TwoProduct, the bias, then the exact summation and rounding of epilogue.py."""
    sums = _block_sums(ca, fa, cb, fb, bk, idx)
    mi, ni = idx
    done = []
    step = max(1, _REPAIR_BYTES // (8 * 2 * (sums.shape[1] + 1)))
    for e0 in range(0, mi.size, step):
        m, n, part = mi[e0:e0 + step], ni[e0:e0 + step], sums[e0:e0 + step]
        terms = [finite_bias[n] if finite_bias is not None else np.zeros(m.size)]
        for blk in range(part.shape[1]):
            terms.extend(two_product(sa[m, blk] * sb[blk, n], part[:, blk]))  # scale exact
        done.append(_round_exact(extract(np.stack(terms)), out))
    return np.concatenate(done)


def _block_sums(ca, fa, cb, fb, bk: int, idx) -> np.ndarray:
    """(E, KB) exact K-block sums of the elements idx: the C loop, or numpy in steps."""
    mi, ni = (np.ascontiguousarray(i, np.int64) for i in idx)
    M, K = ca.shape
    kb = -(-K // bk)
    if kernels() is not None:
        a = np.ascontiguousarray(ca)
        b = cb if (cb.strides[1] == 1 or cb.strides[0] == 1) else np.ascontiguousarray(cb)
        aT = np.ascontiguousarray(a.T) if b.strides[1] == 1 else None
        va, vb = (np.where(np.isfinite(v), v, 0.0) for v in (_lut(fa).astype(np.float64), _lut(fb).astype(np.float64)))
        sums = np.empty((kb, mi.size))
        job = bsum_job(a.ctypes.data, None if aT is None else aT.ctypes.data, b.ctypes.data, va.ctypes.data,
                       vb.ctypes.data, mi.ctypes.data, ni.ctypes.data, sums.ctypes.data, M, K, mi.size, bk,
                       b.strides[0], b.strides[1])
        # one task per thread: with b row-major every task streams all of b
        parallel("fp8ref_block_sums", job, mi.size, work=mi.size * K, keep=(a, aT, b, va, vb, mi, ni, sums))
        return sums.T
    starts = np.arange(0, K, bk)
    narrow = _products_exact_in_fp32(fa, fb)
    A_ = decode(ca, fa) if narrow else decode(ca, fa).astype(np.float64)
    step = max(1, _REPAIR_BYTES // (8 * max(K, 1)))
    done = []
    for e0 in range(0, mi.size, step):
        m, n = mi[e0:e0 + step], ni[e0:e0 + step]
        prods = decode(np.ascontiguousarray(np.take(cb, n, axis=1).T), fb)
        if not narrow:
            prods = prods.astype(np.float64)
        prods *= np.take(A_, m, axis=0)  # exact
        done.append(np.add.reduceat(prods, starts, axis=1, dtype=np.float64))  # (e, kb): exact block sums
    return np.concatenate(done) if done else np.zeros((0, kb))
