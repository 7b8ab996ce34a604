"""Recipe ``compressed-tensors-gpu`` (compressed-tensors' Triton ``_quantize_kernel``) against a Fraction
oracle written from the kernel's source: s = D(fp32(amax)/448), a zero scale -> eps(D);
q = RN_fp32(x / s) + 0, clamped to +-448, then e4m3 RNE. The real kernel: tests/interop/test_ct_gpu_recipe.py.
"""

from __future__ import annotations

from fractions import Fraction

import ml_dtypes
import numpy as np
import pytest

from fp8ref import QuantArgs, quantize
from fp8ref.formats import FORMATS
from tests.support.quant_oracle import exact_code, fp32_nearest

E4M3 = FORMATS["float8_e4m3fn"]
D = {"bfloat16": (ml_dtypes.bfloat16, 2.0 ** -7), "float16": (np.float16, 2.0 ** -10)}


def _weights(dtype, seed=0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((6, 128)) * np.exp2(rng.integers(-10, 3, (6, 1)))).astype(np.float32)
    x[2, :] = 0.0                                      # an all-zero row: scale eps(D)
    x[2, 5] = -0.0
    x[3, :4] = [1e-6, -1e-6, 0.0, -0.0]                # quotients that round to +-0
    x[4, :] = rng.integers(-8, 9, 128) * 2.0 ** -6      # many e4m3 ties
    return x.astype(dtype)


def _oracle(x: np.ndarray, dtype: str, axis) -> tuple[np.ndarray, np.ndarray]:
    """(codes, scales) from exact rationals, each rounding of the kernel done once on its own."""
    ddt, eps = D[dtype]
    amax = np.abs(x.astype(np.float32)).max(axis=axis, keepdims=True)
    s = np.vectorize(lambda a: float(np.float32(fp32_nearest(Fraction(float(a)) / 448)).astype(ddt)))(amax)
    s = np.where(s == 0, eps, s)
    codes = np.empty(x.shape, np.uint8)
    for i in np.ndindex(x.shape):
        xv = float(x[i])
        q = fp32_nearest(Fraction(xv) / Fraction(float(np.broadcast_to(s, x.shape)[i]))) if xv else 0.0
        q = min(max(q, -448.0), 448.0)
        codes[i] = exact_code(Fraction(q), E4M3, negative_zero=False)  # q + 0 turns -0.0 into +0.0
    return codes, s.astype(ddt)


@pytest.mark.parametrize("dtype", list(D))
@pytest.mark.parametrize("granularity,axis", [("tensor", None), ("channel", 1)])
def test_gpu_recipe_matches_the_oracle(dtype, granularity, axis):
    x = _weights(D[dtype][0])
    q = quantize(x, QuantArgs(granularity=granularity), recipe="compressed-tensors-gpu")
    codes, s = _oracle(x, dtype, axis)
    assert np.array_equal(np.asarray(q.codes).view(np.uint8), codes)
    assert np.array_equal(np.asarray(q.scale).reshape(-1).view(np.uint16), s.reshape(-1).view(np.uint16))


def test_gpu_and_eager_recipes_differ_where_the_bf16_rounding_decides():
    """amax 5.5 gives s = bf16(5.5/448) = 0.01226806640625. x = 0.0130615234375: x/s = 1.06467... in fp32
    is above the e4m3 midpoint 1.0625 (GPU: 1.125); the eager path rounds it to bf16 1.0625 first, a tie
    that goes to even (1.0)."""
    x = np.array([0.0130615234375, 5.5], ml_dtypes.bfloat16)
    gpu = quantize(x, QuantArgs(granularity="tensor"), recipe="compressed-tensors-gpu")
    eager = quantize(x, QuantArgs(granularity="tensor"), recipe="compressed-tensors")
    for q in (gpu, eager):
        assert float(np.asarray(q.scale).reshape(-1)[0]) == 0.01226806640625
    value = lambda q: float(np.asarray(q.codes[:1]).view(ml_dtypes.float8_e4m3fn).astype(np.float32)[0])  # noqa: E731
    assert (value(gpu), value(eager)) == (1.125, 1.0)
