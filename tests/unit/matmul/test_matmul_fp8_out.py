"""scaled_mm with an FP8/FP6/FP4 out_dtype and scale_result.

Oracle: the exact value as a ``fractions.Fraction`` (from FloatFormat.exact_value of the codes),
divided or multiplied by scale_result, rounded on the format's grid continued above max with
Fraction arithmetic (written here; the grid spacing comes from tests/support/oracle.py's own grid), and
the overflow/special rules of tests/support/oracle.py applied to that exact grid point. Neither uses fp8ref.codec.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fp8ref import FORMATS
from fp8ref.errors import FormatError, Fp8RefError, InputTypeError, ScaleError, ShapeError
from fp8ref.matmul import scaled_mm
from tests.support import oracle

E4M3 = FORMATS["float8_e4m3fn"]
OUT_NAMES = ["float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float6_e2m3fn",
             "float6_e3m2fn", "float4_e2m1fn"]
MODES = ["rne", "rna", "rtz", "rup", "rdown", "rto"]


# ------------------------------------------------------------------------------------------
# Oracle
# ------------------------------------------------------------------------------------------
def _round_on_grid(x: Fraction, fmt, mode: str) -> Fraction:
    """x rounded in ``mode`` on fmt's grid continued above max (same precision, unbounded exponent)."""
    mags = oracle.grid(fmt).mags
    tiny = mags[1]  # smallest subnormal = 2**(emin - M): the spacing below 2**emin
    if x == 0:
        return Fraction(0)
    a = abs(x)
    e = a.numerator.bit_length() - a.denominator.bit_length()
    if Fraction(2) ** e > a:
        e -= 1
    quantum = max(tiny, Fraction(2) ** (e - fmt.mantissa_bits))
    q, r = divmod(a, quantum)
    neg = x < 0
    if r == 0:
        up = False
    elif mode == "rne":
        up = r * 2 > quantum or (r * 2 == quantum and q % 2 == 1)
    elif mode == "rna":
        up = r * 2 >= quantum
    elif mode == "rtz":
        up = False
    elif mode == "rup":
        up = not neg
    elif mode == "rdown":
        up = neg
    else:  # rto
        up = q % 2 == 0
    v = (q + up) * quantum
    return -v if neg else v


def oracle_code(x: Fraction, fmt, *, saturate=True, rounding="rne") -> int:
    r = _round_on_grid(x, fmt, rounding)
    if r == 0:
        value = -0.0 if x < 0 else 0.0  # a nonzero value rounding to zero keeps its sign; exact 0 is +0
    else:
        value = float(r)  # a grid point: exact in float64
        assert Fraction(value) == r
    # on the grid, so oracle.encode only applies its overflow rules (IEEE 7.4 for directed modes)
    return oracle.encode(value, fmt, saturate=saturate, rounding=rounding)


def exact_value(a, b, sa, sb, bias, fa=E4M3, fb=E4M3) -> list[list[Fraction]]:
    M, K = a.shape
    N = b.shape[1]
    out = []
    for m in range(M):
        row = []
        for n in range(N):
            x = sum((fa.exact_value(int(a[m, k])) * fb.exact_value(int(b[k, n])) for k in range(K)), Fraction(0))
            x *= Fraction(float(sa)) * Fraction(float(sb))
            if bias is not None:
                x += Fraction(float(bias[n]))
            row.append(x)
        out.append(row)
    return out


def expected_codes(values, fmt, s, op, **kw) -> np.ndarray:
    def scaled(x):
        if s is None:
            return x
        return x / Fraction(float(s)) if op == "divide" else x * Fraction(float(s))
    return np.array([[oracle_code(scaled(x), fmt, **kw) for x in row] for row in values], np.uint8)


def finite_codes(fmt) -> list[int]:
    return [c for c in range(fmt.n_codes) if math.isfinite(oracle.decode_float(c, fmt))]


E4M3_FINITE = finite_codes(E4M3)


# ------------------------------------------------------------------------------------------
# Exact mode against the Fraction oracle
# ------------------------------------------------------------------------------------------
f32_scale = st.one_of(
    st.sampled_from([1.0, 2.0, 0.5, 3.0, 7.0, 1 / 3, 0.1, 2.0 ** -20, 2.0 ** 20, 448.0, 1 / 448]),
    st.floats(2.0 ** -30, 2.0 ** 30, width=32),
).map(np.float32)


