"""gfloat (graphcore-research/gfloat): ``round_ndarray`` then ``encode_ndarray`` on float64,
with its rounding modes and ``sat`` flag, for the OCP formats it describes and the IEEE P3109
binary8p1..p7 formats (``format_info_p3109(8, p)``: signed, extended domain).

fp8ref's stochastic rule (round up iff floor(d * 2**N) + r >= 2**N) is gfloat's
``StochasticFastest`` (d + r * 2**-N >= 1); gfloat's ``Stochastic`` rounds d * 2**N to
nearest first and is a different rule. gfloat has no round-to-odd and no fnuz formats.
"""

from __future__ import annotations

import numpy as np

from ..backend import Backend
from ._common import INPUT_DTYPES, dist_version, missing

_FORMAT_INFO = {"float8_e4m3fn": "format_info_ocp_e4m3", "float8_e5m2": "format_info_ocp_e5m2",
                "float8_e8m0fnu": "format_info_ocp_e8m0", "float4_e2m1fn": "format_info_ocp_e2m1",
                "float6_e2m3fn": "format_info_ocp_e2m3", "float6_e3m2fn": "format_info_ocp_e3m2",
                **{f"binary8p{p}": ("format_info_p3109", 8, p) for p in range(1, 8)}}
_MODES = {"rne": "TiesToEven", "rna": "TiesToAway", "rtz": "TowardZero", "rup": "TowardPositive",
          "rdown": "TowardNegative", "stochastic": "StochasticFastest"}
_BITS = {"uint8": 8, "uint16": 16, "uint32": 32}


class GfloatBackend(Backend):
    name = "gfloat"
    capabilities = {
        "encode": {"format": tuple(_FORMAT_INFO), "rounding": tuple(_MODES), "saturate": (True, False),
                   "dtype": INPUT_DTYPES},
        "decode": {"format": tuple(_FORMAT_INFO)},
    }

    def unavailable(self) -> str | None:
        return missing("gfloat")

    def version(self) -> str:
        return dist_version("gfloat")

    @staticmethod
    def _fi(fmt: str):
        import gfloat.formats

        info = _FORMAT_INFO[fmt]
        if isinstance(info, tuple):  # a P3109 format, made by gfloat's own constructor
            return getattr(gfloat.formats, info[0])(*info[1:])
        return getattr(gfloat.formats, info)

    def encode(self, x, fmt, *, rounding, saturate, random_bits=None):
        import gfloat

        v = np.asarray(x).astype(np.float64)  # exact widening; gfloat computes in float64
        kwargs = {}
        if rounding == "stochastic":
            kwargs = {"srbits": random_bits.astype(np.int64), "srnumbits": _BITS[random_bits.dtype.name]}
        fi = self._fi(fmt)
        rounded = gfloat.round_ndarray(fi, v, getattr(gfloat.RoundMode, _MODES[rounding]), saturate, **kwargs)
        codes = gfloat.encode_ndarray(fi, rounded).astype(np.int64)
        bad = (codes < 0) | (codes >= 1 << fi.bits)
        if bad.any():  # would wrap silently in uint8: report it as the case's failure instead
            i = int(np.argmax(bad))
            raise ValueError(f"gfloat.encode_ndarray returned code {codes[i]} (outside 0..{(1 << fi.bits) - 1}) "
                             f"for x={v[i]!r} rounded to {rounded[i]!r}; {int(bad.sum())} such elements")
        return codes.astype(np.uint8)

    def decode(self, codes, fmt):
        import gfloat

        return gfloat.decode_ndarray(self._fi(fmt), np.asarray(codes).astype(np.int64)).astype(np.float32)
