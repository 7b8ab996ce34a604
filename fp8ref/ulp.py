"""``ulp_distance(a, b, dtype)``: how many representable values of ``dtype`` lie between a and b.

For researchers comparing an implementation with the oracle: the count of steps on ``dtype``'s
own grid (an FP8/FP6/FP4 format or bfloat16/float16/float32/float64), with +0 and -0 one
point and infinity one step past the largest finite value. Both inputs must be values of
``dtype`` (a value between two grid points has no ULP distance: round it first); NaN has none.
"""

from __future__ import annotations

import numpy as np

from ._arrays import BITS_DTYPES, bits_view, to_numpy
from .codec import decode, encode
from .errors import EncodeError, InputTypeError
from .formats import FORMATS, FloatFormat, get_format
from .rounding import round_to, to_bits


def sign_bit(a: np.ndarray, fmt: FloatFormat | None = None) -> np.ndarray:
    """The sign bit of FP8/FP6/FP4 codes (``fmt`` given) or of a float array's bit patterns."""
    if fmt is not None:
        return (a & fmt.sign_mask) != 0
    return (bits_view(a).astype(np.uint64) >> np.uint64(a.dtype.itemsize * 8 - 1)) != 0


def ordinal(a: np.ndarray, fmt: FloatFormat | None = None) -> np.ndarray:
    """Position of each code (``fmt`` given) or float bit pattern on its grid (sign-magnitude ->
    signed integer), so that neighbours differ by 1 and +0 == -0; Inf sits one past the largest
    finite value. Meaningless for NaN."""
    if fmt is not None:
        mag = (a & fmt.magnitude_mask).astype(np.int64)
    else:
        bits = bits_view(a).astype(np.uint64)
        mag = (bits & ~(np.uint64(1) << np.uint64(a.dtype.itemsize * 8 - 1))).astype(np.int64)
    return np.where(sign_bit(a, fmt), -mag, mag)


def _values(x, what: str) -> np.ndarray:
    a = to_numpy(x, what) if not isinstance(x, (int, float)) else np.asarray(float(x))
    if a.dtype.kind not in "fiu":
        raise InputTypeError(f"{what}: expected real numbers, got dtype {a.dtype}")
    v = a.astype(np.float64)
    if np.isnan(v).any():
        raise InputTypeError(f"{what}: NaN has no ULP distance (at index {tuple(np.argwhere(np.isnan(v))[0])})")
    return v


def _at(what: str, index: tuple) -> str:
    return f"{what}[{', '.join(map(str, index))}]" if index else what


def _ordinal(v: np.ndarray, dtype, what: str) -> np.ndarray:
    """Signed position of each value on dtype's grid (+0 and -0 both 0)."""
    name = dtype if isinstance(dtype, str) and dtype in BITS_DTYPES else None
    if name is None:
        fmt: FloatFormat = get_format(dtype)

        try:
            codes = encode(v, fmt, saturate=False)
        except EncodeError as exc:  # e.g. infinity into a format without Inf or NaN
            raise EncodeError(f"{what}: {exc}") from None
        back = decode(codes, fmt).astype(np.float64)
        bad = back != v
        if bad.any():
            i = tuple(np.argwhere(bad)[0])
            raise EncodeError(f"{_at(what, i)} = {float(v[i])!r} is not a {fmt.name} value")
        return ordinal(codes, fmt)
    exact = round_to(v, name).astype(np.float64) if name != "float64" else v
    bad = exact != v
    if bad.any():
        i = tuple(np.argwhere(bad)[0])
        raise EncodeError(f"{_at(what, i)} = {float(v[i])!r} is not a {name} value")
    return ordinal(to_bits(v.astype(np.float32) if name == "bfloat16" else v, name))


def ulp_distance(a, b, dtype) -> np.ndarray:
    """|ordinal(a) - ordinal(b)| on ``dtype``'s grid, elementwise (numpy int64; a and b broadcast).

    ``dtype``: a format name, FloatFormat or torch/ml_dtypes dtype (``FORMATS``), or
    'bfloat16', 'float16', 'float32', 'float64'. EncodeError when an input is not a value of
    ``dtype``; InputTypeError for NaN."""
    if isinstance(dtype, str) and dtype not in BITS_DTYPES and dtype not in FORMATS:
        get_format(dtype)  # the unknown-format error, with its suggestions
    va, vb = np.broadcast_arrays(_values(a, "a"), _values(b, "b"))
    return np.abs(_ordinal(va, dtype, "a") - _ordinal(vb, dtype, "b"))
