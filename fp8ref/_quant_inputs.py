"""What quantize reads, shared by its element-scale path (``quant``), its block formats
(``microscaling``) and its C loops (``_native_quant``): x's exact values, a caller's scale or
amax as float64 of the layout's shape, and a recipe's refusal of NaN/Inf naming the first one.

``arr`` is what ``_arrays.float_input`` hands over: numpy, bfloat16 as uint16 bits.
"""

from __future__ import annotations

import numpy as np

from ._arrays import bf16_bits_to_f32, float_input, is_torch, numpy_bf16, to_numpy
from .errors import EncodeError, InputTypeError, ShapeError
from .recipes import BlockRecipe, Recipe
from .rounding import round_to


def widen(a: np.ndarray, dtype: str, cast16: str | None, buf: np.ndarray | None = None) -> np.ndarray:
    """Exact float32 values (float64 for float64) of a chunk; ``cast16`` rounds fp16 first.
    ``buf``: optional float32 buffer of a's shape for bfloat16/float16 input."""
    if dtype == "bfloat16":
        return bf16_bits_to_f32(a, buf)
    if dtype == "float16":
        w = a.astype(np.float32) if buf is None else np.copyto(buf, a) or buf
        return round_to(w, cast16) if cast16 else w
    return a


def reduction_values(a: np.ndarray, dtype: str) -> np.ndarray:
    """Float values for reductions: bfloat16 bits viewed as ml_dtypes.bfloat16."""
    return numpy_bf16(a) if dtype == "bfloat16" else a


def as_rows(arr: np.ndarray) -> np.ndarray:
    """x as (rows, last axis); a 0-d x as one row of one."""
    return arr.reshape(-1, arr.shape[-1]) if arr.ndim else arr.reshape(1, 1)


def scale_array(value, what: str, expected: tuple) -> tuple[np.ndarray, str]:
    """A user scale/amax as float64 numpy of the layout shape (also [], [N] for [N,1]), and
    its dtype name."""
    arr, dtype, _ = float_input(value, what) if (is_torch(value) or isinstance(value, np.ndarray)) else (
        _python_numbers(value, what), "float64", False)
    if dtype == "bfloat16":
        arr = widen(arr, dtype, None)
    arr = np.asarray(arr, np.float64)
    squeezed = tuple(n for n in arr.shape if n != 1)
    if arr.shape != expected and squeezed != tuple(n for n in expected if n != 1):
        raise ShapeError(f"{what}: expected shape {expected} (or the same without size-1 axes), "
                         f"got {tuple(arr.shape)}")
    return arr.reshape(expected), dtype


def _python_numbers(value, what: str) -> np.ndarray:
    """float64 array of a Python/numpy real number or a (nested) list of them; anything else (a
    string, a complex number, None) one InputTypeError."""
    try:
        arr = np.asarray(value)
    except ValueError:  # ragged nesting
        arr = np.asarray(None)
    if arr.dtype.kind not in "fiu":
        raise InputTypeError(f"{what}: expected a real number or an array of them, got {type(value).__name__}"
                             + (f" of {arr.dtype}" if arr.dtype.kind not in "OU" else ""))
    return arr.astype(np.float64)


def one_number(value, what: str) -> np.float64:
    """The one number of a scalar, a one-element array/tensor or list (NVFP4's global scale or amax)."""
    arr = (to_numpy(value, what) if is_torch(value) or isinstance(value, (np.ndarray, np.generic))
           else _python_numbers(value, what))
    if arr.dtype.kind not in "fiu" or arr.size != 1:
        raise InputTypeError(f"{what}: expected one real number (the tensor's), got "
                             f"{arr.dtype} of shape {tuple(arr.shape)}")
    return np.float64(arr.reshape(-1)[0])


def reject_nonfinite(amax: np.ndarray, arr: np.ndarray, dtype: str, rec: Recipe | BlockRecipe) -> None:
    """For a recipe that refuses NaN/Inf: an amax with one means x has one; the error names the first."""
    if rec.nonfinite != "error" or np.isfinite(amax).all():
        return
    bad = ~np.isfinite(widen(arr, dtype, None))
    idx = tuple(int(i) for i in np.argwhere(bad)[0])
    raise EncodeError(f"x: recipe {rec.name!r} needs finite values, got {int(bad.sum())} NaN/Inf "
                      f"(first at index {idx}); pass recipe= a producer recipe to model its NaN/Inf behaviour")
