"""accumulate="exact": the exact sum, rounded once (docs/matmul.md has the proof).

Integer matmuls in float64 whose exactness is proved per call; the float64 combination of the scaled
block sums decides every element that is provably far from a rounding boundary, the others get an
error-free summation (Rump, Ogita and Oishi's extraction) and exact midpoint comparisons."""

from __future__ import annotations

import math

import numpy as np

from ..codec import decode
from ..errors import ShapeError
from ..exact import extract, two_product
from ..formats import FloatFormat
from ..rounding import OutFormat, exponent
from .epilogue import _candidate, _round_exact
from .operands import _check_codes, _code_values

_CHUNK = 1 << 16  # output elements per vectorized step of the exact rounding (cache sized)


def _int_pieces(codes: np.ndarray, fmt: FloatFormat, present: np.ndarray, n: int):
    """Split the finite values of ``codes`` into n pieces by binade: value == sum(ints_i * 2**g_i)
    with every ints_i integer-valued and |ints_i| < 2**(ceil(span/n) + M) (see _piece_count).
    Built by table lookup: one gather per piece."""
    values = _code_values(fmt)
    e = np.full(values.shape, np.iinfo(np.int64).min)
    nz = np.isfinite(values) & (values != 0)
    e[nz] = np.maximum(exponent(values[nz]), fmt.emin)
    used = e[nz & present]
    if not used.size:
        return [(np.zeros(codes.shape), 0)]
    lo, hi = int(used.min()), int(used.max())
    step = -(-(hi - lo + 1) // n)
    pieces = []
    for i in range(n):
        first = lo + i * step
        g = first - fmt.mantissa_bits
        table = np.where((e >= first) & (e < first + step), np.ldexp(np.where(nz, values, 0.0), -g), 0.0)
        pieces.append((np.take(table, codes), g))
    return pieces


def _span(fmt: FloatFormat, present: np.ndarray) -> int:
    """Number of binades (subnormals count as emin) among the finite nonzero values present."""
    values = _code_values(fmt)
    nz = np.isfinite(values) & (values != 0) & present
    if not nz.any():
        return 1
    e = np.maximum(exponent(values[nz]), fmt.emin)
    return int(e.max() - e.min() + 1)


def _present(codes: np.ndarray, fmt: FloatFormat) -> np.ndarray:
    """Which of the format's codes occur (bool per code)."""
    return np.bincount(codes.reshape(-1), minlength=256)[:fmt.n_codes] > 0


def _piece_count(span_a: int, span_b: int, m_a: int, m_b: int, k: int) -> tuple[int, int]:
    """Fewest pieces nA * nB such that every partial sum of a k-long dot product of integer pieces
    stays below 2**53: width(a) + width(b) + ceil(log2 k) <= 53, width = ceil(span/n) + M."""
    budget = 53 - math.ceil(math.log2(max(k, 1)))
    best = None
    for na in range(1, span_a + 1):
        for nb in range(1, span_b + 1):
            if -(-span_a // na) + m_a + -(-span_b // nb) + m_b <= budget:
                if best is None or na * nb < best[0] * best[1]:
                    best = (na, nb)
                break
    if best is None:
        raise ShapeError(f"K = {k} is too long for an exact float64 integer product")
    return best


def _specials(A: np.ndarray, B: np.ndarray) -> np.ndarray:
    """IEEE value of sum_k a*b where it is NaN or +-Inf (NaN operand, Inf*0, Inf - Inf), 0 elsewhere.
    Counts are products of 0/1 matrices: exact in float64."""
    f = np.float64
    nan_a, nan_b = np.isnan(A), np.isnan(B)
    pos_a, neg_a = (A > 0).astype(f), (A < 0).astype(f)
    pos_b, neg_b = (B > 0).astype(f), (B < 0).astype(f)
    inf_a, inf_b = np.isinf(A), np.isinf(B)
    zero_a, zero_b = (A == 0).astype(f), (B == 0).astype(f)
    nan = (nan_a.any(axis=1)[:, None] | nan_b.any(axis=0)[None, :]
           | ((inf_a.astype(f) @ zero_b + zero_a @ inf_b.astype(f)) > 0))
    ipa, ina = (inf_a & (A > 0)).astype(f), (inf_a & (A < 0)).astype(f)
    ipb, inb = (inf_b & (B > 0)).astype(f), (inf_b & (B < 0)).astype(f)
    plus = (ipa @ pos_b + ina @ neg_b + pos_a @ ipb + neg_a @ inb) > 0
    minus = (ipa @ neg_b + ina @ pos_b + pos_a @ inb + neg_a @ ipb) > 0
    return np.where(nan | (plus & minus), np.nan, np.where(plus, np.inf, np.where(minus, -np.inf, 0.0)))


def _narrow(s: np.ndarray) -> np.ndarray:
    """A (n, 1) or (1, n) scale slice whose entries are all equal as a (1, 1) array (cheaper products)."""
    return s[:1, :1] if s.size and (s == s.flat[0]).all() else s


def _per_block(pa, pb, sa, sb, bk, finite_bias, out: OutFormat) -> np.ndarray:
    """Exact rounding from one exact float64 integer matmul per K-block and piece pair (docs/matmul.md)."""
    M, K = pa[0][0].shape
    N = pb[0][0].shape[1]
    kb = sa.shape[1]
    n_terms = kb * len(pa) * len(pb)
    cols = max(1, min(N, (1 << 24) // max(1, n_terms * M)))  # bound the stored sums to ~128 MiB
    result = np.empty((M, N))
    for c0 in range(0, N, cols):
        cs = slice(c0, min(N, c0 + cols))
        sums, scales = [], []  # exact block dot products (float64 integers times 2**g) and their scales
        y = np.zeros((M, cs.stop - c0)) if finite_bias is None else np.broadcast_to(finite_bias[cs], (M, cs.stop - c0))
        mag = np.abs(y)
        for blk in range(kb):
            ks = slice(blk * bk, min(K, (blk + 1) * bk))
            scale = _narrow(sa[:, blk:blk + 1]) * _narrow(sb[blk:blk + 1, cs])  # exact: two float32 values
            for ia, ga in pa:
                for ib, gb in pb:
                    sums.append(np.ldexp(ia[:, ks] @ ib[ks, cs], ga + gb))
                    scales.append(scale)
                    t = scale * sums[-1]
                    y, mag = y + t, mag + np.abs(t)
        # y: n_terms rounded products and n_terms additions -> |y - x| <= 2 n_terms 2**-53 sum|terms|
        c, sure = _candidate(y, 4.0 * mag * ((2 * n_terms + 2) * 2.0 ** -53), out)
        if not sure.all():  # near a rounding boundary: exact terms (TwoProduct), exact sum, exact rounding
            unsure = ~sure
            terms = [finite_bias[cs][np.nonzero(unsure)[1]] if finite_bias is not None else np.zeros(unsure.sum())]
            for scale, ps in zip(scales, sums, strict=True):
                terms.extend(two_product(np.broadcast_to(scale, ps.shape)[unsure], ps[unsure]))
            stack = np.stack(terms)
            c[unsure] = np.concatenate([_round_exact(extract(stack[:, r0:r0 + _CHUNK]), out)
                                        for r0 in range(0, stack.shape[1], _CHUNK)])
        result[:, cs] = np.where(np.abs(c) > out.max, np.copysign(np.inf, c), c)
    return result


def _blocked(pa, pb, sa, sb, bk, finite_bias, out: OutFormat, max_unsure: float = 1 / 16):
    """The K-blocked case without exact block sums: with the scales folded into the operands
    (a' = a * sa, b' = b * sb: exact, at most 24 + 24 significant bits) y = bias + sum over blocks
    of the float64 product A'_blk @ B'_blk satisfies |y - x| <= gamma_(bk + kb) (|bias| + sum_k |a' b'|)
    in any BLAS order, with or without FMA, and sum_k |a' b'| <= |a'_m| |b'_n| (Cauchy-Schwarz).
    Elements that this bound leaves undecided get exact block sums from their own row and column.
    None when more than ``max_unsure`` of the elements are undecided (the per-block path is cheaper)."""
    M, K = pa[0][0].shape
    N = pb[0][0].shape[1]
    kb = sa.shape[1]
    A = sum(np.ldexp(ia, g) for ia, g in pa) * sa[:, np.minimum(np.arange(K) // bk, kb - 1)]  # exact
    B = sum(np.ldexp(ib, g) for ib, g in pb)
    y = np.zeros((M, N)) if finite_bias is None else np.repeat(finite_bias[None, :], M, axis=0)
    b_norm2, tmp, b_buf = np.zeros(N), np.empty((M, N)), np.empty((min(bk, K), N))
    for blk, k0 in enumerate(range(0, K, bk)):
        b_blk = np.multiply(B[k0:k0 + bk], sb[blk], out=b_buf[:min(bk, K - k0)])  # exact
        np.einsum("kn,kn->n", b_blk, b_blk, out=tmp[0])
        b_norm2 += tmp[0]
        np.matmul(A[:, k0:k0 + bk], b_blk, out=tmp)
        y += tmp
    mag = np.sqrt(np.einsum("mk,mk->m", A, A))[:, None] * np.sqrt(b_norm2)[None, :]
    if finite_bias is not None:
        mag += np.abs(finite_bias)
    # 4x slack covers the rounding of mag itself (relative error about (K + 2) 2**-53)
    c, sure = _candidate(y, 4.0 * mag * ((bk + kb + 2) * 2.0 ** -53), out)
    unsure = np.nonzero(~sure)
    if unsure[0].size > max_unsure * y.size:
        return None
    if unsure[0].size:
        c[unsure] = _repair_rows(pa, pb, sa, sb, bk, finite_bias, unsure, out)
    return np.where(np.abs(c) > out.max, np.copysign(np.inf, c), c)


def _repair_rows(pa, pb, sa, sb, bk, finite_bias, idx, out: OutFormat) -> np.ndarray:
    """Exact RNE of the elements (rows idx[0], columns idx[1]): per K-block and piece pair the
    integer dot product of the element's own row and column (exact in any order, _piece_count),
    times its block scale as an exact TwoProduct, then the exact summation of _round_exact."""
    K = pa[0][0].shape[1]
    starts = np.arange(0, K, bk)
    step = max(1, (1 << 22) // max(K, 1))  # elements per pass: products held at ~32 MiB
    done = []
    for e0 in range(0, idx[0].size, step):
        mi, ni = idx[0][e0:e0 + step], idx[1][e0:e0 + step]
        terms = [finite_bias[ni] if finite_bias is not None else np.zeros(mi.size)]
        for blk, k0 in enumerate(starts):
            scale = sa[mi, blk] * sb[blk, ni]  # exact: two float32 values
            for ia, ga in pa:
                for ib, gb in pb:
                    ps = np.ldexp((ia[mi, k0:k0 + bk] * ib[k0:k0 + bk, ni].T).sum(axis=1), ga + gb)
                    terms.extend(two_product(scale, ps))
        done.append(_round_exact(extract(np.stack(terms)), out))
    return np.concatenate(done)


def _exact(ca, cb, fa, fb, sa, sb, bk, bias, out: OutFormat) -> np.ndarray:
    M, K = ca.shape
    N = cb.shape[1]
    kb = sa.shape[1]
    special = None
    if _check_codes(ca, fa, "a") | _check_codes(cb, fb, "b"):
        special = _specials(decode(ca, fa), decode(cb, fb))
    # spans of the whole formats first; the data's own spans only when those need several pieces
    present_a, present_b = np.ones(fa.n_codes, bool), np.ones(fb.n_codes, bool)
    na, nb = _piece_count(_span(fa, present_a), _span(fb, present_b), fa.mantissa_bits, fb.mantissa_bits,
                          min(bk, K))
    if na * nb > 1:
        present_a, present_b = _present(ca, fa), _present(cb, fb)
        na, nb = _piece_count(_span(fa, present_a), _span(fb, present_b), fa.mantissa_bits, fb.mantissa_bits,
                              min(bk, K))
    if special is None and na == 1:  # one piece: the values themselves (ints times 2**g, g folded in)
        pa = [(decode(ca, fa).astype(np.float64), 0)]
    else:
        pa = _int_pieces(ca, fa, present_a, na)
    if special is None and nb == 1:
        pb = [(decode(cb, fb).astype(np.float64), 0)]
    else:
        pb = _int_pieces(cb, fb, present_b, nb)
    finite_bias = None if bias is None else np.where(np.isfinite(bias), bias, 0.0)
    result = _blocked(pa, pb, sa, sb, bk, finite_bias, out) if kb > 1 else None
    if result is None:
        result = _per_block(pa, pb, sa, sb, bk, finite_bias, out)
    # NaN/Inf: the finite sum plus a non-finite bias is that bias; specials follow IEEE addition
    bias_bad = np.zeros(N, bool) if bias is None else ~np.isfinite(bias)
    if special is not None or bias_bad.any():
        sp = np.zeros((M, N)) if special is None else special
        set_ = (sp != 0) | np.isnan(sp)
        result = np.where(set_ | bias_bad, sp + (0.0 if bias is None else bias), result)
    return result
