"""Properties of fp8ref.codec over float32/float64 values (hypothesis), checked with the oracle."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fp8ref.codec import decode, encode
from fp8ref.formats import FORMATS
from tests.support import oracle

FMT_NAMES = list(FORMATS)
DET = oracle.DETERMINISTIC
SYMMETRIC = ("rne", "rna", "rtz", "rto")  # modes that commute with negation
FAST = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])

fmts = st.sampled_from(FMT_NAMES)
f32 = st.floats(allow_nan=False, allow_infinity=False, width=32)
f64 = st.floats(allow_nan=False, allow_infinity=False, width=64)
# values near the format ranges are the interesting ones: mantissa x 2**[-20, 20]
near = st.builds(lambda m, e: math.ldexp(m, e), st.floats(-2, 2, allow_nan=False), st.integers(-20, 20))
values = st.one_of(near, f32, f64)


def enc1(x: float, fmt, mode="rne", sat=True, dtype=np.float64) -> int:
    return int(encode(np.array([x], dtype=dtype), fmt, saturate=sat, rounding=mode)[0])


def dec1(code: int, fmt) -> float:
    return float(decode(np.array([code], np.uint8), fmt)[0])


@FAST
@given(fmts, values, values, st.sampled_from(DET), st.booleans())
def test_monotone(fmt_name, x, y, mode, sat):
    fmt = FORMATS[fmt_name]
    x, y = min(x, y), max(x, y)
    if not fmt.signed and x < 0:
        x = -x if -x <= y else 0.0
    dx, dy = dec1(enc1(x, fmt, mode, sat), fmt), dec1(enc1(y, fmt, mode, sat), fmt)
    if math.isfinite(dx) and math.isfinite(dy):
        assert dx <= dy, (x, y, dx, dy)


@FAST
@given(fmts, values)
def test_rne_error_at_most_half_ulp(fmt_name, x):
    fmt = FORMATS[fmt_name]
    if abs(x) > fmt.max or (not fmt.signed and x < 0) or not fmt.has_zero and abs(x) < fmt.min_positive:
        return
    g = oracle.grid(fmt)
    mag = Fraction(abs(x))
    i = max(k for k, v in enumerate(g.mags) if v <= mag)
    ulp = g.mags[i + 1] - g.mags[i]  # spacing of the oracle's neighbours around x
    got = Fraction(dec1(enc1(x, fmt), fmt))
    assert abs(got - Fraction(x)) <= ulp / 2


@FAST
@given(st.sampled_from([n for n in FMT_NAMES if FORMATS[n].signed]), values, st.sampled_from(SYMMETRIC),
       st.booleans())
def test_sign_symmetry(fmt_name, x, mode, sat):
    fmt = FORMATS[fmt_name]
    pos, neg = enc1(abs(x), fmt, mode, sat), enc1(-abs(x), fmt, mode, sat)
    if pos == fmt.nan_code and fmt.specials == "fnuz":
        assert neg == pos  # fnuz has one unsigned NaN
    elif pos == 0 and not fmt.has_negative_zero:
        assert neg == 0
    else:
        assert neg == pos | fmt.sign_mask


@FAST
@given(fmts, values, st.sampled_from(DET), st.booleans())
def test_idempotent(fmt_name, x, mode, sat):
    fmt = FORMATS[fmt_name]
    if not fmt.signed and x < 0:
        x = -x
    c1 = enc1(x, fmt, mode, sat)
    v1 = dec1(c1, fmt)
    c2 = enc1(v1, fmt, mode, sat)
    assert np.array_equal(np.array([dec1(c2, fmt)]), np.array([v1]), equal_nan=True)
    if math.isfinite(v1):
        assert c2 == c1


@FAST
@given(fmts, values, st.booleans())
def test_directed_modes_bracket(fmt_name, x, sat):
    fmt = FORMATS[fmt_name]
    if not fmt.signed and x < 0 or not fmt.has_zero and abs(x) < fmt.min_positive:
        return
    down, up = dec1(enc1(x, fmt, "rdown", sat), fmt), dec1(enc1(x, fmt, "rup", sat), fmt)
    if abs(x) <= fmt.max:
        assert down <= x <= up
    # beyond max the non-saturating side is Inf/NaN (or max for 'none'); the other side is max.
    if x > fmt.max:
        assert down == fmt.max
    if x < -fmt.max and fmt.signed:
        assert up == -fmt.max


@FAST
@given(fmts, st.lists(f64, min_size=1, max_size=40), st.sampled_from(DET), st.booleans())
def test_float64_rounded_once(fmt_name, xs, mode, sat):
    """Fast path on float64 arrays equals the oracle on the exact float64 values."""
    fmt = FORMATS[fmt_name]
    want = [oracle.encode(x, fmt, sat, mode) for x in xs]
    assert encode(np.array(xs), fmt, saturate=sat, rounding=mode).tolist() == want


@FAST
@given(fmts, st.lists(values, min_size=1, max_size=30), st.integers(0, 2**32 - 1))
def test_stochastic_same_bits_same_codes(fmt_name, xs, seed):
    rng = np.random.default_rng(seed)
    x = np.array(xs)
    r = rng.integers(0, 2**16, size=x.shape, dtype=np.uint16)
    a = encode(x, fmt_name, rounding="stochastic", random_bits=r)
    b = encode(x.copy(), fmt_name, rounding="stochastic", random_bits=r.copy())
    assert np.array_equal(a, b)


ALL_R8 = np.arange(256, dtype=np.uint8)


def _stochastic_mean(x: float, fmt) -> tuple[Fraction, Fraction, Fraction]:
    """(exact mean over all 256 uint8 random values, lo, hi) for x strictly inside the range."""
    codes = encode(np.full(256, x), fmt, rounding="stochastic", random_bits=ALL_R8)
    vals = [oracle.decode(int(c), fmt) for c in codes]
    g = oracle.grid(fmt)
    mag = Fraction(abs(x))
    i = max(k for k, v in enumerate(g.mags) if v <= mag)
    sign = -1 if x < 0 else 1
    return sum(vals, Fraction(0)) / 256, sign * g.mags[i], sign * g.mags[i + 1]


@FAST
@given(st.sampled_from(FMT_NAMES), st.integers(0, 10**6), st.integers(0, 255), st.booleans())
def test_stochastic_unbiased_on_2pow8_grid(fmt_name, pick, k, negative):
    """d = k/256 exactly: the mean over all 256 random bytes is exactly x."""
    fmt = FORMATS[fmt_name]
    g = oracle.grid(fmt)
    i = pick % g.max_code  # a finite interval [mags[i], mags[i+1]] below max
    if fmt.has_zero is False and i == 0:
        i = 1
    x_frac = g.mags[i] + (g.mags[i + 1] - g.mags[i]) * Fraction(k, 256)
    x = float(x_frac)
    assert Fraction(x) == x_frac
    negative = negative and fmt.signed
    x = -x if negative else x
    mean, _, _ = _stochastic_mean(x, fmt)
    assert mean == Fraction(x)


@FAST
@given(fmts, near)
def test_stochastic_bias_below_2powN_ulp(fmt_name, x):
    fmt = FORMATS[fmt_name]
    if abs(x) >= fmt.max or (not fmt.signed and x < 0) or abs(x) < fmt.min_positive:
        return
    mean, lo, hi = _stochastic_mean(x, fmt)
    ulp = abs(hi - lo)
    bias = Fraction(x) - mean  # P(hi) = floor(d*256)/256 <= d: biased toward zero by < ulp/256
    assert 0 <= bias * (1 if x > 0 else -1) < ulp / 256