@st.composite
def problems(draw):
    M, K, N = draw(st.integers(1, 3)), draw(st.integers(1, 6)), draw(st.integers(1, 3))
    code = st.sampled_from(E4M3_FINITE)
    a = np.array(draw(st.lists(code, min_size=M * K, max_size=M * K)), np.uint8).reshape(M, K)
    b = np.array(draw(st.lists(code, min_size=K * N, max_size=K * N)), np.uint8).reshape(K, N)
    sa, sb = draw(f32_scale), draw(f32_scale)
    bias = draw(st.none() | st.lists(st.floats(-1e3, 1e3, width=32), min_size=N, max_size=N).map(
        lambda v: np.array(v, np.float32)))
    s = draw(st.none() | f32_scale)
    return a, b, sa, sb, bias, s


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems(), st.sampled_from(OUT_NAMES), st.sampled_from(["divide", "multiply"]), st.booleans(),
       st.sampled_from(MODES))
def test_exact_codes_match_fraction_oracle(problem, out_name, op, saturate, rounding):
    a, b, sa, sb, bias, s = problem
    fmt = FORMATS[out_name]
    got = scaled_mm(a, b, sa, sb, bias=bias, out_dtype=out_name, scale_result=s, scale_result_op=op,
                    saturate=saturate, rounding=rounding)
    want = expected_codes(exact_value(a, b, sa, sb, bias), fmt, s, op, saturate=saturate, rounding=rounding)
    assert got.dtype == np.uint8
    np.testing.assert_array_equal(got, want)


ONE, TWO = 0x38, 0x40  # e4m3fn 1.0, 2.0


HAIR, NEG_HAIR = ([ONE, 0x01], [ONE, 0x01]), ([ONE, 0x81], [ONE, 0x01])  # 1 + 2**-18, 1 - 2**-18


@pytest.mark.parametrize(("ops", "bias", "kw", "want"), [
    # ties: 1.0625 is the midpoint of 1 and 1.125 -> even 1.0 (0x38); a hair above -> 1.125 (0x39)
    (None, 0.0625, {}, 0x38),
    (HAIR, 0.0625, {}, 0x39),
    (NEG_HAIR, 0.0625, {}, 0x38),
    (NEG_HAIR, 0.0625, {"rounding": "rup"}, 0x39),
    (NEG_HAIR, 0.0, {"rounding": "rtz"}, 0x37),
    (None, 0.0625, {"rounding": "rna"}, 0x39),
    (None, 0.0625, {"rounding": "rto"}, 0x39),
    # 101.5 / 7 == 14.5 exactly: tie between 14 (0x56) and 15 (0x57) -> even 14; a hair above -> 15
    (None, 100.5, {"scale_result": np.float32(7)}, 0x56),
    (HAIR, 100.5, {"scale_result": np.float32(7)}, 0x57),
    (NEG_HAIR, 100.5, {"scale_result": np.float32(7)}, 0x56),
    # multiply: 29 * fp32(0.5) exactly = 14.5 -> 14; a hair above (29 + 2**-18) -> 15
    (None, 28.0, {"scale_result": np.float32(0.5), "scale_result_op": "multiply"}, 0x56),
    (HAIR, 28.0, {"scale_result": np.float32(0.5), "scale_result_op": "multiply"}, 0x57),
    # overflow: 1 + 463 = 464 is the midpoint of 448 and 480: ties to 448; 1 + 466 -> above max
    (None, 463.0, {"saturate": False}, 0x7E),
    (HAIR, 463.0, {"saturate": False}, 0x7F),  # e4m3fn has no Inf: NaN
    (None, 466.0, {}, 0x7E),                   # saturate (CUDA SATFINITE): max
    (None, -467.0, {}, 0xFE),
    (None, 466.0, {"saturate": False, "rounding": "rtz"}, 0x7E),  # IEEE 7.4: directed toward zero -> max
    (None, 1e30, {"saturate": False, "out_dtype": "float8_e5m2"}, 0x7C),  # Inf
    (None, 466.0, {"out_dtype": "float8_e5m2"}, 0x5F),  # 467 < 480 (midpoint of 448 and 512) -> 448
    (None, 6.0, {"out_dtype": "float4_e2m1fn", "saturate": False}, 0x07),  # 7 -> no Inf/NaN: saturates to 6
])
def test_hand_picked(ops, bias, kw, want):
    kw = {"out_dtype": "float8_e4m3fn", **kw}
    a_codes, b_codes = ops or ([ONE], [ONE])
    a = np.array([a_codes], np.uint8)
    b = np.array(b_codes, np.uint8).reshape(-1, 1)
    bias32 = np.array([bias], np.float32)
    got = int(scaled_mm(a, b, np.float32(1), np.float32(1), bias=bias32, **kw)[0, 0])
    fmt = FORMATS[kw["out_dtype"]]
    (x,), = exact_value(a, b, np.float32(1), np.float32(1), bias32)
    want_oracle = expected_codes([[x]], fmt, kw.get("scale_result"), kw.get("scale_result_op", "divide"),
                                 saturate=kw.get("saturate", True), rounding=kw.get("rounding", "rne"))
    assert got == int(want_oracle[0, 0]) == want


