"""torch: native casts to the float8 dtypes (``Tensor.to``) and their decode, and
``torch._scaled_mm`` on CPU.

encode saturate=False is the plain cast. saturate=True is ``clamp(-max, max)`` then the
cast: the recipe torch users are told to follow. Only round-to-nearest-even exists.
"""

from __future__ import annotations

import numpy as np

from ..backend import Backend
from ._common import INPUT_DTYPES, clamp_to_max, dist_version, missing

_FORMATS = ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu")


class TorchBackend(Backend):
    name = "torch"
    capabilities = {
        "encode": {"format": _FORMATS, "rounding": ("rne",), "saturate": (True, False), "dtype": INPUT_DTYPES},
        "decode": {"format": _FORMATS},
    }

    def unavailable(self) -> str | None:
        return missing("torch")

    def version(self) -> str:
        return dist_version("torch")

    @staticmethod
    def _tensor(x: np.ndarray):
        import torch

        if x.dtype.name == "bfloat16":  # numpy has no bfloat16: carry the bits
            return torch.from_numpy(x.view(np.uint16).copy()).view(torch.bfloat16)
        return torch.from_numpy(np.ascontiguousarray(x))

    def encode(self, x, fmt, *, rounding, saturate, random_bits=None):
        import torch

        t = self._tensor(clamp_to_max(x, fmt) if saturate else x)
        return t.to(getattr(torch, fmt)).view(torch.uint8).numpy()

    def decode(self, codes, fmt):
        import torch

        t = torch.from_numpy(np.ascontiguousarray(codes)).view(getattr(torch, fmt))
        return t.to(torch.float32).numpy()
