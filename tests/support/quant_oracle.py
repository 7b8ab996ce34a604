"""An independent quantization oracle: the code of the exact quotient x / s, classified
against the Fraction grid of tests/support/oracle.py and decided by its rounding rules."""

from __future__ import annotations

import bisect
import math
from fractions import Fraction

import numpy as np

from tests.support import oracle


def exact_code(r: Fraction, fmt, *, negative_zero: bool = False, saturate: bool = True,
               rounding: str = "rne") -> int:
    """The code of the exact rational ``r`` (oracle.decide on a rational classification)."""
    g = oracle.grid(fmt)
    if r == 0:
        return oracle.decide(("zero", negative_zero), fmt, saturate, rounding)
    neg, mag = r < 0, abs(r)
    i = bisect.bisect_left(g.mags, mag)
    if i < len(g.mags) and g.mags[i] == mag:
        case = ("beyond", neg) if i == len(g.mags) - 1 else ("exact", neg, i)
    elif i == len(g.mags):
        case = ("beyond", neg)
    elif i == 0:
        case = ("below_min", neg)
    else:
        mid = (g.mags[i - 1] + g.mags[i]) / 2
        case = ("between", neg, i - 1, (mag > mid) - (mag < mid))
    return oracle.decide(case, fmt, saturate, rounding)


def fp32_nearest(r: Fraction) -> float:
    """float32 RNE of a rational, by comparing the two float32 neighbours exactly."""
    f = np.float32(float(r))
    cands = {float(f), float(np.nextafter(f, np.float32(np.inf))), float(np.nextafter(f, np.float32(-np.inf)))}
    best = min(cands, key=lambda c: (abs(Fraction(c) - r),
                                     int(np.float32(c).view(np.uint32)) & 1))
    return best


def oracle_codes(x: np.ndarray, s: np.ndarray, fmt, **kw) -> np.ndarray:
    """codes of x / s for every element (x, s broadcast), exactly."""
    xb, sb = np.broadcast_arrays(np.asarray(x, np.float64), np.asarray(s, np.float64))
    out = np.empty(xb.shape, np.uint8)
    for i in np.ndindex(xb.shape):
        xv = float(xb[i])
        out[i] = exact_code(Fraction(xv) / Fraction(float(sb[i])), fmt,
                            negative_zero=math.copysign(1, xv) < 0, **kw)
    return out


# --- producers' scale rules, from their source (tests/unit/schemes/test_recipes_te_deepgemm_fbgemm.py) -------
F32_MAX = float(np.finfo(np.float32).max)


def _e4m3():
    from fp8ref.formats import FORMATS  # only the format's parameters: the grid is the oracle's own

    return FORMATS["float8_e4m3fn"]


def frac(v) -> Fraction:
    return Fraction(float(v))


def pow2_ceil(r: Fraction) -> Fraction:
    """Smallest 2**k >= r, k clamped to -126..127 (DeepGEMM's exponent clamp 1..254)."""
    if r <= 0:
        return Fraction(2) ** -126
    k = r.numerator.bit_length() - r.denominator.bit_length() - 1
    while Fraction(2) ** k < r:
        k += 1
    while Fraction(2) ** (k - 1) >= r:
        k -= 1
    return Fraction(2) ** min(max(k, -126), 127)


def pow2_floor(r: Fraction) -> Fraction:
    k = r.numerator.bit_length() - r.denominator.bit_length() + 1
    while Fraction(2) ** k > r:
        k -= 1
    return Fraction(2) ** k


def code_of(r: Fraction, neg_zero: bool, fmt=None) -> int:
    fmt = fmt if fmt is not None else _e4m3()
    return exact_code(r, fmt, negative_zero=neg_zero)


def is_negative(v) -> bool:
    return math.copysign(1.0, float(v)) < 0


# --- oracles, one per producer ---------------------------------------------------------------
def te_oracle(x: np.ndarray, fmt, pow2: bool):
    amax = max((abs(float(v)) for v in x.reshape(-1)), default=0.0)
    if amax == 0 or math.isinf(amax):
        m = Fraction(1)
    else:
        q = Fraction(fmt.max) / frac(amax)
        m = Fraction(F32_MAX) if q > Fraction(F32_MAX) * (1 + Fraction(1, 1 << 25)) else frac(fp32_nearest(q))
    if pow2:
        m = pow2_floor(m)
    s = frac(fp32_nearest(1 / m))
    codes = [code_of(frac(fp32_nearest(frac(v) * m)), is_negative(v), fmt) for v in x.reshape(-1)]
    return np.array(codes, np.uint8).reshape(x.shape), np.float32(float(s))