@pytest.mark.parametrize("sign", [1, -1])
@pytest.mark.parametrize("rounding", MODES)
@pytest.mark.parametrize(("base", "s", "op"), [
    (1.0625, None, "divide"), (7.4375, np.float32(7), "divide"), (14.5, np.float32(0.5), "multiply"),
    (1.0, None, "divide"), (14.0, np.float32(7), "divide"), (467.0 * 3, np.float32(3), "divide"),
])
def test_repair_decides_hairline_cases(sign, rounding, base, s, op):
    """x = bias + 2**-52 or bias - 2**-52 (product 2**-9 * 2**-9 * 2**-17 * 2**-17): the float64
    sum cannot see the hair, so the exact comparisons (repair) decide midpoints and grid points."""
    bias = np.array([sign * base], np.float32)
    sc = np.float32(2.0 ** -17)
    for hair in (0x01, 0x81, 0x00):
        a, b = np.array([[hair]], np.uint8), np.array([[0x01]], np.uint8)
        got = scaled_mm(a, b, sc, sc, bias=bias, out_dtype="float8_e4m3fn", scale_result=s, scale_result_op=op,
                        rounding=rounding, saturate=False)
        want = expected_codes(exact_value(a, b, sc, sc, bias), E4M3, s, op, saturate=False, rounding=rounding)
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize(("taus", "s", "approx", "want"), [
    ([1.0], None, 1.0 - 2.0 ** -40, 1.0),          # the approximation below a grid point: step up to it
    ([1.0], None, 1.0 + 2.0 ** -40, 1.0),          # above: stay
    ([1.0], None, 0.80, 1.0),                      # several grid points away
    ([7.0], 7.0, 1.0 - 2.0 ** -40, 1.0),           # divide: compared as 7 * g
    ([7.4375], 7.0, 1.0, 1.0625),                  # the midpoint itself
    ([7.4375, 2.0 ** -40], 7.0, 1.0, 1.09375),     # above the midpoint: lo + 3d/4
    ([7.4375, -2.0 ** -40], 7.0, 1.2, 1.03125),    # below it: lo + d/4
    ([-0.0], None, 2.0 ** -30, 0.0),               # an exact zero is +0
])
def test_repair_representatives(taus, s, approx, want):
    """CodeOut._repair from a deliberately wrong starting point: the representative t of v = x / s is
    v on the grid, else lo + d/4, the midpoint or lo + 3d/4 (e4m3fn: spacing 1/8 in [1, 2))."""
    from fp8ref.matmul import CodeOut
    t = CodeOut(E4M3, scale=s)._repair([np.array([x]) for x in taus], np.array([approx]))
    assert t[0] == want and math.copysign(1, t[0]) == math.copysign(1, want)


def test_subnormal_results_and_signed_underflow():
    # 2**-6 * 2**-6 = 2**-12: below e4m3fn's 2**-9 subnormal spacing... scale up to land on subnormals
    a = np.array([[0x08, 0x88]], np.uint8)   # 2**-6, -2**-6
    b = np.array([[0x08], [0x01]], np.uint8)  # 2**-6, 2**-9
    for sa in [np.float32(2.0 ** 3), np.float32(5.0), np.float32(2.0 ** -8)]:
        got = scaled_mm(a, b, sa, np.float32(1), out_dtype="float8_e4m3fn")
        want = expected_codes(exact_value(a, b, sa, np.float32(1), None), E4M3, None, "divide")
        np.testing.assert_array_equal(got, want)
    # a negative value that underflows keeps its sign: -0 code 0x80; an exact zero is +0
    neg = scaled_mm(np.array([[0x88]], np.uint8), np.array([[0x01]], np.uint8), np.float32(1), np.float32(1),
                    out_dtype="float8_e4m3fn")
    assert int(neg[0, 0]) == 0x80
    zero = scaled_mm(np.array([[0x88]], np.uint8), np.array([[0x00]], np.uint8), np.float32(1), np.float32(1),
                     out_dtype="float8_e4m3fn")
    assert int(zero[0, 0]) == 0x00


