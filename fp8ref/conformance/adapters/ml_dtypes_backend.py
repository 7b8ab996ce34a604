"""ml_dtypes: numpy ``astype`` to its small float dtypes, and back to float32.

ml_dtypes' casts are round-to-nearest-even and never saturate (saturation is a C++
template flag only); saturate=True is therefore ``np.clip(-max, max)`` then the cast.
"""

from __future__ import annotations

import numpy as np

from ..backend import Backend
from ._common import INPUT_DTYPES, clamp_to_max, dist_version, missing

_FORMATS = ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e4m3b11fnuz",
            "float8_e8m0fnu", "float4_e2m1fn", "float6_e2m3fn", "float6_e3m2fn")


class MlDtypesBackend(Backend):
    name = "ml_dtypes"
    capabilities = {
        "encode": {"format": _FORMATS, "rounding": ("rne",), "saturate": (True, False), "dtype": INPUT_DTYPES},
        "decode": {"format": _FORMATS},
    }

    def unavailable(self) -> str | None:
        return missing("ml_dtypes")

    def version(self) -> str:
        return dist_version("ml_dtypes")

    def encode(self, x, fmt, *, rounding, saturate, random_bits=None):
        import ml_dtypes

        x = clamp_to_max(x, fmt) if saturate else x
        return np.asarray(x).astype(getattr(ml_dtypes, fmt)).view(np.uint8)

    def decode(self, codes, fmt):
        import ml_dtypes

        return np.asarray(codes).view(getattr(ml_dtypes, fmt)).astype(np.float32)
