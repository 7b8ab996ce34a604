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