def group_ue8m0_oracle(x: np.ndarray, group: int, floor: float, divide: bool):
    """DeepGEMM (floor 1e-4, x * (1/s)) and vLLM (floor 1e-10, x / s); s is a power of two, so both
    are the exact quotient."""
    rows, k = x.shape
    ng = -(-k // group)
    codes = np.empty(x.shape, np.uint8)
    scales = np.empty((rows, ng), np.float32)
    for r in range(rows):
        for g in range(ng):
            vals = x[r, g * group:(g + 1) * group]
            amax = max(abs(float(v)) for v in vals)
            amax = max(frac(amax), frac(np.float32(floor)))
            s = pow2_ceil(frac(fp32_nearest(amax / 448)))
            scales[r, g] = float(s)
            for j, v in enumerate(vals):
                codes[r, g * group + j] = code_of(frac(v) / s, is_negative(v))
    return codes, scales


def fbgemm_oracle(x: np.ndarray, ub: float | None):
    codes = np.empty(x.shape, np.uint8)
    scales = np.empty((x.shape[0], 1), np.float32)
    floor = frac(fp32_nearest(Fraction(1, 448 * 512)))
    for r in range(x.shape[0]):
        amax = frac(max(abs(float(v)) for v in x[r]))
        if ub is not None:
            amax = min(amax, frac(np.float32(ub)))
        s = max(frac(fp32_nearest(amax / 448)), floor)
        scales[r, 0] = float(s)
        for j, v in enumerate(x[r]):
            codes[r, j] = code_of(frac(fp32_nearest(frac(v) / s)), is_negative(v))
    return codes, scales




def _fp32_capped(r: Fraction) -> Fraction:
    """fp32 RNE of a positive rational, FLT_MAX where it would overflow (CUDA's fminf after an inf)."""
    cap = Fraction(F32_MAX) * (1 + Fraction(1, 1 << 25))
    return Fraction(F32_MAX) if r >= cap else frac(fp32_nearest(r))


def te_nvfp4_oracle(x: np.ndarray, tile_rows: int):
    """TransformerEngine NVFP4 (core_nvfp4.cuh, quantize_transpose_nvfp4.cuh): S_enc = fp32(2688/A)
    (FLT_MAX on overflow, 1 for A = 0); s_b = e4m3_sat(fp32(amax_b * fp32(S_enc * fp32(1/6))));
    m_b = min(fp32(1 / fp32(s_b * fp32(1/S_enc))), FLT_MAX); q = e2m1_sat(fp32(x * m_b))."""
    from fp8ref.formats import FORMATS

    e4m3, e2m1 = FORMATS["float8_e4m3fn"], FORMATS["float4_e2m1fn"]
    rows, k = x.shape
    a = max((abs(float(v)) for v in x.reshape(-1)), default=0.0)
    g = Fraction(1) if a == 0 else _fp32_capped(Fraction(2688) / frac(a))
    t = frac(fp32_nearest(g * frac(fp32_nearest(Fraction(1, 6)))))
    nb = -(-k // 16)
    scale_codes = np.empty((rows, nb), np.uint8)
    codes = np.empty(x.shape, np.uint8)
    dec = frac(fp32_nearest(1 / g))
    for r in range(rows):
        r0 = r - r % tile_rows
        for b in range(nb):
            tile = x[r0:r0 + tile_rows, b * 16:(b + 1) * 16]
            amax = max(abs(float(v)) for v in tile.reshape(-1))
            sb_code = exact_code(_fp32_capped(frac(amax) * t) if amax else Fraction(0), e4m3)
            scale_codes[r, b] = sb_code
            sb = oracle.decode(sb_code, e4m3)
            p = frac(fp32_nearest(sb * dec)) if sb else Fraction(0)
            m = Fraction(F32_MAX) if p == 0 else _fp32_capped(1 / p)
            for j in range(b * 16, min((b + 1) * 16, k)):
                v = float(x[r, j])
                codes[r, j] = exact_code(frac(fp32_nearest(frac(v) * m)), e2m1, negative_zero=is_negative(v))
    return codes, scale_codes, np.float32(float(g))