def test_nan_and_inf_operands_follow_the_codec():
    a = np.array([[0x7F, ONE], [ONE, ONE]], np.uint8)  # NaN in row 0
    b = np.array([[ONE], [ONE]], np.uint8)
    got = scaled_mm(a, b, np.float32(1), np.float32(1), out_dtype="float8_e4m3fn")
    assert int(got[0, 0]) == 0x7F and int(got[1, 0]) == 0x40
    # e5m2 Inf operand: saturating -> max (0x7b), non-saturating e5m2 -> Inf (0x7c), e4m3fn -> NaN
    a5 = np.array([[0x7C]], np.uint8)
    b5 = np.array([[0x3C]], np.uint8)
    kw = {"fmt_a": "float8_e5m2", "fmt_b": "float8_e5m2"}
    assert int(scaled_mm(a5, b5, np.float32(1), np.float32(1), out_dtype="float8_e5m2", **kw)[0, 0]) == 0x7B
    assert int(scaled_mm(a5, b5, np.float32(1), np.float32(1), out_dtype="float8_e5m2", saturate=False,
                         **kw)[0, 0]) == 0x7C
    assert int(scaled_mm(a5, b5, np.float32(1), np.float32(1), out_dtype="float8_e4m3fn", saturate=False,
                         **kw)[0, 0]) == 0x7F


