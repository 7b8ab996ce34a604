"""Exact products of block-scaled operands under a global scale (NVFP4's two-level scaling).

``global_scaled_linear(xv, wv, g, meaning)`` is y[m, n] = sum_k xv[m, k] * wv[n, k] * g
(``meaning="multiplier"``) or the same sum / g (``"divisor"``: compressed-tensors' NVFP4
global scales), rounded once (RNE) to ``out_dtype``. ``xv`` and ``wv`` are the operands'
dequantized values without their global scale (element value x block scale: E2M1 x E4M3 has at
most 6 significant bits, E4M3 x E8M0 4), so every product xv * wv is exact in float64 (checked);
the sum is made exact by error-free extraction (``fp8ref.exact.extract``) and rounded once by the
exact epilogue (a multiplier g enters through TwoProduct; a divisor through exact comparisons of
the sum with midpoint * g). ``g`` is the product of the two operands' globals (exact in float64:
two float32 values).

``block_scaled_linear(xe, sx, we, sw, block, ...)`` is the same value from the operands kept apart:
element values and per-block scales of both sides (W4A4 / W8A8 NVFP4 and MX). Each block's sum of
element products is exact in float64 whatever the order (``_block_sums_exact``: few-bit products
on a common quantum), so a float64 batched matmul gives it; times the exact scale product it is one
exact term per block, and the exact sum runs over K / block terms instead of K (32x fewer for MX):
the same bits, at a fraction of the cost at M = 1."""

from __future__ import annotations

import numpy as np

from ..errors import ShapeError
from ..exact import extract, two_product
from ..rounding import OUT_FORMATS
from .epilogue import _round_exact, _round_quotient_exact

MEANINGS = ("multiplier", "divisor")
_CHUNK = 1 << 22  # products per step (M x N-chunk x K float64 values)


def _significant_bits(v: np.ndarray) -> int:
    m, _ = np.frexp(np.abs(v[np.isfinite(v) & (v != 0)]))
    if m.size == 0:
        return 0
    bits = 0
    while (m * 2.0 ** bits != np.floor(m * 2.0 ** bits)).any():
        bits += 1
    return bits


