"""accumulate="exact" at the cost of float64 GEMMs: the fast path of exact.py (docs/matmul.md, "Speed").

It applies when one integer piece per operand suffices for the formats' whole code spans
(``_piece_count``: every finite value is an integer times 2**g and every partial sum of a K-block
dot product stays below 2**53) and no NaN/Inf code occurs. Then:

- scales constant along K: T = A @ B (float64 GEMMs of the decoded values, one per column panel
  of b, decoded into a reused buffer right before its GEMM reads it) is the exact dot product in
  any BLAS order, with or without FMA; x = s * T + bias with s = sa * sb
  exact (two float32 values). y = fl(fl(s * T) + bias) is within ulp(s * T)/2 + ulp(y)/2 of x (no
  bias: y is fl(x) itself), which decides almost every element from y's float64 bits
  (epilogue._decide_sum, per panel while T is in cache); the rest take s * T as an exact
  TwoProduct and the exact rounding of epilogue.py.
- K-blocked scales: with a' = a * sa and b' = b * sb (exact), y = bias + sum_i A'_i @ B'_i over
  groups i of whole scale blocks (batched GEMMs, then the sum) satisfies |y - x| <= gamma_n
  (|bias| + S), S = sum_k |a' b'| <= sum_b |a'_(m,b)| |b'_(b,n)| (Cauchy-Schwarz per block, a
  small GEMM of block norms). The elements this leaves undecided (epilogue._decide_bound) get their
  exact block sums from their own row and column, TwoProducts with the block scales and the exact
  rounding.

Anything else (NaN/Inf, e5m2-wide spans, K past the bound) returns None: exact.py's general path,
which is also the oracle of this one (tests/unit/test_matmul_fast.py).
"""

from __future__ import annotations

import math

import numpy as np

from .._arrays import torch
from .._native import dec_job, kernels, parallel
from ..codec import decode
from ..errors import ShapeError
from ..exact import extract, two_product
from ..formats import FloatFormat
from ..rounding import OutFormat
from .epilogue import CodeOut, _decide_bound, _decide_sum, _round_exact
from .exact import _piece_count, _span
from .fp32 import _products_exact_in_fp32
from .operands import _check_codes, _code_values

_CHUNK_BYTES = 1 << 26  # float64 rows of b staged at a time: bounded memory, few GEMM calls (short ones run slower)
_PANEL_COLS = 512  # columns of b per panel (scales constant along K): decoded and used while in cache
_GROUP_K = 512  # K of each GEMM of the blocked path (whole scale blocks): shorter ones run far slower
_REPAIR_BYTES = 1 << 25  # bytes of row-times-column products per repair step


class _NonFinite(Exception):
    """A NaN or Inf code occurs: the general path decides."""


def _fast_exact(ca, cb, fa: FloatFormat, fb: FloatFormat, sa, sb, bk: int, bias, out):
    """The exact model's result, or None where the general path must run."""
    (M, K), N = ca.shape, cb.shape[1]
    every = np.ones(fa.n_codes, bool), np.ones(fb.n_codes, bool)
    try:
        pieces = _piece_count(_span(fa, every[0]), _span(fb, every[1]), fa.mantissa_bits, fb.mantissa_bits,
                              min(bk, K))
    except ShapeError:
        return None
    if pieces != (1, 1):
        return None
    finite_bias = None if bias is None else np.where(np.isfinite(bias), bias, 0.0)
    try:
        A = _values(ca, fa, "a")
        if sa.shape[1] == 1:
            s = sa * sb  # (M, 1) * (1, N) or (1, 1): exact, two float32 values
            tiny = _tiny_possible(s, finite_bias, fa, fb, out)
            result = np.empty((M, N))
            for n0, n1, T in _panels(A, cb, fb):  # the epilogue of each panel while it is in cache
                result[:, n0:n1] = _round_scaled(T, s[:, n0:n1] if s.shape[1] > 1 else s,
                                                 None if finite_bias is None else finite_bias[n0:n1], out, tiny)
        else:
            result = _blocked(A, fa, cb, fb, sa, sb, bk, finite_bias, out)
    except _NonFinite:
        return None
    if bias is not None and not np.isfinite(bias).all():  # a non-finite bias is the sum (IEEE)
        result = np.where(~np.isfinite(bias), bias + np.zeros((M, 1)), result)
    return result


