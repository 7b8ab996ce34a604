"""The scales a checkpoint stores beside the codes ``quantize()`` returns (which brings the weight
scales): a static input scale, an NVFP4 input global or a KV-cache scale, each from one amax by
the recipe, and their stored form. Export and conversion both compute them here."""

from __future__ import annotations

import numpy as np

from ..errors import CheckpointError
from ..formats import FORMATS
from ..quant import nvfp4_producer_global
from ..recipes import compute_scale
from .layout import LayerQuant

# scale dtype name -> safetensors dtype of the stored scale
STORE_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16", "float8_e8m0fnu": "F8_E8M0"}


def amax_scale(amax: float, rec, fmt: str, dtype: str, scale_dtype: str = "model") -> np.ndarray:
    """The recipe's stored scale (float32, shape [1]) for elements of ``fmt`` of a ``dtype`` model
    whose amax is ``amax``: a static input scale, or a KV-cache scale with fmt float8_e4m3fn."""
    stored, _ = compute_scale(np.array([amax]), rec, FORMATS[fmt], dtype, scale_dtype=scale_dtype)
    return np.asarray(stored, np.float32)


def input_scale(amax: float, rec, quant: LayerQuant, dtype: str, scale_dtype: str = "model") -> np.ndarray:
    """A layer's input scale from its activation amax (float32, shape [1]): the NVFP4 input global of
    the producer (``nvfp4_producer_global``) for nvfp4 layers, else ``amax_scale`` on the weight format."""
    if quant.weight_strategy == "nvfp4":
        return np.asarray(nvfp4_producer_global(amax, rec, dtype), np.float32).reshape(1)
    return amax_scale(amax, rec, quant.weight_fmt, dtype, scale_dtype)


def checked_scale(where: str, recipe: str, name: str, scale: np.ndarray) -> np.ndarray:
    """A recipe can produce a scale no loader accepts: hf-fp8's 448/amax multiplier overflows fp32
    for a subnormal amax, so weight_scale_inv = 1/inf = 0. Refuse before anything is written."""
    values = np.asarray(scale, np.float32)
    bad = ~(np.isfinite(values) & (values > 0))
    if bad.any():
        first = float(values.reshape(-1)[np.argmax(bad.reshape(-1))])
        raise CheckpointError(f"{where}: recipe {recipe!r} gives {name} = "
                              f"{first!r} for {int(bad.sum())} of {values.size} element(s); a dequantization "
                              "scale must be > 0 and finite (tiny or zero amax: pick another recipe)")
    return scale


def as_stored(values32: np.ndarray, dtype: str) -> np.ndarray:
    """float32 values that are exact in ``dtype`` -> an array of that dtype, bit-exact (F8_E8M0: the
    biased exponent bytes 127 + log2 v of powers of two)."""
    import ml_dtypes

    if dtype == "F32":
        return values32
    if dtype == "F8_E8M0":
        _, e = np.frexp(np.asarray(values32, np.float64))
        return (e.astype(np.int64) - 1 + 127).astype(np.uint8)
    if dtype == "F16":
        return values32.astype(np.float16)
    bits = (np.ascontiguousarray(values32).view(np.uint32) >> np.uint32(16)).astype(np.uint16)
    return bits.view(ml_dtypes.bfloat16)
