"""Fake conversion: a float tensor through an FP8 format and back into its own dtype, with a scale and
a shift, as OpenVINO's FakeConvert-13 defines it (docs/conformance.md "fake_quant")::

    data = data * scale - shift
    ConvertLike(Convert(data, destination_type), data)
    data = (data + shift) / scale

``data``, ``scale`` and ``shift`` are tensors of one dtype T (float32, float16 or bfloat16). Each
line is evaluated in float32 (every operation rounded to nearest even) and its result rounded once
to T, as OpenVINO's reference implementation (``ov::reference::fake_convert``, the expression on
T's values promoted to float and assigned back to T) computes it; for T = float32 that is every
operation rounded once. Convert rounds to nearest even and saturates to +-max (the spec does not
say; the reference implementation clamps, and so does the CPU plugin); NaN stays NaN. Back in T the
FP8 value is exact.

Exactness: each float32 step is computed in float64 and rounded once. A float64 product of two
such values is exact (at most 2 x 24 significant bits); a float64 sum or quotient is correctly
rounded, and rounding it again to a format of precision p <= 24 gives that format's correctly
rounded result (53 >= 2p + 2: double rounding is innocuous for +, -, x and /).
tests/unit/test_fakeconvert.py checks this against an exact Fraction oracle.

``deviations`` switch on ways an implementation is known to compute something else (the
conformance tags that explain a mismatch, ``fp8ref.golden.ops.fake_quant``):
``double-rounding``  the converted value is first rounded to float16 (OpenVINO's CPU plugin);
``reciprocal``       the last line multiplies by 1 / scale rounded to T, instead of dividing by scale;
``reciprocal-float32``  the same with 1 / scale rounded to float32;
``zero``             a zero keeps its sign through ``+ shift`` when shift is zero (-0 + 0 stays -0).
"""

from __future__ import annotations

import numpy as np

from . import codec
from ._arrays import numpy_bf16
from .errors import InputTypeError
from .formats import get_format
from .rounding import OUT_FORMATS, round_to_format, to_bits

DTYPES = ("float32", "float16", "bfloat16")
DEVIATIONS = ("double-rounding", "reciprocal", "reciprocal-float32", "zero")


def round_to_dtype(v: np.ndarray, dtype: str) -> np.ndarray:
    """RNE of float64 values onto ``dtype`` (IEEE overflow to +-Inf, NaN kept), as float64."""
    with np.errstate(over="ignore", invalid="ignore"):
        return round_to_format(v, OUT_FORMATS[dtype])


def _f32(v: np.ndarray) -> np.ndarray:
    return round_to_dtype(v, "float32")


def as_dtype(values: np.ndarray, dtype: str) -> np.ndarray:
    """float64 values that ``dtype`` holds exactly, as an array of that dtype (bfloat16: ml_dtypes')."""
    if dtype == "bfloat16":
        return numpy_bf16(to_bits(np.asarray(values, np.float64).astype(np.float32), "bfloat16"))
    return np.asarray(values, np.float64).astype(dtype)


def dtype_of(x) -> str:
    name = np.asarray(x).dtype.name
    if name not in DTYPES:
        raise InputTypeError(f"fake_convert: x: expected one of {', '.join(DTYPES)}, got {name}")
    return name


def fake_convert(x, scale, shift, fmt, *, deviations: tuple[str, ...] = ()) -> np.ndarray:
    """FakeConvert-13 of numpy ``x`` (float32, float16 or bfloat16) into FP8 format ``fmt`` and back:
    ``(decode(encode(x * scale - shift)) + shift) / scale``, each line in float32, then rounded to x's dtype;
    ``scale`` and ``shift`` broadcast against x and are taken in x's dtype. Same dtype and shape as x."""
    dtype = dtype_of(x)
    for d in deviations:
        if d not in DEVIATIONS:
            raise ValueError(f"fake_convert: deviations: expected names from {DEVIATIONS}, got {d!r}")
    f = get_format(fmt)
    with np.errstate(invalid="ignore"):  # a bfloat16 NaN widened
        x64 = np.asarray(x).astype(np.float64)
    s64 = round_to_dtype(np.asarray(scale, np.float64), dtype)  # the scale and shift tensors are T's
    b64 = round_to_dtype(np.asarray(shift, np.float64), dtype)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        t = round_to_dtype(_f32(_f32(x64 * s64) - b64), dtype)
        if "double-rounding" in deviations:
            t = round_to_dtype(t, "float16")
        u = codec.decode(codec.encode(t, f, saturate=True, rounding="rne"), f).astype(np.float64)
        v = _f32(u + b64)
        if "zero" in deviations:
            v = np.where((u == 0) & (b64 == 0), u, v)
        if "reciprocal" in deviations or "reciprocal-float32" in deviations:
            r = round_to_dtype(1.0 / s64, dtype if "reciprocal" in deviations else "float32")
            y = round_to_dtype(_f32(v * r), dtype)
        else:
            y = round_to_dtype(_f32(v / s64), dtype)
    return as_dtype(y, dtype)


__all__ = ["DEVIATIONS", "DTYPES", "as_dtype", "fake_convert", "round_to_dtype"]
