"""fp8ref.matmul: hand-picked cases, declared orders against independent scalar models, bad input.

The oracles here (``fraction_oracle``, ``round_fraction``) use only ``FloatFormat.exact_value`` and
``fractions.Fraction``; tests/property/test_matmul_properties.py imports them.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
import torch

from fp8ref import FORMATS, FloatFormat, encode
from fp8ref.errors import FormatError, InputTypeError, ScaleError, ShapeError
from fp8ref.matmul import linear, scaled_mm
from tests.support.matmul_oracle import OUT, code_value, fraction_oracle, round_fraction, rounded, same

E4M3, E5M2 = FORMATS["float8_e4m3fn"], FORMATS["float8_e5m2"]


def codes_of(values, fmt=E4M3):
    """Codes of values that the format holds exactly (checked)."""
    v = np.asarray(values, np.float64)
    c = encode(v, fmt)
    assert all(fmt.exact_value(int(x)) == Fraction(float(y)) for x, y in zip(c.ravel(), v.ravel(), strict=True))
    return c


f32 = np.float32


# ------------------------------------------------------------------------------------------
# exact: single rounding where float64 would round twice
# ------------------------------------------------------------------------------------------
def test_exact_tie_goes_to_even():
    # 1 + 2**-24 is halfway between 1 and 1 + 2**-23 in float32: RNE keeps 1.0
    a = codes_of([[1.0, 2.0 ** -12]], E5M2)
    b = codes_of([[1.0], [2.0 ** -12]], E5M2)
    assert scaled_mm(a, b, f32(1), f32(1), fmt_a=E5M2, fmt_b=E5M2)[0, 0] == 1.0


def test_exact_beyond_float64_breaks_the_tie():
    # block 0 sums to 1 + 2**-24 (a float32 tie); block 1 adds 2**-92 through its scales. float64 holds
    # 1 + 2**-24 and drops 2**-92, which would round to 1.0; the exact sum rounds up.
    a = codes_of([[1.0, 2.0 ** -12, 2.0 ** -16, 0.0]], E5M2)
    b = codes_of([[1.0], [2.0 ** -12], [2.0 ** -16], [0.0]], E5M2)
    sa = np.array([[1.0, 2.0 ** -30]], f32)
    sb = np.array([[1.0], [2.0 ** -30]], f32)
    got = scaled_mm(a, b, sa, sb, fmt_a=E5M2, fmt_b=E5M2, block_k=2, block_n=1)[0, 0]
    assert got == 1.0 + 2.0 ** -23
    float64_sum = np.float64(1.0) + 2.0 ** -24 + 2.0 ** -92
    assert np.float32(float64_sum) == 1.0  # what a float64 accumulation would give


def test_exact_when_float64_accumulation_cancels_catastrophically():
    # bias 2**30, block 0: 1 + 2**-24, block 1: -2**30, block 2: 2**-92. A float64 running sum
    # loses 2**-24 against 2**30 and ends at exactly 1.0; the exact sum is above the float32
    # midpoint 1 + 2**-24, so the answer is 1 + 2**-23.
    a = codes_of([[1.0, 2.0 ** -12, -(2.0 ** 15), 0.0, 2.0 ** -16, 0.0]], E5M2)
    b = codes_of([[1.0], [2.0 ** -12], [2.0 ** 15], [0.0], [2.0 ** -16], [0.0]], E5M2)
    sa = np.array([[1.0, 1.0, 2.0 ** -30]], f32)
    sb = np.array([[1.0], [1.0], [2.0 ** -30]], f32)
    bias = np.array([2.0 ** 30], f32)
    got = scaled_mm(a, b, sa, sb, bias=bias, fmt_a=E5M2, fmt_b=E5M2, block_k=2, block_n=1)[0, 0]
    assert got == 1.0 + 2.0 ** -23
    assert (np.float64(2.0 ** 30) + (1.0 + 2.0 ** -24)) - 2.0 ** 30 + 2.0 ** -92 == 1.0


def test_exact_matches_fraction_oracle_e4m3_rowwise_bias():
    rng = np.random.default_rng(1)
    finite = [c for c in range(256) if E4M3.exact_value(c) is not None]
    a = rng.choice(finite, (3, 37)).astype(np.uint8)
    b = rng.choice(finite, (37, 5)).astype(np.uint8)
    sa = rng.uniform(1e-3, 2, (3, 1)).astype(f32)
    sb = rng.uniform(1e-3, 2, (1, 5)).astype(f32)
    bias = rng.standard_normal(5).astype(f32)
    for out in OUT:
        got = scaled_mm(a, b, sa, sb, bias=bias, out_dtype=out)
        assert same(got.astype(np.float64), rounded(fraction_oracle(a, b, sa, sb, bias=bias), out))


def test_exact_cancellation_to_zero_is_positive_zero_and_underflow_keeps_sign():
    a = codes_of([[1.0, -1.0], [-(2.0 ** -9), 0.0]])
    b = codes_of([[3.0], [3.0]])
    got = scaled_mm(a, b, f32(1), f32(2.0 ** -149))
    assert got[0, 0] == 0 and not np.signbit(got[0, 0])
    assert got[1, 0] == 0 and np.signbit(got[1, 0])  # -3 * 2**-158 rounds to -0 in float32


def test_exact_overflow_to_inf_in_float16():
    a = codes_of([[448.0, 448.0]])
    b = codes_of([[448.0], [448.0]])
    assert scaled_mm(a, b, f32(1), f32(1), out_dtype="float16")[0, 0] == np.inf
    assert scaled_mm(a, b, f32(1), f32(0.125), out_dtype="float16")[0, 0] == 50176.0


def test_exact_nan_inf_rules_e5m2():
    inf, nan, neg_inf = 0x7C, 0x7E, 0xFC
    one, zero = 0x3C, 0x00
    a = np.array([[inf, one], [inf, one], [inf, one], [nan, one], [one, one]], np.uint8)
    b = np.array([[one, zero, one], [zero, one, neg_inf]], np.uint8).reshape(2, 3)
    got = scaled_mm(a, b, f32(1), f32(1), fmt_a=E5M2, fmt_b=E5M2)
    assert got[0, 0] == np.inf            # inf*1 + 1*0
    assert np.isnan(got[0, 1])            # inf*0
    assert np.isnan(got[0, 2])            # inf*1 + 1*(-inf)
    assert np.isnan(got[3]).all()         # NaN operand
    assert got[4, 2] == -np.inf and got[4, 0] == 1.0
    bias = np.array([np.inf, -np.inf, 0.0], f32)
    with_bias = scaled_mm(a, b, f32(1), f32(1), bias=bias, fmt_a=E5M2, fmt_b=E5M2)
    assert with_bias[4, 0] == np.inf and with_bias[4, 1] == -np.inf and with_bias[4, 2] == -np.inf
    assert np.isnan(with_bias[0, 2]) and with_bias[0, 0] == np.inf


def test_several_pieces_when_e5m2_products_exceed_53_bits():
    # e5m2 spans 2**-16 .. 57344: integers of 32 bits each, so the product needs splitting
    a = codes_of([[57344.0, 2.0 ** -16, -(2.0 ** -14) * 1.25]], E5M2)
    b = codes_of([[57344.0], [2.0 ** -16], [1.5 * 2.0 ** -10]], E5M2)
    got = scaled_mm(a, b, f32(1), f32(1), fmt_a=E5M2, fmt_b=E5M2, out_dtype="float32")
    assert got[0, 0] == round_fraction(fraction_oracle(a, b, f32(1), f32(1), E5M2, E5M2)[0, 0], "float32")


def test_torch_float8_operands_and_output_library():
    rng = np.random.default_rng(2)
    a = torch.from_numpy(encode(rng.standard_normal((4, 16)).astype(f32), E4M3))
    b = torch.from_numpy(encode(rng.standard_normal((16, 3)).astype(f32), E4M3))
    ref = scaled_mm(a.numpy(), b.numpy(), f32(0.5), f32(0.25))
    got = scaled_mm(a.view(torch.float8_e4m3fn), b.view(torch.float8_e4m3fn), torch.tensor(0.5),
                    torch.tensor([0.25]), out_dtype=torch.bfloat16)
    assert got.dtype == torch.bfloat16 and isinstance(ref, np.ndarray)
    assert same(got.float().numpy(), rounded(fraction_oracle(a.numpy(), b.numpy(), f32(.5), f32(.25)), "bfloat16"))
    assert same(scaled_mm(a, b, f32(0.5), f32(0.25)).numpy(), ref)


def test_blockwise_scales_against_oracle():
    rng = np.random.default_rng(3)
    a = encode(rng.standard_normal((3, 10)).astype(f32), E4M3)
    b = encode(rng.standard_normal((10, 5)).astype(f32), E4M3)
    sa = rng.uniform(0.1, 4, (3, 3)).astype(f32)   # 1x4 groups, K = 10 -> 3 groups
    sb = rng.uniform(0.1, 4, (3, 3)).astype(f32)   # 4x2 blocks, N = 5 -> 3 column blocks
    got = scaled_mm(a, b, sa, sb, block_k=4, block_n=2)
    assert same(got, rounded(fraction_oracle(a, b, sa, sb, block_k=4, block_n=2)))


# ------------------------------------------------------------------------------------------
# fp32 and fp32-limited against scalar models written from the declared order
# ------------------------------------------------------------------------------------------
def scalar_fp32(a, b, sa, sb, block, operands=False):
    """total=+0; per block: part=+0; part=f32(part+f32(x*y)); total=f32(total+f32(f32(sa*sb)*part))."""
    A = [[float(E4M3.exact_value(int(c))) for c in row] for row in a]
    B = [[float(E4M3.exact_value(int(c))) for c in row] for row in b]
    M, K, N = len(A), len(A[0]), len(B[0])
    out = np.empty((M, N), f32)
    for m in range(M):
        for n in range(N):
            total = f32(0)
            for k0 in range(0, K, block):
                part = f32(0)
                for k in range(k0, min(K, k0 + block)):
                    x, y = f32(A[m][k]), f32(B[k][n])
                    if operands:
                        x, y = f32(x * f32(sa)), f32(y * f32(sb))
                    part = f32(part + f32(x * y))
                if not operands:
                    part = f32(f32(f32(sa) * f32(sb)) * part)
                total = f32(total + part)
            out[m, n] = total
    return out


@pytest.mark.parametrize("block,operands", [(None, False), (3, False), (None, True)])
def test_fp32_declared_order(block, operands):
    rng = np.random.default_rng(4)
    a = encode(rng.standard_normal((3, 11)).astype(f32) * 30, E4M3)
    b = encode(rng.standard_normal((11, 4)).astype(f32) * 30, E4M3)
    got = scaled_mm(a, b, f32(0.3), f32(0.7), accumulate="fp32", block_k=block,
                    scale_order="operands" if operands else "epilogue")
    assert same(got, scalar_fp32(a, b, 0.3, 0.7, block or 11, operands))


def scalar_limited(a, b, s, bits, promote):
    """Exact Fractions: acc = RTZ_bits(acc + x*y) (float32 exponent range); promotion every `promote`."""
    def rtz(x: Fraction) -> Fraction:
        if x == 0:
            return x
        e = max(math.floor(math.log2(abs(x))), -126)
        while Fraction(2) ** e > abs(x) and e > -126:
            e -= 1
        while Fraction(2) ** (e + 1) <= abs(x):
            e += 1
        q = Fraction(2) ** (max(e, -126) - bits)
        return (abs(x) // q) * q * (1 if x > 0 else -1)

    M, K, N = a.shape[0], a.shape[1], b.shape[1]
    out = np.empty((M, N), f32)
    for m in range(M):
        for n in range(N):
            total = f32(0)
            for k0 in range(0, K, promote):
                acc = Fraction(0)
                for k in range(k0, min(K, k0 + promote)):
                    acc = rtz(acc + code_value(E4M3, a[m, k]) * code_value(E4M3, b[k, n]))
                total = f32(total + f32(f32(s) * f32(float(acc))))
            out[m, n] = total
    return out


def test_fp32_limited_matches_truncating_model_and_loses_more_than_fp32():
    rng = np.random.default_rng(5)
    a = encode(rng.uniform(0.5, 1, (2, 40)).astype(f32), E4M3)
    b = encode(rng.uniform(0.5, 1, (40, 3)).astype(f32), E4M3)
    got = scaled_mm(a, b, f32(1), f32(0.5), accumulate="fp32-limited", mantissa_bits=4, promote_every=16)
    assert same(got, scalar_limited(a, b, 0.5, 4, 16))
    exact = scaled_mm(a, b, f32(1), f32(0.5))
    assert np.all(got <= exact)  # positive terms: truncation only loses
    assert np.abs(got - exact).max() > np.abs(scaled_mm(a, b, f32(1), f32(0.5), accumulate="fp32") - exact).max()


# ------------------------------------------------------------------------------------------
# linear
# ------------------------------------------------------------------------------------------
def test_linear_static_and_dynamic_token():
    rng = np.random.default_rng(6)
    x = rng.standard_normal((2, 3, 16)).astype(f32)
    w = encode(rng.standard_normal((5, 16)).astype(f32), E4M3)
    ws = rng.uniform(0.01, 0.1, (5, 1)).astype(f32)
    s_in = f32(0.02)
    got = linear(x, w, ws, input_scale=s_in)
    assert got.shape == (2, 3, 5)
    q = encode((x.reshape(6, 16) / s_in).astype(f32), E4M3)
    ref = rounded(fraction_oracle(q, np.ascontiguousarray(w.T), s_in, ws.reshape(1, 5)))
    assert same(got.reshape(6, 5), ref)
    dyn = linear(x, w, ws, dynamic="token")
    amax = np.abs(x.reshape(6, 16)).max(axis=1, keepdims=True)
    s_tok = (amax / f32(448)).astype(f32)
    q = encode((x.reshape(6, 16) / s_tok).astype(f32), E4M3)
    assert same(dyn.reshape(6, 5), rounded(fraction_oracle(q, np.ascontiguousarray(w.T), s_tok, ws.reshape(1, 5))))


def test_linear_torch_bf16_and_block_weights():
    rng = np.random.default_rng(7)
    x = torch.from_numpy(rng.standard_normal((4, 8)).astype(f32)).to(torch.bfloat16)
    w = torch.from_numpy(encode(rng.standard_normal((6, 8)).astype(f32), E4M3)).view(torch.float8_e4m3fn)
    ws = torch.from_numpy(rng.uniform(0.01, 0.1, (3, 2)).astype(f32))  # 2x4 blocks
    y = linear(x, w, ws, dynamic="group", block_k=4, block_n=2)
    assert y.dtype == torch.bfloat16 and y.shape == (4, 6)
    xf = x.float().numpy()
    amax = np.abs(xf).reshape(4, 2, 4).max(axis=2)
    s = (amax / f32(448)).astype(f32)
    q = encode((xf / np.repeat(s, 4, axis=1)).astype(f32), E4M3)
    ref = fraction_oracle(q, np.ascontiguousarray(w.view(torch.uint8).numpy().T), s, ws.numpy().T,
                          block_k=4, block_n=2)
    assert same(y.float().numpy(), rounded(ref, "bfloat16"))


# ------------------------------------------------------------------------------------------
# Bad input
# ------------------------------------------------------------------------------------------
A = np.zeros((2, 3), np.uint8)
B = np.zeros((3, 4), np.uint8)


@pytest.mark.parametrize("kwargs,err,words", [
    (dict(b=np.zeros((5, 4), np.uint8)), ShapeError, ["b", "(5, 4)", "(3, N)"]),
    (dict(a=np.zeros((2, 3, 1), np.uint8)), ShapeError, ["a", "(2, 3, 1)", "2-D"]),
    (dict(scale_a=np.ones((3, 1), f32)), ShapeError, ["scale_a", "(3, 1)", "(2, 1)"]),
    (dict(scale_b=np.ones((4, 1), f32)), ShapeError, ["scale_b", "(4, 1)", "(1, 4)"]),
    (dict(scale_a=f32(np.nan)), ScaleError, ["scale_a", "nan"]),
    (dict(scale_b=np.array([1, -2, 1, 1], f32).reshape(1, 4)), ScaleError, ["scale_b", "-2", "(0, 1)"]),
    (dict(scale_a=f32(0)), ScaleError, ["scale_a", "0"]),
    (dict(scale_b=f32(np.inf)), ScaleError, ["scale_b", "inf"]),
    (dict(scale_a=np.float64(1.0)), InputTypeError, ["scale_a", "float32", "float64"]),
    (dict(scale_a=0.1), InputTypeError, ["scale_a", "0.1", "float32"]),
    (dict(a=np.zeros((2, 3), np.int8)), InputTypeError, ["a", "uint8", "int8"]),
    (dict(b=np.zeros((3, 4), np.float32)), InputTypeError, ["b", "uint8", "float32"]),
    (dict(bias=np.zeros(3, f32)), ShapeError, ["bias", "(3,)", "(4,)"]),
    (dict(bias=np.zeros(4, np.int32)), InputTypeError, ["bias", "int32"]),
    (dict(out_dtype="float8_e4m3"), InputTypeError, ["out_dtype", "float8_e4m3"]),
    (dict(accumulate="fp16"), InputTypeError, ["accumulate", "fp16", "exact"]),
    (dict(fmt_a=FloatFormat("e7m0_wide", 7, 0, 200)), FormatError, ["a", "e7m0_wide", "float32"]),
])
def test_bad_input(kwargs, err, words):
    args = dict(a=A, b=B, scale_a=f32(1), scale_b=f32(1))
    args.update(kwargs)
    with pytest.raises(err) as info:
        scaled_mm(args.pop("a"), args.pop("b"), args.pop("scale_a"), args.pop("scale_b"), **args)
    for word in words:
        assert word in str(info.value), (word, str(info.value))


def test_bad_torch_inputs():
    a = torch.zeros(2, 3).to(torch.float8_e5m2)
    with pytest.raises(FormatError, match="float8_e5m2.*float8_e4m3fn"):
        scaled_mm(a, B, f32(1), f32(1), fmt_a="float8_e4m3fn")
    with pytest.raises(InputTypeError, match="a: .*torch.float16"):
        scaled_mm(torch.zeros(2, 3, dtype=torch.float16), B, f32(1), f32(1))
    with pytest.raises(FormatError, match="a: float4_e2m1fn has 4-bit codes.*0x10"):
        scaled_mm(np.full((2, 3), 16, np.uint8), B, f32(1), f32(1), fmt_a="float4_e2m1fn")


def test_linear_bad_input():
    x = np.zeros((2, 8), f32)
    w = np.zeros((4, 8), np.uint8)
    with pytest.raises(ShapeError, match=r"weight: got shape \(4, 7\), expected \(N, 8\)"):
        linear(x, np.zeros((4, 7), np.uint8), f32(1), input_scale=f32(1))
    with pytest.raises(ShapeError, match=r"weight_scale: got shape \(3,\)"):
        linear(x, w, np.ones(3, f32), input_scale=f32(1))
    with pytest.raises(InputTypeError, match="dynamic"):
        linear(x, w, f32(1))
    with pytest.raises(ShapeError, match=r"input_scale: .*\(2, 1\)"):
        linear(x, w, f32(1), input_scale=np.ones((2, 1), f32))