def global_scaled_linear(xv: np.ndarray, wv: np.ndarray, g: float, meaning: str, *, bias=None,
                         out_dtype: str = "float32") -> np.ndarray:
    """(M, K) x (N, K) -> (M, N) float64 holding values of ``out_dtype``, rounded once."""
    xv, wv = np.asarray(xv, np.float64), np.asarray(wv, np.float64)
    if xv.ndim != 2 or wv.ndim != 2 or xv.shape[1] != wv.shape[1]:
        raise ShapeError(f"xv, wv: expected (M, K) and (N, K), got {xv.shape} and {wv.shape}")
    if meaning not in MEANINGS:
        raise ShapeError(f"meaning: expected one of {MEANINGS}, got {meaning!r}")
    if not (np.isfinite(g) and g > 0):
        raise ShapeError(f"g: expected a positive finite global scale, got {g!r}")
    if _significant_bits(xv) + _significant_bits(wv) > 53:
        raise ShapeError("xv, wv: products would not be exact in float64 (more than 53 significant bits)")
    out = OUT_FORMATS[out_dtype]
    (M, K), N = xv.shape, wv.shape[0]
    g = np.float64(g)
    result = np.empty((M, N))
    cols = max(1, _CHUNK // max(1, M * K))
    for c0 in range(0, N, cols):
        w = wv[c0:c0 + cols]
        p = (xv[:, None, :] * w[None, :, :]).reshape(M * len(w), K).T  # (K, M*n): exact products
        b = None if bias is None else np.broadcast_to(np.asarray(bias, np.float64)[c0:c0 + cols],
                                                       (M, len(w))).reshape(1, -1)
        if meaning == "multiplier":  # sum(p) * g + b, with p * g = hi + lo exactly
            stack = np.concatenate([*two_product(p, g)] + ([] if b is None else [b]))
            y = _round_exact(extract(stack), out)
            y = np.where(np.abs(y) > out.max, np.copysign(np.inf, y), y)  # IEEE overflow (unbounded rounding above)
        else:  # (sum(p) + b * g) / g
            stack = np.concatenate([p] + ([] if b is None else [*two_product(b, g)]))
            y = _round_quotient_exact(extract(stack), g, out)
        result[:, c0:c0 + cols] = y.reshape(M, len(w))
    return result


def _block_sums_exact(fa, fb, block: int) -> bool:
    """True when every partial sum of ``block`` products of a value of ``fa`` and one of ``fb`` is
    a float64 number: products are integer multiples of q = min_a * min_b (smallest subnormals),
    at most max_a * max_b / q of them: a sum of ``block`` within 45 bits leaves 8 for the two scales."""
    q = fa.min_positive * fb.min_positive
    return fa.max * fb.max * block / q < 2.0 ** 45


def _within_bits(v, bits: int) -> bool:
    """Every finite nonzero value has at most ``bits`` significant bits (E4M3: 4, E8M0: 1)."""
    m, _ = np.frexp(np.asarray(v, np.float64))
    m = m * 2.0 ** bits
    return bool(np.all(m == np.floor(m)))


def block_scaled_linear(xe: np.ndarray, sx: np.ndarray, we: np.ndarray, sw: np.ndarray, block: int, fa, fb,
                        g: float, meaning: str, *, bias=None, out_dtype: str = "float32") -> np.ndarray:
    """``global_scaled_linear`` of xv = xe * sx (per 1 x block) and wv = we * sw, from xe (M, K) and
    we (N, K) element values of formats ``fa`` / ``fb`` and their block scales sx (M, KB), sw (N, KB)
    (E4M3 or E8M0 values: products of two have at most 8 significant bits): (M, N) float64 holding
    values of ``out_dtype``, rounded once."""
    xe, we = np.asarray(xe, np.float64), np.asarray(we)
    (M, K), N = xe.shape, we.shape[0]
    kb = -(-K // block)
    if not (_block_sums_exact(fa, fb, block) and _within_bits(sx, 4) and _within_bits(sw, 4)):
        return global_scaled_linear(xe * np.repeat(sx, block, axis=1)[:, :K], we * np.repeat(sw, block, axis=1)[:, :K],
                                    g, meaning, bias=bias, out_dtype=out_dtype)
    if meaning not in MEANINGS:
        raise ShapeError(f"meaning: expected one of {MEANINGS}, got {meaning!r}")
    # float32 where every block sum fits its 24 bits (FP4 elements): half the bytes, the same exact sums
    if fa.max * fb.max * block / (fa.min_positive * fb.min_positive) < 2.0 ** 24:
        xe, we = xe.astype(np.float32, copy=False), we.astype(np.float32, copy=False)
    pad = kb * block - K
    if pad:
        xe, we = np.pad(xe, ((0, 0), (0, pad))), np.pad(we, ((0, 0), (0, pad)))
    xb = xe.reshape(M, kb, block).transpose(1, 0, 2)  # (KB, M, block) views: BLAS takes the strides as they are
    wb = we.reshape(N, kb, block).transpose(1, 2, 0)  # (KB, block, N)
    sx, sw = np.asarray(sx, np.float64), np.asarray(sw, np.float64)
    out = OUT_FORMATS[out_dtype]
    g = np.float64(g)
    result = np.empty((M, N))
    cols = max(1, _CHUNK // max(1, M * kb))
    for c0 in range(0, N, cols):
        c1 = min(N, c0 + cols)
        sums = np.matmul(xb, wb[:, :, c0:c1]).astype(np.float64)  # (KB, M, n): exact block sums, in any order
        # times the scales: at most 8 significant bits (E4M3 x E4M3) on an exact sum of < 53 - 8 bits
        p = (sums * sx.T[:, :, None] * sw[c0:c1].T[:, None, :]).reshape(kb, -1)
        b = None if bias is None else np.broadcast_to(np.asarray(bias, np.float64)[c0:c1],
                                                       (M, c1 - c0)).reshape(1, -1)
        if meaning == "multiplier":
            stack = np.concatenate([*two_product(p, g)] + ([] if b is None else [b]))
            y = _round_exact(extract(stack), out)
            y = np.where(np.abs(y) > out.max, np.copysign(np.inf, y), y)
        else:
            stack = np.concatenate([p] + ([] if b is None else [*two_product(b, g)]))
            y = _round_quotient_exact(extract(stack), g, out)
        result[:, c0:c1] = y.reshape(M, c1 - c0)
    return result
