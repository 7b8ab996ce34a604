"""numpy <-> torch for checkpoint tensors: numpy has no native bfloat16 (ml_dtypes supplies it and
``torch.from_numpy`` rejects it), so 16-bit floats cross as their bits, never through a cast."""

from __future__ import annotations

import numpy as np

_BITS = {"bfloat16": (np.uint16, "bfloat16"), "float16": (np.uint16, "float16")}


def to_torch(a: np.ndarray):
    """A torch tensor with the same dtype and bytes (float8 tensors stay uint8 codes)."""
    import torch

    a = np.ascontiguousarray(a)
    if a.dtype.name in _BITS:
        bits, name = _BITS[a.dtype.name]
        return torch.from_numpy(a.view(bits).copy()).view(getattr(torch, name))
    return torch.from_numpy(a.copy())


def to_numpy(t) -> np.ndarray:
    """A numpy array with the same dtype and bytes (bfloat16 as ml_dtypes.bfloat16)."""
    import torch

    t = t.detach().contiguous()
    if t.dtype == torch.bfloat16:
        import ml_dtypes

        return t.view(torch.uint16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def dtype_name(t) -> str:
    return str(t.dtype).removeprefix("torch.")
