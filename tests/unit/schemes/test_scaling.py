"""scaling: layouts, amax reductions, scale formulas (checked against naive loops and Fractions)."""

from __future__ import annotations

from fractions import Fraction

import ml_dtypes
import numpy as np
import pytest

from fp8ref.errors import ShapeError
from fp8ref.formats import FORMATS
from fp8ref.scaling import amax_over_max, e8m0_value, expand, layout, mx_scale_exponent, nvfp4_global_scale, reduce_amax
from tests.support.quant_oracle import fp32_nearest

E4M3 = FORMATS["float8_e4m3fn"]


@pytest.mark.parametrize("shape,gran,kw,want", [
    ((5, 7), "tensor", {}, (1,)),
    ((), "tensor", {}, (1,)),
    ((5, 7), "channel", {}, (5, 1)),
    ((2, 3, 7), "token", {}, (2, 3, 1)),
    ((5, 70), "group", {"group_size": 32}, (5, 3)),       # partial last group
    ((136, 130), "block", {"block_shape": (128, 128)}, (2, 2)),  # partial edge blocks
    ((4, 136, 130), "block", {"block_shape": (128, 128)}, (4, 2, 2)),
    ((3, 65), "mx", {}, (3, 3)),
    ((3, 48), "nvfp4", {}, (3, 3)),
])
def test_layout(shape, gran, kw, want):
    assert layout(shape, gran, **kw) == want


@pytest.mark.parametrize("gran,kw,match", [
    ("rows", {}, "granularity: expected one of"),
    ("group", {"group_size": 0}, "group_size: granularity 'group' needs a positive int, got 0"),
    ("block", {"block_shape": (128, 0)}, r"block_shape: expected two positive ints \(rows, cols\), got \(128, 0\)"),
])
def test_layout_errors(gran, kw, match):
    with pytest.raises(ShapeError, match=match):
        layout((4, 4), gran, **kw)


def _naive_amax(x: np.ndarray, gran: str, kw: dict) -> np.ndarray:
    """Explicit loops over index sets, float64 comparisons (NaN wins)."""
    shape = layout(x.shape, gran, **kw)
    out = np.zeros(shape)
    x64 = np.abs(x.astype(np.float64))
    for idx in np.ndindex(x.shape):
        if gran == "tensor":
            key = (0,)
        elif gran in ("channel", "token"):
            key = idx[:-1] + (0,)
        elif gran == "block":
            bh, bw = kw["block_shape"]
            key = idx[:-2] + (idx[-2] // bh, idx[-1] // bw)
        else:
            g = {"mx": 32, "nvfp4": 16}.get(gran, kw.get("group_size"))
            key = idx[:-1] + (idx[-1] // g,)
        v = x64[idx]
        if np.isnan(v) or np.isnan(out[key]):
            out[key] = np.nan
        else:
            out[key] = max(out[key], v)
    return out


CASES = [("tensor", {}), ("channel", {}), ("token", {}), ("group", {"group_size": 24}),
         ("block", {"block_shape": (16, 32)}), ("mx", {}), ("nvfp4", {})]


@pytest.mark.parametrize("gran,kw", CASES)
@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16, np.float32, np.float64])
def test_reduce_amax_matches_naive_loops(gran, kw, dtype):
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((37, 70)) * 10).astype(dtype)
    x[3, 5] = -np.inf
    x[7, 60] = np.nan
    x[9, :] = -0.0
    assert np.array_equal(reduce_amax(x, gran, **kw), _naive_amax(x, gran, kw), equal_nan=True)


def test_reduce_amax_rejects_integers():
    with pytest.raises(ShapeError, match="x: expected a floating-point array, got int32"):
        reduce_amax(np.ones((2, 2), np.int32), "tensor")


def test_expand_inverts_layout():
    s = np.arange(6, dtype=np.float32).reshape(2, 3)
    e = expand(s, (20, 70), "block", block_shape=(16, 32))
    assert e.shape == (20, 70) and e[17, 65] == 5 and e[0, 31] == 0 and e[15, 32] == 1
    g = expand(np.arange(3.0).reshape(1, 3), (1, 70), "group", group_size=32)
    assert g.shape == (1, 70) and g[0, 69] == 2


def test_amax_over_max_is_rounded_once_every_fp16_value():
    """All positive finite fp16 amax values, against a Fraction oracle."""
    a = np.arange(1, 0x7C00, dtype=np.uint16).view(np.float16).astype(np.float64)
    got = amax_over_max(a, E4M3)
    sample = a[::97]
    want = np.array([fp32_nearest(Fraction(float(v)) / 448) for v in sample])
    assert np.array_equal(got[::97].astype(np.float64), want)


def test_amax_over_max_settles_float64_midpoints_exactly():
    """float64 amax whose float64 quotient is an exact fp32 midpoint but the rational is not."""
    rng = np.random.default_rng(1)
    cases = []
    for _ in range(200):  # q = a float32 midpoint; amax = q*448 rounded to float64, off by < 1 ulp
        f = np.float32(rng.uniform(1, 2))
        mid = (float(f) + float(np.nextafter(f, np.float32(3)))) / 2
        for a in (mid * 448, np.nextafter(mid * 448, 0), np.nextafter(mid * 448, np.inf)):
            cases.append(a)
    a = np.array(cases)
    got = amax_over_max(a, E4M3).astype(np.float64)
    want = np.array([fp32_nearest(Fraction(float(v)) / 448) for v in a])
    assert np.array_equal(got, want)


def test_mx_exponent_special_blocks():
    e4 = FORMATS["float8_e4m3fn"]
    e = mx_scale_exponent(np.array([0.0, np.nan, np.inf, 1e-45, 3e38, 448.0, 449.0]), e4, "floor")
    assert list(e) == [-127, 128, 128, -127, 119, 0, 0]
    r = mx_scale_exponent(np.array([448.0, 449.0, 224.0, 1e-45]), e4, "rceil")
    assert list(r) == [0, 1, -1, -127]
    with pytest.raises(ShapeError, match="mx_rule"):
        mx_scale_exponent(np.ones(1), e4, "ceil")


def test_mx_floor_uses_frexp_not_log2():
    """Just below a power of two float32 log2 rounds up (microxcaling's off-by-one)."""
    v = np.float32(np.nextafter(np.float32(2.0 ** 10), np.float32(0)))
    assert np.floor(np.log2(v)) == 10                     # the pitfall
    assert mx_scale_exponent(np.array([v], np.float64), E4M3, "floor")[0] == 9 - 8


def test_e8m0_values_are_exact_powers():
    e = np.arange(-127, 129)
    v = e8m0_value(e)
    assert all(Fraction(float(v[i])) == Fraction(2) ** int(e[i]) for i in range(254))
    assert np.isnan(v[-1])


def test_nvfp4_global_scale():
    e2m1 = FORMATS["float4_e2m1fn"]
    assert nvfp4_global_scale(0.0, e2m1, E4M3) == 1.0
    assert nvfp4_global_scale(5.25, e2m1, E4M3) == np.float32(fp32_nearest(Fraction(5.25) / 2688))
