"""fp8ref.matmul.global_scaled: the exact sum of block-scaled products times a global multiplier
(or divided by a global divisor), rounded once, against exact Fraction arithmetic."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fp8ref.errors import ShapeError
from fp8ref.matmul.global_scaled import global_scaled_linear
from fp8ref.rounding import OUT_FORMATS

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
E4M3_SCALES = [2.0 ** -9, 0.125, 0.4375, 1.0, 1.125, 3.25, 15.0, 448.0]


def _round_oracle(v: Fraction, out) -> float:
    """RNE of a Fraction to an OutFormat (with subnormals and overflow to inf): plain rational arithmetic."""
    if v == 0:
        return 0.0
    a = abs(v)
    e = a.numerator.bit_length() - a.denominator.bit_length()
    e = e if Fraction(2) ** e <= a else e - 1
    e = max(e, out.emin)
    ulp = Fraction(2) ** (e - out.precision + 1)
    n, r = divmod(a, ulp)
    n += 1 if r > ulp / 2 or (r == ulp / 2 and n % 2) else 0
    res = n * ulp
    if res > Fraction(out.max):
        return float("inf") if v > 0 else float("-inf")
    return float(res) if v > 0 else -float(res)


@st.composite
def operands(draw):
    m, n, k = draw(st.integers(1, 3)), draw(st.integers(1, 3)), draw(st.integers(1, 40))
    elem = st.sampled_from([s * v for v in E2M1 for s in (1, -1)])
    scale = st.sampled_from(E4M3_SCALES)
    xv = np.array([[draw(elem) * draw(scale) for _ in range(k)] for _ in range(m)])
    wv = np.array([[draw(elem) * draw(scale) for _ in range(k)] for _ in range(n)])
    g = float(np.float32(draw(st.floats(2.0 ** -20, 2.0 ** 20)))) * float(np.float32(draw(st.floats(0.5, 2.0))))
    return xv, wv, g


@settings(max_examples=300, deadline=None)
@given(operands(), st.sampled_from(["multiplier", "divisor"]), st.sampled_from(["bfloat16", "float32", "float16"]),
       st.booleans())
def test_equals_the_fraction_oracle(ops, meaning, out, with_bias):
    xv, wv, g = ops
    bias = np.linspace(-1.5, 2.25, wv.shape[0]) if with_bias else None
    y = global_scaled_linear(xv, wv, g, meaning, bias=bias, out_dtype=out)
    for i in range(xv.shape[0]):
        for j in range(wv.shape[0]):
            s = sum(Fraction(float(a)) * Fraction(float(b)) for a, b in zip(xv[i], wv[j], strict=True))
            s = s * Fraction(g) if meaning == "multiplier" else s / Fraction(g)
            if bias is not None:
                s += Fraction(float(bias[j]))
            assert y[i, j] == _round_oracle(s, OUT_FORMATS[out]), (i, j)


def test_ties_on_a_divisor_round_to_even():
    # 3 * 2**-8 / 3 = 2**-8 exactly (no tie); 257/256 / 1 -> bf16 tie between 1 and 1 + 2**-7: even (1.0)
    xv = np.array([[1.0, 2.0 ** -8]])
    wv = np.array([[1.0, 1.0]])
    assert global_scaled_linear(xv, wv, 1.0, "divisor", out_dtype="bfloat16")[0, 0] == 1.0
    xv = np.array([[3.0, 3.0 * 2.0 ** -8]])
    assert global_scaled_linear(xv, wv, 3.0, "divisor", out_dtype="bfloat16")[0, 0] == 1.0  # tie -> even
    xv = np.array([[3.0, 3.0 * 3 * 2.0 ** -8]])
    assert global_scaled_linear(xv, wv, 3.0, "divisor", out_dtype="bfloat16")[0, 0] == 1.0 + 2.0 ** -6  # tie -> up


def test_refuses_inexact_products():
    with pytest.raises(ShapeError, match="not be exact"):
        global_scaled_linear(np.array([[1 + 2.0 ** -40]]), np.array([[1 + 2.0 ** -30]]), 1.0, "multiplier")


@st.composite
def block_operands(draw):
    """Element values and block scales kept apart: NVFP4 (E2M1, E4M3 scales per 16), MXFP4 (E2M1, E8M0
    per 32, the whole exponent range), MXFP8 (E4M3 elements, E8M0 per 32); K ragged at the end."""
    from fp8ref.formats import FORMATS

    kind = draw(st.sampled_from(["nvfp4", "mxfp4", "mxfp8"]))
    block = 16 if kind == "nvfp4" else 32
    fmt = FORMATS["float8_e4m3fn" if kind == "mxfp8" else "float4_e2m1fn"]
    codes = st.integers(0, fmt.n_codes - 1).filter(lambda c: np.isfinite(_decode(c, fmt)))
    m, n, k = draw(st.integers(1, 3)), draw(st.integers(1, 3)), draw(st.integers(1, 3 * block))
    kb = -(-k // block)
    xe = np.array([[_decode(draw(codes), fmt) for _ in range(k)] for _ in range(m)])
    we = np.array([[_decode(draw(codes), fmt) for _ in range(k)] for _ in range(n)])
    scale = st.sampled_from(E4M3_SCALES) if kind == "nvfp4" else st.integers(-127, 127).map(lambda e: 2.0 ** e)
    sx = np.array([[draw(scale) for _ in range(kb)] for _ in range(m)])
    sw = np.array([[draw(scale) for _ in range(kb)] for _ in range(n)])
    g = float(np.float32(draw(st.floats(2.0 ** -20, 2.0 ** 20)))) if kind == "nvfp4" else 1.0
    return xe, sx, we, sw, block, fmt, g


def _decode(code: int, fmt) -> float:
    from fp8ref.codec import decode

    return float(decode(np.array([code], np.uint8), fmt)[0])


@settings(max_examples=300, deadline=None)
@given(block_operands(), st.sampled_from(["multiplier", "divisor"]), st.sampled_from(["bfloat16", "float32"]),
       st.booleans())
def test_block_sums_first_give_the_same_bits(ops, meaning, out, with_bias):
    """block_scaled_linear (block sums by a float64 matmul, then the scales) == global_scaled_linear of
    the products formed whole, which the Fraction oracle above checks."""
    from fp8ref.matmul.global_scaled import block_scaled_linear

    xe, sx, we, sw, block, fmt, g = ops
    k = xe.shape[1]
    bias = np.linspace(-1.5, 2.25, we.shape[0]) if with_bias else None
    got = block_scaled_linear(xe, sx, we, sw, block, fmt, fmt, g, meaning, bias=bias, out_dtype=out)
    want = global_scaled_linear(xe * np.repeat(sx, block, 1)[:, :k], we * np.repeat(sw, block, 1)[:, :k], g,
                                meaning, bias=bias, out_dtype=out)
    assert np.array_equal(np.signbit(got), np.signbit(want)) and np.array_equal(got, want)