def test_repair_path_with_block_scales_and_long_k():
    """Elements forced next to a midpoint with K-blocked scales (the _blocked/_repair_rows path)."""
    rng = np.random.default_rng(1)
    M, K, N = 4, 256, 3
    a = rng.choice(E4M3_FINITE, size=(M, K)).astype(np.uint8)
    b = rng.choice(E4M3_FINITE, size=(K, N)).astype(np.uint8)
    sa = rng.uniform(0.5, 2, size=(M, 2)).astype(np.float32)
    sb = rng.uniform(0.5, 2, size=(2, 1)).astype(np.float32)
    s = np.float32(3.0)
    got = scaled_mm(a, b, sa, sb, out_dtype="float8_e4m3fn", scale_result=s, block_k=128, block_n=128)
    want = np.zeros((M, N), np.uint8)
    for m in range(M):
        for n in range(N):
            x = sum(E4M3.exact_value(int(a[m, k])) * E4M3.exact_value(int(b[k, n]))
                    * Fraction(float(sa[m, k // 128])) * Fraction(float(sb[k // 128, 0])) for k in range(K))
            want[m, n] = oracle_code(x / Fraction(float(s)), E4M3)
    np.testing.assert_array_equal(got, want)


def test_torch_input_gives_torch_uint8_and_float8_out_dtype():
    a = torch.tensor([[1.0, 2.0]]).to(torch.float8_e4m3fn)
    b = torch.tensor([[1.0], [1.0]]).to(torch.float8_e4m3fn)
    got = scaled_mm(a, b, torch.tensor(1.0), torch.tensor(1.0), out_dtype=torch.float8_e4m3fn)
    assert got.dtype == torch.uint8 and int(got[0, 0]) == 0x44  # 3.0
    assert got.view(torch.float8_e4m3fn).float().item() == 3.0


# ------------------------------------------------------------------------------------------
# fp32 modes: declared order (fp32 result, then one fp32 operation with scale_result, then encode)
# ------------------------------------------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(problems(), st.sampled_from(["fp32", "fp32-limited"]), st.sampled_from(["divide", "multiply"]))
def test_fp32_modes_encode_the_fp32_value(problem, accumulate, op):
    a, b, sa, sb, bias, s = problem
    y32 = scaled_mm(a, b, sa, sb, bias=bias, out_dtype="float32", accumulate=accumulate)
    got = scaled_mm(a, b, sa, sb, bias=bias, out_dtype="float8_e4m3fn", accumulate=accumulate,
                    scale_result=s, scale_result_op=op)
    with np.errstate(over="ignore", under="ignore"):
        v = y32 if s is None else (y32 / s if op == "divide" else y32 * s).astype(np.float32)
    want = np.array([[oracle.encode(float(x), E4M3) for x in row] for row in v], np.uint8)
    np.testing.assert_array_equal(got, want)


# ------------------------------------------------------------------------------------------
# torch._scaled_mm on CPU (torch 2.13)
# ------------------------------------------------------------------------------------------
def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return {w for line in f if line.startswith("flags") for w in line.split(":", 1)[1].split()}
    except OSError:
        return set()


# Observed on two machines: with AMX, oneDNN runs FP8-output _scaled_mm and its cast does not
# saturate (e4m3fn overflow -> NaN 0x7F); without AMX, Blas.cpp's emulated path casts with torch's
# own .to(), which saturates e4m3fn (-> 0x7E) and overflows e5m2 to Inf.
TORCH_CPU_ONEDNN_FP8 = "amx_tile" in _cpu_flags()


def _torch_mm(a, b, sa, sb, s, out=torch.float8_e4m3fn, bias=None):
    A = torch.from_numpy(a).view(torch.float8_e4m3fn)
    B = torch.from_numpy(np.ascontiguousarray(b.T)).view(torch.float8_e4m3fn).t()
    return torch._scaled_mm(A, B, torch.tensor(sa), torch.tensor(sb), bias=bias,
                            scale_result=None if s is None else torch.tensor(s), out_dtype=out)


@settings(max_examples=80, deadline=None)
@given(st.integers(0, 2 ** 32 - 1), st.integers(-6, 6), st.sampled_from([torch.float8_e4m3fn, torch.float8_e5m2]))
def test_torch_cpu_divides_and_does_not_saturate(seed, s_exp, out):
    """Where every candidate path of torch agrees (T an integer below 2**11, so exact in fp32 and fp16;
    scale_result a power of two, so T / s == T * (1/s) exactly): torch == fp8ref exact mode with
    scale_result_op="divide", saturating only where torch's own e4m3fn cast does (the emulated path,
    no AMX). Fails if torch multiplied by scale_result or saturated where it should not."""
    rng = np.random.default_rng(seed)
    small = [c for c in E4M3_FINITE if float(E4M3.exact_value(c)) in (0, 1, 2, 3, 4, -1, -2, -3, -4)]
    a = rng.choice(small, size=(3, 16)).astype(np.uint8)
    b = rng.choice(small, size=(16, 2)).astype(np.uint8)
    s = np.float32(2.0 ** s_exp)
    want = _torch_mm(a, b, np.float32(1), np.float32(1), s, out).view(torch.uint8).numpy()
    saturate = not TORCH_CPU_ONEDNN_FP8 and out == torch.float8_e4m3fn
    got = scaled_mm(a, b, np.float32(1), np.float32(1), out_dtype=str(out).removeprefix("torch."),
                    scale_result=s, saturate=saturate)
    np.testing.assert_array_equal(got, want)
    # float outputs: torch ignores scale_result (fp8ref refuses it instead)
    f = _torch_mm(a, b, np.float32(1), np.float32(1), s, torch.float32)
    np.testing.assert_array_equal(f.numpy(), scaled_mm(a, b, np.float32(1), np.float32(1)))


def test_torch_cpu_rounds_via_fp32_or_fp16_pinned():
    """torch 2.13 CPU, observed: out = cast(fp32(T * fp32(1/s))) (Blas.cpp's emulated path), or on
    an AMX machine after the first call in a process cast(fp16(fp32(T * fp32(1/s)))) -- a double
    rounding. Each call matches one rule on every element; fp8ref's exact mode matches neither in
    general. Values: 101.5/7 = 14.5 (a tie; fp32(1/7) pushes it above), 136.0495 (just above the
    128/144 midpoint; fp16 rounds it onto the midpoint)."""
    bias = np.array([101.5, 136.0494842529297 * 7, 9.496996879577637 * 7, -37.986019134521484 * 7],
                    np.float32)
    s = np.float32(7)
    a, b = np.zeros((1, 16), np.uint8), np.zeros((16, bias.size), np.uint8)
    r = np.float32(1) / s
    v32 = (bias * r).astype(np.float32)
    rule_fp32 = np.array([oracle.encode(float(x), E4M3, saturate=False) for x in v32])
    rule_fp16 = np.array([oracle.encode(float(np.float16(x)), E4M3, saturate=False) for x in v32])
    exact = expected_codes(exact_value(a, b, np.float32(1), np.float32(1), bias), E4M3, s, "divide",
                           saturate=False)[0]
    assert (rule_fp32 != rule_fp16).all() and (exact != rule_fp16).any()
    for _ in range(3):
        t = _torch_mm(a, b, np.float32(1), np.float32(1), s, bias=torch.from_numpy(bias)).view(torch.uint8)
        t = t.numpy()[0]
        assert (t == rule_fp32).all() or (t == rule_fp16).all(), t
    ours = scaled_mm(a, b, np.float32(1), np.float32(1), bias=bias, out_dtype="float8_e4m3fn", saturate=False,
                     scale_result=s)
    np.testing.assert_array_equal(ours[0], exact)
    # fp8ref reproduces the fp32 rule: fp32 mode, scale_result = fp32(1/s), "multiply"
    ours32 = scaled_mm(a, b, np.float32(1), np.float32(1), bias=bias, out_dtype="float8_e4m3fn", saturate=False,
                       accumulate="fp32", scale_result=r, scale_result_op="multiply")
    np.testing.assert_array_equal(ours32[0], rule_fp32)


def test_torch_overflow_is_nan_where_fp8ref_default_saturates():
    a = np.array([[0x7E]], np.uint8)  # 448
    b = np.array([[TWO]], np.uint8)
    t = _torch_mm(a, b, np.float32(1), np.float32(1), np.float32(1))
    # oneDNN (AMX) does not saturate: NaN; the emulated path saturates like torch's .to()
    assert int(t.view(torch.uint8)[0, 0]) == (0x7F if TORCH_CPU_ONEDNN_FP8 else 0x7E)
    assert int(scaled_mm(a, b, np.float32(1), np.float32(1), out_dtype="float8_e4m3fn")[0, 0]) == 0x7E
    assert int(scaled_mm(a, b, np.float32(1), np.float32(1), out_dtype="float8_e4m3fn", saturate=False)[0, 0]) == 0x7F


# ------------------------------------------------------------------------------------------
# Bad input
# ------------------------------------------------------------------------------------------
A1, B1, S1 = np.array([[ONE]], np.uint8), np.array([[ONE]], np.uint8), np.float32(1)


@pytest.mark.parametrize(("kw", "err", "text"), [
    ({"scale_result": np.float32("nan")}, ScaleError, "scale_result: expected a finite float32 > 0, got nan"),
    ({"scale_result": np.float32(0)}, ScaleError, "got 0.0"),
    ({"scale_result": np.float32(-2)}, ScaleError, "got -2.0"),
    ({"scale_result": np.float32("inf")}, ScaleError, "got inf"),
    ({"scale_result": np.ones(2, np.float32)}, ShapeError, "scale_result: expected one float32 value"),
    ({"scale_result": np.float64(2)}, InputTypeError, "scale_result: expected dtype float32"),
    ({"scale_result_op": "mul"}, InputTypeError, "scale_result_op: expected 'divide' or 'multiply', got 'mul'"),
    ({"rounding": "stochastic"}, FormatError, "rounding: expected one of rne"),
    ({"saturate": 1}, InputTypeError, "saturate: expected True or False, got 1"),
    ({"out_dtype": "float8_e8m0fnu"}, FormatError, "out_dtype: float8_e8m0fnu has no zero"),
    ({"out_dtype": "float8_e4m3"}, InputTypeError, "out_dtype: expected one of float32"),
    ({"out_dtype": "float32", "scale_result": np.float32(2)}, InputTypeError,
     "scale_result: applies only to an FP8/FP6/FP4 out_dtype"),
    ({"out_dtype": "bfloat16", "saturate": False}, InputTypeError, "saturate: applies only"),
])
def test_bad_input(kw, err, text):
    kw = {"out_dtype": "float8_e4m3fn", **kw}
    with pytest.raises(err, match=None) as info:
        scaled_mm(A1, B1, S1, S1, **kw)
    assert isinstance(info.value, Fp8RefError)
    assert text in str(info.value)
