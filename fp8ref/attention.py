"""The reference attention with an FP8 KV cache (and optionally FP8 Q): one exactly defined,
deterministic computation, used by the golden ``attention`` operation and by ``fp8ref.nn``'s
reference mode alike (docs/models.md, "The reference attention").

With D the model dtype, inputs whose values D holds (q: (B, H, Tq, d); k, v: (B, Hkv, Tk, d),
H a multiple of Hkv, head h reading KV head h // (H / Hkv)) and per-tensor dequantization
multipliers k_s, v_s (and q_s) held by float32:

1. codes: ``K8 = encode(fp32(K / k_s))`` (fp32 division, RNE, saturating), V8 likewise, Q8 when
   q_s is given; k = decode(K8), v = decode(V8), q = decode(Q8) or Q itself. Every value below is
   float64 and every operation one IEEE float64 operation (no fused multiply-add), in this order:
2. bmm1: ``A[i, j] = ((q[i,0] k[j,0] + q[i,1] k[j,1]) + ...) + q[i,d-1] k[j,d-1]`` (sequential in
   the head dimension; exact when Q is FP8, as a scaled_mm of the codes), ``c1 = (q_s * k_s) * sm``
   with sm = 1 / sqrt(d) (each correctly rounded) unless given, ``S = A * c1``; masked entries
   (causal: key j > query i + Tk - Tq, the cache's last query aligned with the last key) are -inf.
3. softmax: ``m = max_j S``, ``e = exp64(S - m)`` (``exp64`` below: + * / and ldexp only, so its
   result does not depend on a libm), ``z = e[0] + e[1] + ...`` (sequential in j), ``P = e / z``.
4. bmm2: ``O = ((P[0] v[0] + P[1] v[1]) + ...) * v_s`` (sequential in j), rounded once (RNE) to D.
   With ``p_scale`` p_s (FP8 P, as FP8 attention kernels feed an FP8 bmm2): ``P8 = encode(P / p_s)``
   (one float64 division, one RNE to e4m3fn from float64, saturating), p = decode(P8), and
   ``O = ((p[0] v[0] + p[1] v[1]) + ...) * c2`` with ``c2 = p_s * v_s`` (exact: two float32 values);
   with e4m3fn V the sum is exact (every e4m3 x e4m3 product is a multiple of 2**-18, every partial
   sum below 2**53 of them for Tk < 2**17), so O is the real (p_s v_s) sum p v rounded to float64, then to D.

A query row with no unmasked key gives +0. NaN propagates (a NaN K or V code poisons its rows).
"""

from __future__ import annotations

import math

import numpy as np

from .codec import decode, encode
from .errors import InputTypeError
from .formats import get_format
from .rounding import round_to

# fdlibm's split of ln 2: _LN2_HI has 32 trailing zero bits, so k * _LN2_HI is exact for |k| < 2**20
_LN2_HI = 6.93147180369123816490e-01
_LN2_LO = 1.90821492927058770002e-10
_INV_LN2 = 1.44269504088896338700e+00
P_FORMAT = get_format("float8_e4m3fn")  # FP8 P: the format FP8 attention kernels feed bmm2
_TAYLOR = tuple(1.0 / math.factorial(n) for n in range(14))  # each correctly rounded


def exp64(x: np.ndarray) -> np.ndarray:
    """exp(x) for float64 x <= 0 (-inf gives 0) with a fixed sequence of IEEE operations:
    k = rint(x / ln 2), r = (x - k ln2_hi) - k ln2_lo, a degree-13 Taylor polynomial of r in
    Horner form, times 2**k (ldexp). Within a few ulps of exp; what matters is that it is
    the same bits on every machine (numpy's own exp is libm's or SIMD code)."""
    x = np.maximum(np.asarray(x, np.float64), -800.0)  # exp(-800) underflows to 0 below anyway
    k = np.rint(x * _INV_LN2)
    r = (x - k * _LN2_HI) - k * _LN2_LO
    p = np.full_like(r, _TAYLOR[13])
    for c in reversed(_TAYLOR[:13]):
        p = p * r + c
    return np.ldexp(p, k.astype(np.int64))


