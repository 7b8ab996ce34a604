"""fp8ref.fakeconvert (FakeConvert-13) against an exact oracle: Python floats and Fractions, each
float32 step and the final dtype rounded by integer arithmetic (tests/support/matmul_oracle's
round_fraction) and the FP8 conversion by tests/support/oracle; IEEE 754's signed-zero rules by hand."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest

from fp8ref import FORMATS
from fp8ref.fakeconvert import as_dtype, fake_convert, round_to_dtype
from fp8ref.golden import load_suite, values
from fp8ref.golden.ops import OPERATIONS
from fp8ref.golden.suite import build
from tests.support import oracle
from tests.support.matmul_oracle import round_fraction


def _round(v: float | Fraction, dtype: str, *, zero_sign: float = 1.0) -> float:
    """RNE of an exact value to ``dtype``; an exact zero gets ``zero_sign``'s sign, Inf stays Inf."""
    if isinstance(v, float) and not math.isfinite(v):
        return v
    v = Fraction(v)
    if v == 0:
        return math.copysign(0.0, zero_sign)
    return round_fraction(v, dtype)


def _add(a: float, b: float, dtype: str) -> float:
    """a + b rounded to dtype, IEEE: x + (-x) = +0, -0 + -0 = -0, Inf + finite = Inf."""
    if not (math.isfinite(a) and math.isfinite(b)):
        return a + b
    exact = Fraction(a) + Fraction(b)
    both_negative_zeros = a == 0 and b == 0 and math.copysign(1, a) < 0 and math.copysign(1, b) < 0
    return _round(exact, dtype, zero_sign=-1.0 if both_negative_zeros else 1.0)


def _mul(a: float, b: float, dtype: str) -> float:
    if not (math.isfinite(a) and math.isfinite(b)):
        return a * b
    return _round(Fraction(a) * Fraction(b), dtype, zero_sign=math.copysign(1, a) * math.copysign(1, b))


def _div(a: float, b: float, dtype: str) -> float:
    if not math.isfinite(a):
        return a / b
    return _round(Fraction(a) / Fraction(b), dtype, zero_sign=math.copysign(1, a) * math.copysign(1, b))


def oracle_fake_convert(x: float, s: float, b: float, fmt, dtype: str) -> float:
    """The spec's three lines, each in float32 and then rounded to ``dtype`` (x, s, b: dtype values)."""
    if math.isnan(x):
        return math.nan
    t = _round(_add(_mul(x, s, "float32"), -b, "float32"), dtype)  # t - b as t + (-b)
    code = oracle.encode(t, fmt, saturate=True, rounding="rne")
    u = oracle.decode_float(code, fmt)
    v = _add(u, b, "float32")
    return _round(_div(v, s, "float32"), dtype)


def _same(a: np.ndarray, expected: list[float], dtype: str) -> list[int]:
    """Indices where ``a`` (dtype) and the oracle's floats differ (bits; any NaN equals any NaN)."""
    want = values.to_bits(as_dtype(np.array(expected), dtype), dtype)
    got = values.to_bits(a, dtype)
    nan = np.isnan(np.array(expected)) & np.isnan(a.astype(np.float64))
    return np.flatnonzero((want != got) & ~nan).tolist()


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("fmt", ["float8_e4m3fn", "float8_e5m2"])
def test_fake_convert_matches_the_exact_oracle_on_the_suite_inputs(fmt, dtype):
    """Every special-table landing point, one ulp either side and the random inputs of the shipped
    suite's cases, for a non-power-of-two scale with a shift and a power of two without."""
    suite = load_suite("fake-quant")
    cases = [c for c in build(suite, 1) if c.params["format"] == fmt and c.params["dtype"] == dtype
             and (c.params["scale"], c.params["shift"]) in ((7.3, 1.5), (0.0625, 0.0), (3.0, 0.0))]
    assert len(cases) == 3
    for case in cases:
        x, scale, shift = case.inputs["x"], case.inputs["scale"], case.inputs["shift"]
        s, b = float(scale.astype(np.float64)[0]), float(shift.astype(np.float64)[0])
        got = OPERATIONS["fake_quant"].reference(case.params, case.inputs)["values"]
        with np.errstate(invalid="ignore"):
            xs = x.astype(np.float64).tolist()
        expected = [oracle_fake_convert(v, s, b, FORMATS[fmt], dtype) for v in xs]
        assert _same(got, expected, dtype) == [], case.name


def test_fake_convert_worked_examples():
    x = np.array([-1.0, 1.0, np.nan, np.inf, -0.0, -1e-30], np.float32)
    got = fake_convert(x, 3.0, 1.5, "float8_e5m2")
    # -1*3 - 1.5 = -4.5: the 4 / 5 tie goes to 4 (even); (-4 + 1.5) / 3
    assert got[0] == np.float32(-2.5) / np.float32(3.0)
    assert got[1] == np.float32(1.5 + 1.5) / np.float32(3.0)  # 3 - 1.5 = 1.5 is an e5m2 value
    assert np.isnan(got[2]) and got[3] == np.float32((57344 + 1.5) / 3)  # Inf saturates to max
    zero = fake_convert(x[4:], 3.0, 0.0, "float8_e4m3fn")  # -0 (and a tiny negative: -0 code) + 0 = +0
    assert zero.tolist() == [0.0, 0.0] and not np.signbit(zero).any()


def test_deviations_are_the_documented_variants():
    x = np.array([-1.0], np.float32)
    r = fake_convert(x, 3.0, 1.5, "float8_e5m2", deviations=("reciprocal",))
    assert r[0] == np.float32(np.float32(-2.5) * np.float32(1 / 3)) != fake_convert(x, 3.0, 1.5, "float8_e5m2")[0]
    dr = np.array([0.0029287999], np.float32)  # float16 rounds it onto the e4m3fn 0x01 / 0x02 midpoint
    assert fake_convert(dr, 1.0, 0.0, "float8_e4m3fn")[0] == 2.0 ** -9
    assert fake_convert(dr, 1.0, 0.0, "float8_e4m3fn", deviations=("double-rounding",))[0] == 2.0 ** -8
    neg = fake_convert(np.array([-0.0], np.float32), 3.0, 0.0, "float8_e4m3fn", deviations=("zero",))
    assert np.signbit(neg[0])
    with pytest.raises(ValueError, match="deviations"):
        fake_convert(x, 3.0, 0.0, "float8_e5m2", deviations=("fma",))


def test_round_to_dtype_rounds_bfloat16_once_from_float64():
    v = np.array([1 + 2.0 ** -8 + 2.0 ** -40])  # above the bfloat16 tie only beyond float32's precision
    assert round_to_dtype(v, "bfloat16")[0] == 1 + 2.0 ** -7