class _Stager:
    """float64 values of one format's codes, written into caller buffers (the operands of the
    float64 GEMMs). With the C loops: fp8ref_decode_f64 through a float32 table (every value of a
    format float32 holds is exact there) whose NaN/Inf codes and codes past 2**bits read NaN, so a
    row that holds one is flagged without a second pass; only then are the codes checked
    (_check_codes: FormatError or _NonFinite). Without them: check, decode, widen."""

    def __init__(self, fmt: FloatFormat):
        self.fmt = fmt
        self.table = None
        if kernels() is not None:
            v = _code_values(fmt)
            self.table = np.full(256, np.nan, np.float32)
            self.table[:fmt.n_codes] = np.where(np.isfinite(v), v, np.nan)

    def __call__(self, codes: np.ndarray, values: np.ndarray, what: str) -> None:
        """values[...] = the values of the 2-D ``codes`` (any strides; values' rows contiguous);
        _NonFinite on a NaN/Inf code (and FormatError on codes past 2**bits, as on the general path)."""
        if self.table is not None and codes.size:
            flags = np.empty(codes.shape[0], np.uint8)
            job = dec_job(codes.ctypes.data, values.ctypes.data, self.table.ctypes.data, flags.ctypes.data,
                          codes.strides[0], codes.strides[1], values.strides[0] // 8, codes.shape[1])
            parallel("fp8ref_decode_f64", job, codes.shape[0], work=codes.size, keep=(codes, values, flags))
            if not flags.any():
                return
        if _check_codes(codes, self.fmt, what):
            raise _NonFinite
        if codes.size:
            values[...] = decode(codes, self.fmt)


def _values(codes: np.ndarray, fmt: FloatFormat, what: str) -> np.ndarray:
    codes = np.ascontiguousarray(codes)
    values = np.empty(codes.shape)
    _Stager(fmt)(codes, values, what)
    return values


def _row_chunks(cb: np.ndarray, fb: FloatFormat, rows: int):
    """(k0, float64 values of cb[k0:k0 + rows]) in turn, all in one buffer (use each before the
    next step): b is never held whole in float64."""
    K, N = cb.shape
    rows = max(1, min(K, rows))
    buf = np.empty((rows, N))
    stage = _Stager(fb)
    for k0 in range(0, K, rows):
        values = buf[:min(rows, K - k0)]
        stage(cb[k0:k0 + rows], values, "b")
        yield k0, values


def _panels(A: np.ndarray, cb: np.ndarray, fb: FloatFormat):
    """(n0, n1, T = A @ B[:, n0:n1]) for column panels of _PANEL_COLS in turn, T exact (float64
    GEMMs: every partial sum, in any order, with or without FMA, across K-chunks too, is an
    integer times 2**g below 2**53). Each panel of b is decoded into one reused buffer that the
    GEMM reads while it is still in cache (no float64 copy of b in memory); K is cut into chunks
    only where a panel would pass _CHUNK_BYTES. Use each T before the next step (one buffer)."""
    M, K = A.shape
    N = cb.shape[1]
    cols = max(1, min(N, _PANEL_COLS))
    rows = max(1, min(K, _CHUNK_BYTES // (8 * cols)))
    b_buf, t_buf = np.empty(rows * cols), np.empty(M * cols)
    stage, t = _Stager(fb), _torch()
    for n0 in range(0, N, cols):
        w = min(cols, N - n0)
        T = t_buf[:M * w].reshape(M, w)
        for k0 in range(0, K, rows):
            kr = min(rows, K - k0)
            B = b_buf[:kr * w].reshape(kr, w)
            stage(cb[k0:k0 + kr, n0:n0 + w], B, "b")
            a = A[:, k0:k0 + kr]
            if t is None:
                if k0:
                    T += a @ B
                else:
                    np.matmul(a, B, out=T)
            elif k0:
                t.from_numpy(T).addmm_(t.from_numpy(a), t.from_numpy(B))
            else:
                t.mm(t.from_numpy(a), t.from_numpy(B), out=t.from_numpy(T))
        if K == 0:
            T[...] = 0.0
        yield n0, n0 + w, T


def _torch():
    """torch (its BLAS is the faster one here), or None: numpy's matmul then."""
    try:
        return torch()
    except ImportError:
        return None


def _round_scaled(T: np.ndarray, s: np.ndarray, finite_bias, out, tiny: bool) -> np.ndarray:
    """One rounding of x = s * T + bias (s exact, T exact)."""
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


def _blocked(A, fa, cb, fb, sa, sb, bk: int, finite_bias, out) -> np.ndarray:
    """K-blocked scales: float64 GEMMs of the scaled operands over groups of whole scale blocks
    with a proven bound, the undecided elements exactly (module docstring)."""
    M, K = A.shape
    N = cb.shape[1]
    kb = sa.shape[1]
    g = max(1, _GROUP_K // bk)  # scale blocks per GEMM
    ng = -(-kb // g)
    gk = g * bk
    Ap = np.zeros((M, ng * gk))  # a' = a * sa (exact: at most 24 + 24 significant bits), zero padded
    np.multiply(A, np.repeat(sa, bk, axis=1)[:, :K], out=Ap[:, :K])
    blocks = Ap.reshape(M, ng * g, bk)
    a_norms = np.sqrt(np.einsum("mbk,mbk->mb", blocks, blocks))[:, :kb]
    As = np.ascontiguousarray(Ap.reshape(M, ng, gk).transpose(1, 0, 2))  # (ng, M, gk)
    del Ap
    Bs = np.empty((ng * gk, N))  # b' = b * sb (exact), zero padded
    Bs[K:] = 0.0
    b_norms = np.empty((kb, N))
    for k0, B in _row_chunks(cb, fb, max(bk, (_CHUNK_BYTES // (8 * max(N, 1))) // bk * bk)):
        for j in range(-(-B.shape[0] // bk)):
            blk, rows = k0 // bk + j, B[j * bk:(j + 1) * bk]
            part = Bs[blk * bk:blk * bk + rows.shape[0]]
            np.multiply(rows, sb[blk], out=part)
            np.einsum("kn,kn->n", part, part, out=b_norms[blk])
    np.sqrt(b_norms, out=b_norms)
    y = _group_sums(As, Bs.reshape(ng, gk, N))
    # |y - x| <= gamma_n (|bias| + S), n = gk + ng + 1 (gk products and additions per GEMM, ng
    # GEMM results and the bias added: any order, FMA or not); S <= a_norms @ b_norms (Cauchy-Schwarz
    # per scale block). gamma_n = n u / (1 - n u) with u = 2**-53, and the computed norms, their
    # product and the bound itself are below the exact ones by a relative (bk + kb + 8) u at most:
    # the factor 1 + 4 (n + bk + kb + 8) u covers both
    n = gk + ng + 1
    slack = n * 2.0 ** -53 * (1 + 4 * (n + bk + kb + 8) * 2.0 ** -53)
    bound = (a_norms * slack) @ b_norms
    if finite_bias is not None:
        y += finite_bias
        bound += np.abs(finite_bias) * slack
    c, sure = out.candidate(y, bound) if isinstance(out, CodeOut) else _decide_bound(y, bound, out)
    if not sure.all():
        unsure = np.nonzero(~sure)
        c[unsure] = _overflow(_repair(A, fa, cb, fb, sa, sb, bk, finite_bias, unsure, out), out)
    return c


def _group_sums(As: np.ndarray, Bs: np.ndarray) -> np.ndarray:
    """sum_i As[i] @ Bs[i] in float64: a batched GEMM per column chunk (one call: separate GEMM
    calls cost far more), then the sum over the groups."""
    ng, M, _ = As.shape
    N = Bs.shape[2]
    y = np.empty((M, N))
    cols = max(1, min(N, _CHUNK_BYTES // (8 * ng * max(M, 1))))
    buf = np.empty(ng * M * cols)
    t = _torch()
    for c0 in range(0, N, cols):
        c1 = min(N, c0 + cols)
        parts = buf[:ng * M * (c1 - c0)].reshape(ng, M, c1 - c0)
        if t is None:
            np.matmul(As, Bs[:, :, c0:c1], out=parts)
        else:
            t.bmm(t.from_numpy(As), t.from_numpy(Bs)[:, :, c0:c1], out=t.from_numpy(parts))
        np.sum(parts, axis=0, out=y[:, c0:c1])
    return y


def _repair(A, fa, cb, fb, sa, sb, bk: int, finite_bias, idx, out) -> np.ndarray:
    """Exact rounding of the elements (idx[0], idx[1]): per scale block the integer dot product of
    the element's own row and column of values (products exact in float32 where the formats allow,
    sums in float64: exact in any order, one piece), times its block scale as an exact TwoProduct,
    the bias, then the exact summation and rounding of epilogue.py."""
    K = A.shape[1]
    starts = np.arange(0, K, bk)
    narrow = _products_exact_in_fp32(fa, fb)
    A_ = A.astype(np.float32) if narrow else A
    step = max(1, _REPAIR_BYTES // (8 * max(K, 1)))
    done = []
    for e0 in range(0, idx[0].size, step):
        mi, ni = idx[0][e0:e0 + step], idx[1][e0:e0 + step]
        prods = decode(np.ascontiguousarray(np.take(cb, ni, axis=1).T), fb)
        if not narrow:
            prods = prods.astype(np.float64)
        prods *= np.take(A_, mi, axis=0)  # exact
        sums = np.add.reduceat(prods, starts, axis=1, dtype=np.float64)  # (e, kb): exact block sums
        terms = [finite_bias[ni] if finite_bias is not None else np.zeros(mi.size)]
        for blk in range(sums.shape[1]):
            terms.extend(two_product(sa[mi, blk] * sb[blk, ni], sums[:, blk]))  # scale exact
        done.append(_round_exact(extract(np.stack(terms)), out))
    return np.concatenate(done)
