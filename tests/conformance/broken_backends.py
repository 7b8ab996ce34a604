"""Deliberately broken codecs for the meta-test: each wraps fp8ref's own (correct) encode
and breaks one rule, so any mismatch the harness reports is that rule's fault."""

import numpy as np

from fp8ref import codec
from fp8ref.conformance import Backend

CAPS = {"encode": {"format": ("float8_e4m3fn",), "rounding": ("rne",), "saturate": (True, False),
                   "dtype": ("float32",)}}


class _Broken(Backend):
    capabilities = CAPS

    def encode(self, x, fmt, *, rounding, saturate, random_bits=None):
        return self.breaks(x, codec.encode(x, fmt, rounding=rounding, saturate=saturate))


class RoundHalfUp(_Broken):
    """Ties go toward +inf instead of to even."""

    name = "round-half-up"

    def breaks(self, x, codes):
        x64 = x.astype(np.float64)
        lo = codec.decode(codec.encode(x, "float8_e4m3fn", rounding="rdown"), "float8_e4m3fn").astype(np.float64)
        hi_codes = codec.encode(x, "float8_e4m3fn", rounding="rup")
        hi = codec.decode(hi_codes, "float8_e4m3fn").astype(np.float64)
        tie = np.isfinite(x64) & (lo != x64) & (2 * x64 == lo + hi)
        return np.where(tie, hi_codes, codes)


class OffByOneExponent(_Broken):
    """Normal results come out with their exponent field one too large."""

    name = "off-by-one-exponent"

    def breaks(self, x, codes):
        field = (codes & 0x7F) >> 3
        normal = (field >= 1) & (field < 14)
        return np.where(normal, codes + 8, codes).astype(np.uint8)


class FlushSubnormals(_Broken):
    """Subnormal results are flushed to a zero of the same sign."""

    name = "flush-subnormals"

    def breaks(self, x, codes):
        sub = ((codes & 0x78) == 0) & ((codes & 0x07) != 0)
        return np.where(sub, codes & 0x80, codes).astype(np.uint8)


class Raises(_Broken):
    """Fails on any input containing a negative zero."""

    name = "raises"

    def breaks(self, x, codes):
        if np.any((x == 0) & np.signbit(x)):
            raise RuntimeError("kernel launch failed")
        return codes


class Nothing(Backend):
    name = "nothing"
    capabilities = {}


instance = RoundHalfUp()  # for the 'module:object' form
