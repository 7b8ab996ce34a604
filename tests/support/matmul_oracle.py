"""An independent scaled-matmul oracle: the exact sum of products as Fractions, rounded once
to the output format by integer arithmetic (no fp8ref code but FloatFormat.exact_value)."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np

from fp8ref import FORMATS

E4M3 = FORMATS["float8_e4m3fn"]
OUT = {"float32": (24, -126, 127), "bfloat16": (8, -126, 127), "float16": (11, -14, 15)}


def round_fraction(x: Fraction, out: str) -> float:
    """RNE of an exact rational to an IEEE binary format (overflow -> Inf, exact zero -> +0)."""
    p, emin, emax = OUT[out]
    if x == 0:
        return 0.0
    sign, a = (-1 if x < 0 else 1), abs(x)
    e = a.numerator.bit_length() - a.denominator.bit_length()
    if Fraction(2) ** e > a:
        e -= 1
    quantum = Fraction(2) ** (max(e, emin) - p + 1)
    q, r = divmod(a, quantum)
    if r * 2 > quantum or (r * 2 == quantum and q % 2 == 1):
        q += 1
    value = q * quantum
    if value > (2 - Fraction(2) ** (1 - p)) * Fraction(2) ** emax:
        return sign * math.inf
    return math.copysign(float(value), sign)


def code_value(fmt, code: int) -> Fraction:
    return fmt.exact_value(int(code))


def fraction_oracle(a, b, scale_a, scale_b, fa=E4M3, fb=E4M3, bias=None, block_k=None, block_n=None):
    """Exact sum_k a*b*sa(m,k)*sb(k,n) + bias as Fractions; scales in torch._scaled_mm layouts."""
    M, K = a.shape
    N = b.shape[1]
    sa, sb = np.asarray(scale_a, np.float32), np.asarray(scale_b, np.float32)

    def s_a(m, k):
        if sa.size == 1:
            return Fraction(float(sa.reshape(-1)[0]))
        return Fraction(float(sa[m, 0 if sa.shape[1] == 1 else k // block_k]))

    def s_b(k, n):
        if sb.size == 1:
            return Fraction(float(sb.reshape(-1)[0]))
        if sb.shape == (1, N):
            return Fraction(float(sb[0, n]))
        return Fraction(float(sb[k // block_k, n // block_n]))

    out = np.empty((M, N), object)
    for m in range(M):
        for n in range(N):
            total = sum((code_value(fa, a[m, k]) * code_value(fb, b[k, n]) * s_a(m, k) * s_b(k, n)
                         for k in range(K)), Fraction(0))
            out[m, n] = total + (Fraction(float(bias[n])) if bias is not None else 0)
    return out


def rounded(oracle, out="float32"):
    return np.vectorize(lambda x: round_fraction(x, out), otypes=[np.float64])(oracle)


def same(x, y):
    """Bitwise equality of float results (NaN == NaN, -0 != +0)."""
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    return x.shape == y.shape and bool(np.all((x == y) & (np.signbit(x) == np.signbit(y))
                                              | (np.isnan(x) & np.isnan(y))))
