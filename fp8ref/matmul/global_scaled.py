"""Exact products of block-scaled operands under a global scale (NVFP4's two-level scaling).

``global_scaled_linear(xv, wv, g, meaning)`` is y[m, n] = sum_k xv[m, k] * wv[n, k] * g
(``meaning="multiplier"``) or the same sum / g (``"divisor"``: compressed-tensors' NVFP4
global scales), rounded once (RNE) to ``out_dtype``. ``xv`` and ``wv`` are the operands'
dequantized values without their global scale (element value x block scale: E2M1 x E4M3 has at
most 6 significant bits, E4M3 x E8M0 4), so every product xv * wv is exact in float64 (checked);
the sum is made exact by error-free extraction (``fp8ref.exact.extract``) and rounded once by the
exact epilogue (a multiplier g enters through TwoProduct; a divisor through exact comparisons of
the sum with midpoint * g). ``g`` is the product of the two operands' globals (exact in float64:
two float32 values)."""

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