def quantize_per_tensor(x: np.ndarray, scale, fmt="float8_e4m3fn") -> np.ndarray:
    """Codes of ``encode(fp32(x / scale))`` (RNE, saturating): the KV-cache (and Q) rule."""
    x32 = np.asarray(x, np.float32)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        return encode((x32 / np.float32(scale)).astype(np.float32), get_format(fmt))


def causal_mask(tq: int, tk: int) -> np.ndarray:
    """(Tq, Tk) True where query i may see key j: j <= i + Tk - Tq."""
    return np.arange(tk)[None, :] <= np.arange(tq)[:, None] + (tk - tq)


def _heads(x: np.ndarray, h: int, what: str) -> np.ndarray:
    hkv = x.shape[1]
    if h % hkv:
        raise InputTypeError(f"attention: {what} has {hkv} heads, which do not divide the query's {h}")
    return np.repeat(x, h // hkv, axis=1)


def attention(q, k, v, k_scale, v_scale, *, dtype: str, q_scale=None, fmt="float8_e4m3fn", causal=False,
              mask=None, sm_scale: float | None = None, p_scale=None, unrounded: bool = False):
    """The reference attention output (B, H, Tq, d) as float32 values of ``dtype`` (float64
    for ``unrounded=True``: O before its rounding to D, which the torch tolerance rule is centred on).
    ``mask``: bool, broadcastable to (B, H, Tq, Tk), True where attending is allowed (with ``causal``).
    ``p_scale``: P's float32 dequantization multiplier (e.g. fp32(1/448)): bmm2 on e4m3fn P codes
    (step 4); None keeps P in float64."""
    q, k, v = (np.asarray(t, np.float32) for t in (q, k, v))
    if q.ndim != 4 or k.shape != v.shape or k.ndim != 4 or q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise InputTypeError(f"attention: expected q (B, H, Tq, d) and k, v (B, Hkv, Tk, d), got "
                             f"{list(q.shape)}, {list(k.shape)}, {list(v.shape)}")
    B, H, Tq, d = q.shape
    Tk = k.shape[2]
    f = get_format(fmt)
    kd = _heads(decode(quantize_per_tensor(k, k_scale, f), f).astype(np.float64), H, "k")
    vd = _heads(decode(quantize_per_tensor(v, v_scale, f), f).astype(np.float64), H, "v")
    qd = q.astype(np.float64) if q_scale is None else decode(quantize_per_tensor(q, q_scale, f), f).astype(np.float64)
    qs = 1.0 if q_scale is None else float(np.float32(q_scale))
    sm = 1.0 / math.sqrt(d) if sm_scale is None else float(sm_scale)
    c1 = (qs * float(np.float32(k_scale))) * sm
    with np.errstate(invalid="ignore", over="ignore"):
        a = qd[..., :, None, 0] * kd[..., None, :, 0]
        for t in range(1, d):
            a = a + qd[..., :, None, t] * kd[..., None, :, t]
        s = a * c1
        allowed = np.ones((1, 1, Tq, Tk), bool)
        if causal:
            allowed = allowed & causal_mask(Tq, Tk)
        if mask is not None:
            allowed = allowed & np.asarray(mask, bool)
        allowed = np.broadcast_to(allowed, s.shape)
        s = np.where(allowed, s, -np.inf)
        m = s.max(axis=-1, keepdims=True)
        empty = ~allowed.any(axis=-1, keepdims=True)
        e = exp64(np.where(empty, -np.inf, s - np.where(empty, 0.0, m)))
        z = e[..., 0]
        for j in range(1, Tk):
            z = z + e[..., j]
        p = e / np.where(empty[..., 0], 1.0, z)[..., None]
        c2 = float(np.float32(v_scale))
        if p_scale is not None:
            ps = float(np.float32(p_scale))
            p = decode(encode(p / ps, P_FORMAT), P_FORMAT).astype(np.float64)
            c2 = ps * c2
        o = p[..., 0, None] * vd[:, :, None, 0, :]
        for j in range(1, Tk):
            o = o + p[..., j, None] * vd[:, :, None, j, :]
        o = o * c2
    return o if unrounded else round_to(o, dtype)
