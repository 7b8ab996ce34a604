"""Rounding to the IEEE binary formats a model computes in (bfloat16, float16, float32): once.

``round_to_format(v, fmt)`` is the definition: RNE of float64 values on ``fmt``'s grid (IEEE
subnormals, overflow to +-Inf, signed zero and NaN kept), one ``rint`` on a power-of-two scaled
copy, so every step is exact. ``round_to(v, dtype)`` is the same rounding with the fast paths
the hot loops use (the float32 -> bfloat16 bit trick, numpy's correctly rounded float16 cast);
tests/unit/codec/test_rounding.py checks both against an exact Fraction oracle.

``OutFormat`` describes such a format; ``OUT_FORMATS`` are the result dtypes of scaled_mm.
Bit patterns <-> values: ``to_bits`` / ``from_bits`` (bfloat16 through fp8ref._arrays).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ._arrays import BITS_DTYPES, bf16_bits_to_f32
from .errors import InputTypeError, RecipeError


@dataclass(frozen=True)
class OutFormat:
    """A binary floating-point type: ``precision`` significand bits (with the implicit one),
    normal exponents ``emin``..``emax``, IEEE subnormals, Inf and NaN."""

    name: str
    precision: int
    emin: int
    emax: int

    @property
    def max(self) -> float:
        return math.ldexp(2.0 - math.ldexp(1.0, 1 - self.precision), self.emax)

    @property
    def eps(self) -> float:
        return math.ldexp(1.0, 1 - self.precision)


OUT_FORMATS = {
    "float32": OutFormat("float32", 24, -126, 127),
    "bfloat16": OutFormat("bfloat16", 8, -126, 127),
    "float16": OutFormat("float16", 11, -14, 15),
}
FLOAT_FORMATS = {**OUT_FORMATS, "float64": OutFormat("float64", 53, -1022, 1023)}
MODEL_DTYPES = ("bfloat16", "float16", "float32", "float64")


def exponent(a: np.ndarray) -> np.ndarray:
    """floor(log2 |a|) for a != 0 (frexp: exact)."""
    return np.frexp(a)[1] - 1


def ulp_exponent(a: np.ndarray, fmt: OutFormat) -> np.ndarray:
    """Exponent of the spacing of ``fmt``'s grid (unbounded above) at magnitude ``a``."""
    e = np.where(a == 0, fmt.emin, exponent(a))
    return np.maximum(e, fmt.emin) - (fmt.precision - 1)


def round_to_format(values: np.ndarray, fmt: OutFormat) -> np.ndarray:
    """RNE of float64 ``values`` to ``fmt`` (float64 result), IEEE overflow to +-Inf."""
    u = ulp_exponent(np.abs(values), fmt)
    with np.errstate(over="ignore"):  # beyond float64: Inf, which is the answer
        r = np.ldexp(np.rint(np.ldexp(values, -u)), u)
    return np.where(np.abs(r) > fmt.max, np.copysign(np.inf, r), r)


def eps_of(dtype: str) -> float:
    """Distance from 1.0 to the next larger value of ``dtype``."""
    return FLOAT_FORMATS[dtype].eps


def round_to(v: np.ndarray, dtype: str) -> np.ndarray:
    """Round float32/float64 values once (RNE) to ``dtype``; float32 result (float64 for
    float64), holding values exactly representable in ``dtype``."""
    v = np.asarray(v)
    if dtype == "float64":
        return v.astype(np.float64)
    if dtype == "float32":
        with np.errstate(over="ignore"):
            return v.astype(np.float32)
    if dtype == "float16":
        with np.errstate(over="ignore"):  # overflow to +-inf is the IEEE result
            return v.astype(np.float16).astype(np.float32)  # numpy's cast rounds once, from either width
    if dtype != "bfloat16":
        raise RecipeError(f"dtype: expected one of {', '.join(MODEL_DTYPES)}, got {dtype!r}")
    if v.dtype == np.float32:  # add half an ulp minus one (plus the lsb: ties to even), truncate
        u = v.view(np.uint32)
        lsb = (u >> np.uint32(16)) & np.uint32(1)
        r = ((u + np.uint32(0x7FFF) + lsb) & np.uint32(0xFFFF0000)).view(np.float32)
        return np.where(np.isnan(v), v, r)  # NaN payloads must not carry into the exponent
    with np.errstate(over="ignore", invalid="ignore"):
        finite = np.isfinite(v) & (v != 0)
        r = round_to_format(np.where(finite, v, 0.0).astype(np.float64), OUT_FORMATS["bfloat16"])
        return np.where(finite, r, v).astype(np.float32)


def to_bits(values: np.ndarray, dtype: str) -> np.ndarray:
    """Bit patterns of values ``dtype`` holds exactly (a bfloat16 NaN keeps its sign and top
    payload bits and is made quiet)."""
    values = np.asarray(values)
    if dtype == "bfloat16":
        u = np.ascontiguousarray(values, np.float32).view(np.uint32)
        nan = (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
        return np.where(nan, (u >> np.uint32(16)) | np.uint32(0x40), u >> np.uint32(16)).astype(np.uint16)
    if dtype not in BITS_DTYPES:
        raise InputTypeError(f"dtype: expected one of {', '.join(MODEL_DTYPES)}, got {dtype!r}")
    with np.errstate(over="ignore"):
        return np.ascontiguousarray(values.astype(dtype)).view(BITS_DTYPES[dtype])


def from_bits(bits: np.ndarray, dtype: str) -> np.ndarray:
    """Exact values of bit patterns of ``dtype``: float32 for bfloat16, else ``dtype`` itself."""
    bits = np.asarray(bits).astype(BITS_DTYPES[dtype])
    if dtype == "bfloat16":
        return bf16_bits_to_f32(bits)
    return bits.view(dtype)


__all__ = ["FLOAT_FORMATS", "OUT_FORMATS", "OutFormat", "eps_of", "from_bits", "round_to", "round_to_format",
           "to_bits", "ulp_exponent"]
