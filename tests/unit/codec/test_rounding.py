"""fp8ref.rounding: RNE to bfloat16/float16/float32, checked against answers known by construction
(every 16-bit pattern's neighbourhood: the point itself, quarter points, the midpoint and values a
hair either side of it) and against an exact Fraction oracle on random float64 values."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from fp8ref.rounding import FLOAT_FORMATS, OUT_FORMATS, from_bits, round_to, round_to_format, to_bits
from tests.support.matmul_oracle import round_fraction

fraction_rne = round_fraction  # the independent Fraction RNE oracle (tests/support)


def same(x, y) -> bool:
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    return x.shape == y.shape and bool(np.all(((x == y) & (np.signbit(x) == np.signbit(y)))
                                              | (np.isnan(x) & np.isnan(y))))


def grid16(dtype: str) -> np.ndarray:
    """Every finite non-negative value of a 16-bit dtype, increasing, built from its bit patterns."""
    bits = np.arange(1 << 15, dtype=np.uint32)
    with np.errstate(invalid="ignore"):
        if dtype == "bfloat16":
            v = (bits << 16).view(np.float32).astype(np.float64)
        else:
            v = bits.astype(np.uint16).view(np.float16).astype(np.float64)
    return v[np.isfinite(v)]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_every_pattern_neighbourhood(dtype):
    g = grid16(dtype)
    lo, hi = g[:-1], g[1:]
    d = hi - lo
    even_hi = (np.arange(1, g.size) % 2) == 0  # patterns are consecutive integers: lsb of hi's index
    mid = lo + d / 2
    cases = [(g, g), (lo + d / 4, lo), (lo + 3 * d / 4, hi), (mid, np.where(even_hi, hi, lo)),
             (np.nextafter(mid, -np.inf), lo), (np.nextafter(mid, np.inf), hi)]
    top, step = g[-1], g[-1] - g[-2]
    cases += [(np.array([top + step / 2, np.nextafter(top + step / 2, 0.0), top * 4]),
               np.array([np.inf, top, np.inf]))]
    fmt = OUT_FORMATS[dtype]
    for x, want in cases:
        for sign in (1.0, -1.0):
            xs, ws = sign * x, np.copysign(want, sign * x)  # a value rounding to 0 keeps its sign
            assert same(round_to_format(xs, fmt), ws)
            assert same(round_to(xs, dtype), ws)  # float64 input
            with np.errstate(over="ignore"):
                x32 = xs.astype(np.float32)
            exact32 = x32.astype(np.float64) == xs
            assert same(round_to(x32[exact32], dtype), ws[exact32])  # float32 input (the fast paths)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@given(st.lists(st.floats(allow_nan=False, allow_infinity=False, width=64), min_size=1, max_size=20))
def test_against_fraction_oracle(dtype, xs):
    x = np.array(xs, np.float64)
    want = np.array([fraction_rne(Fraction(v), dtype) if v != 0 else v for v in xs])
    assert same(round_to_format(x, FLOAT_FORMATS[dtype]), want)
    with np.errstate(over="ignore"):
        assert same(round_to(x, dtype), want)


@given(st.lists(st.floats(allow_nan=False, width=64, min_value=-1e-30, max_value=1e-30), min_size=1, max_size=20))
def test_subnormal_range_against_fraction_oracle(xs):
    x = np.array(xs, np.float64) * 1e-8  # bfloat16 and float32 subnormals, signed underflow
    want = np.array([fraction_rne(Fraction(float(v)), "bfloat16") if v != 0 else v for v in x])
    assert same(round_to(x, "bfloat16"), want)


def test_float32_bit_trick_equals_the_definition():
    rng = np.random.default_rng(1)
    x = rng.integers(0, 1 << 32, 1 << 20, dtype=np.uint64).astype(np.uint32).view(np.float32)
    x = x[~np.isnan(x)]
    with np.errstate(over="ignore", invalid="ignore"):
        assert same(round_to(x, "bfloat16"), round_to_format(x.astype(np.float64), OUT_FORMATS["bfloat16"]))
        assert same(round_to(x, "float16"), round_to_format(x.astype(np.float64), OUT_FORMATS["float16"]))


def test_nan_and_inf_pass_through():
    x = np.array([np.nan, -np.nan, np.inf, -np.inf])
    for dtype in ("bfloat16", "float16", "float32"):
        assert same(round_to(x, dtype), x)
        assert same(round_to(x.astype(np.float32), dtype), x)
        assert same(round_to_format(x, FLOAT_FORMATS[dtype]), x)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_bits_round_trip_every_pattern(dtype):
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    values = from_bits(bits, dtype)
    back = to_bits(values, dtype)
    finite = ~np.isnan(values)
    np.testing.assert_array_equal(back[finite], bits[finite])
    assert np.isnan(from_bits(back[~finite], dtype)).all()  # NaNs stay NaN (made quiet)
    if dtype == "bfloat16":  # bf16 value == the top half of a float32 pattern, by definition
        np.testing.assert_array_equal(values.view(np.uint32)[finite], bits[finite].astype(np.uint32) << 16)
