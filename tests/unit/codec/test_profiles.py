"""The ONNX compatibility profile (fp8ref.profiles) and QuantizeLinear's recipe ``onnx``.

The expected codes are the cells of ONNX's Cast tables (Operators.md, Cast-25) and hand-worked
QuantizeLinear quotients; everywhere the ONNX spec and fp8ref's rule agree, the profile must be
fp8ref's codec itself (checked on every float16 and bfloat16 input). The engines themselves
(onnxruntime, ONNX's ReferenceEvaluator) are checked in tests/interop/test_engine_backends.py.
"""

from __future__ import annotations

from fractions import Fraction

import ml_dtypes
import numpy as np
import pytest

import fp8ref
from fp8ref import profiles, quant
from fp8ref.errors import EncodeError, Fp8RefError
from fp8ref.quant import QuantArgs

E8M0_NAN, E8M0_MAX, E8M0_MIN = 0xFF, 0xFE, 0x00
MODES = ("rne", "rna", "rtz", "rup", "rdown")


def _e8m0(x, rounding, saturate, profile):
    return profiles.encode(np.array(x, np.float64), "float8_e8m0fnu", rounding=rounding, saturate=saturate,
                           profile=profile).tolist()


@pytest.mark.parametrize("rounding", MODES)
def test_onnx_e8m0_without_saturation_gives_nan_outside_its_range(rounding):
    """The table's "non-saturate" column: 0, x < E8M0_MIN and x > E8M0_MAX are NaN, in every round_mode."""
    x = [0.0, 2.0 ** -128, 2.0 ** -127 * 0.75, 1.25 * 2.0 ** 127, 2.0 ** 128, np.inf, 2.0 ** -127, 2.0 ** 127, 1.0]
    assert _e8m0(x, rounding, False, "onnx") == [E8M0_NAN] * 6 + [E8M0_MIN, E8M0_MAX, 127]
    fp8ref_codes = _e8m0(x, rounding, False, "fp8ref")
    assert fp8ref_codes[1] == E8M0_MIN and fp8ref_codes[-3:] == [E8M0_MIN, E8M0_MAX, 127]  # fp8ref rounds first


@pytest.mark.parametrize("rounding", MODES)
def test_onnx_e8m0_with_saturation_is_fp8ref_rule(rounding):
    """The "saturate" column: 0 and x < E8M0_MIN -> E8M0_MIN, Inf and x > E8M0_MAX -> E8M0_MAX: fp8ref's rule."""
    x = [0.0, 2.0 ** -140, np.inf, 2.0 ** 128, 3.0 * 2.0 ** 127, np.nan]
    assert _e8m0(x, rounding, True, "onnx") == [E8M0_MIN, E8M0_MIN, E8M0_MAX, E8M0_MAX, E8M0_MAX, E8M0_NAN]
    assert _e8m0(x, rounding, True, "fp8ref") == _e8m0(x, rounding, True, "onnx")


def test_onnx_fp4_nan_is_code_8_and_inf_saturates():
    """ONNX's reference (ml_dtypes' cast) and its node test test_cast_FLOAT_to_FLOAT4E2M1: NaN -> 0x8,
    +-Inf -> +-6; fp8ref refuses NaN (and Inf without saturation)."""
    x = np.array([np.nan, -np.nan, np.inf, -np.inf, 9.0, -0.0, 0.25, 0.75], np.float32)
    want = [0x8, 0x8, 0x7, 0xF, 0x7, 0x8, 0x0, 0x2]
    for saturate in (True, False):
        assert profiles.encode(x, "float4_e2m1fn", saturate=saturate, profile="onnx").tolist() == want
    assert x[2:].astype(ml_dtypes.float4_e2m1fn).view(np.uint8).tolist() == want[2:]  # the peer's own cast
    with pytest.raises(EncodeError):
        fp8ref.encode(x, "float4_e2m1fn")


@pytest.mark.parametrize("fmt", ["float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
                                 "float8_e8m0fnu", "float4_e2m1fn"])
@pytest.mark.parametrize("kind", ["float16", "bfloat16"])
def test_onnx_profile_is_fp8ref_wherever_the_specs_agree(fmt, kind):
    """Every 16-bit input, every mode and saturation: the profile differs from fp8ref's codec only on
    the inputs its rules name (E8M0 out of range without saturation; FP4 NaN / Inf)."""
    bits = np.arange(1 << 16, dtype=np.uint16)
    x = bits.view(np.float16) if kind == "float16" else bits.view(ml_dtypes.bfloat16)
    with np.errstate(invalid="ignore"):
        wide = x.astype(np.float64)
    for saturate in (True, False):
        keep = ~np.isnan(wide) & (np.isfinite(wide) | saturate) if fmt == "float4_e2m1fn" else np.ones(x.shape, bool)
        for rounding in MODES if fmt == "float8_e8m0fnu" else ("rne",):
            onnx = profiles.encode(x, fmt, saturate=saturate, rounding=rounding, profile="onnx")
            ours = fp8ref.encode(x[keep], fmt, saturate=saturate, rounding=rounding)
            named = np.zeros(x.shape, bool)
            if fmt == "float8_e8m0fnu" and not saturate:
                named = (wide > 2.0 ** 127) | ((wide < 2.0 ** -127) & ~np.signbit(wide))
            differ = onnx[keep] != ours
            assert not (differ & ~named[keep]).any(), (saturate, rounding, wide[keep][differ & ~named[keep]][:4])


def test_unknown_profile_is_refused():
    with pytest.raises(Fp8RefError, match="profile: expected one of fp8ref, onnx"):
        profiles.encode(np.zeros(1, np.float32), "float8_e4m3fn", profile="onnnx")


# --- QuantizeLinear: recipe onnx ----------------------------------------------------------------
def test_onnx_recipe_divides_in_float32_then_casts():
    """x / y_scale rounded to float32 first: for x = 0.9612226 and s = 1.8093601 (float32) the exact
    quotient lies 6.2e-9 above 0.53125, e4m3fn's midpoint between 0.5 (0x30) and 0.5625 (0x31), and
    rounds up; its float32 rounding is the midpoint itself, which ties to the even code 0x30."""
    x, s = np.float32(0.9612226), np.float32(1.8093601)
    assert Fraction(float(x)) / Fraction(float(s)) > Fraction(17, 32) and x / s == np.float32(17 / 32)
    args = QuantArgs(format="float8_e4m3fn", granularity="tensor", dynamic=False)
    xs, scale = np.array([[x, -x]], np.float32), np.array([s], np.float32)
    assert quant.quantize(xs, args, recipe="onnx", scale=scale).codes.tolist() == [[0x30, 0xB0]]
    assert quant.quantize(xs, args, recipe="fp8ref", scale=scale).codes.tolist() == [[0x31, 0xB1]]


def test_onnx_recipe_adds_the_zero_point_to_minus_zero():
    """y = saturate((x / y_scale) + y_zero_point): -0.0 / s + 0 = +0.0 (code 0x00); fp8ref keeps -0 (0x80)."""
    args = QuantArgs(format="float8_e4m3fn", granularity="tensor")
    xs = np.array([[-0.0, 1.0, -1e-30]], np.float32)
    assert quant.quantize(xs, args, recipe="onnx").codes.tolist() == [[0x00, 0x7E, 0x80]]
    assert quant.quantize(xs, args, recipe="fp8ref").codes.tolist() == [[0x80, 0x7E, 0x80]]
