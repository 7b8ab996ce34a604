"""Compatibility profiles: encode as a named specification says, where it differs from fp8ref's rule.

fp8ref's codec (``fp8ref.codec``, docs/codec.md) is one rule for every format. A profile computes
what another specification prescribes for the same call, so that a backend can be checked against
"the exact reference" and against "that specification" separately. The differences are the only
thing a profile changes; every other element is fp8ref's code.

Profile ``onnx`` (ONNX ``Cast`` at opset 25, onnx/defs/tensor/defs.cc and the Cast table of
Operators.md):

- E8M0 with ``saturate=0`` (the table's "non-saturate + nearest" column, applied to every round_mode):
  ``x > E8M0_MAX`` and ``x < E8M0_MIN`` (0 included) give NaN (0xff), where fp8ref rounds first (x just
  above 2^127 -> 0xfe under nearest or toward zero; x below 2^-127 -> 0x00).
- FLOAT4E2M1: Cast has no ``saturate`` attribute and the spec has no FP4 table; ONNX's reference
  implementation (``x.astype(ml_dtypes.float4_e2m1fn)``) and its node tests (``test_cast_FLOAT_to_FLOAT4E2M1``)
  give ±Inf -> ±6 (0x7 / 0xf) and NaN -> 0x8 (the code of -0), where fp8ref refuses NaN (and ±Inf
  without saturation) with EncodeError.
- Not changed: negative E8M0 inputs and -0 (the spec: "undefined" / "Unspecified"): fp8ref's NaN.
  QuantizeLinear's arithmetic is the ``onnx`` recipe (specs/recipes/onnx.yaml), not a profile.
"""

from __future__ import annotations

import numpy as np

from . import codec
from ._arrays import bf16_bits_to_f32, float_input
from .errors import InputTypeError
from .formats import get_format

PROFILES = ("fp8ref", "onnx")


def encode(x, fmt, *, saturate: bool = True, rounding: str = "rne", profile: str = "fp8ref",
           random_bits=None) -> np.ndarray:
    """``codec.encode`` under ``profile`` (numpy in, numpy out)."""
    if profile not in PROFILES:
        raise InputTypeError(f"profile: expected one of {', '.join(PROFILES)}, got {profile!r}")
    fmt = get_format(fmt)
    if profile == "fp8ref":
        return codec.encode(x, fmt, saturate=saturate, rounding=rounding, random_bits=random_bits)
    arr, dtype, as_torch = float_input(x, "x")
    if as_torch:
        raise InputTypeError("x: profile 'onnx' takes numpy arrays (ONNX's tensors); got a torch tensor")
    with np.errstate(invalid="ignore"):  # a signalling NaN widens to a quiet one
        wide = (bf16_bits_to_f32(arr) if dtype == "bfloat16" else arr).astype(np.float64)
    if fmt.name == "float4_e2m1fn":
        return _onnx_fp4(arr, wide, fmt, rounding)
    codes = np.asarray(codec.encode(x, fmt, saturate=saturate, rounding=rounding, random_bits=random_bits))
    if fmt.name == "float8_e8m0fnu" and not saturate:
        with np.errstate(invalid="ignore"):
            out_of_range = (wide > fmt.max) | ((wide < fmt.min_normal) & ~np.signbit(wide))
        codes = np.where(out_of_range, np.uint8(fmt.nan_code), codes).astype(np.uint8)
    return codes


def _onnx_fp4(arr, wide: np.ndarray, fmt, rounding: str) -> np.ndarray:
    """FP4 under ONNX's reference: NaN -> 0x8, ±Inf -> ±max, the rest fp8ref's saturating encode."""
    nan = np.isnan(wide)
    finite = np.where(nan, 0.0, wide)  # Inf stays: the saturating encode maps it to ±max
    codes = np.asarray(codec.encode(finite, fmt, saturate=True, rounding=rounding))
    return np.where(nan, np.uint8(fmt.sign_mask), codes).astype(np.uint8).reshape(arr.shape)


__all__ = ["PROFILES", "encode"]
