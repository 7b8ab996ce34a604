"""compressed-tensors' NVFP4 global divisor (``global.rule: reciprocal``) against a Fraction oracle for
every finite bf16 amax: torch's ``2688.0 / t`` is ``t.reciprocal() * 2688``, each op computed in float32
and rounded to bf16. The tool itself: tests/interop/test_ct_nvfp4_global.py."""

from __future__ import annotations

from fractions import Fraction

import ml_dtypes
import numpy as np

from fp8ref import QuantArgs, quantize
from fp8ref.quant import nvfp4_producer_global
from fp8ref.registry import get_recipe
from tests.support.quant_oracle import fp32_nearest

REC = get_recipe("compressed-tensors-nvfp4")
BF16 = ml_dtypes.bfloat16


def _bf16(v: float) -> float:
    return float(np.float32(v).astype(BF16))  # one RNE from a float32 value


FP32_OVERFLOW = Fraction(2) ** 128 - Fraction(2) ** 103  # RNE reaches inf from here


def _oracle(a: float) -> float:
    inv = _bf16(fp32_nearest(1 / Fraction(max(a, 2.0 ** -126))))
    prod = Fraction(inv) * 2688
    g = _bf16(fp32_nearest(prod)) if prod < FP32_OVERFLOW else float("inf")
    return g if np.isfinite(g) else 1.0  # nan_to_num(posinf=1)


def test_every_finite_bf16_amax():
    amax = np.arange(0, 0x7F80, dtype=np.uint16).view(BF16).astype(np.float32)
    bad = [(float(a), float(nvfp4_producer_global(float(a), REC, "bfloat16")), _oracle(float(a)))
           for a in amax if float(nvfp4_producer_global(float(a), REC, "bfloat16")) != _oracle(float(a))]
    assert bad == []


def test_the_amax_where_one_rounding_is_a_bf16_step_off():
    """2688 / 0.08447265625 = 31821.1...: once rounded to bf16 31872, the tool's two roundings 31744."""
    assert _bf16(fp32_nearest(Fraction(2688) / Fraction(0.08447265625))) == 31872.0
    x = np.full((1, 16), 0.01, np.float32)
    x[0, 3] = 0.08447265625
    q = quantize(x.astype(BF16), QuantArgs(format="float4_e2m1fn", granularity="nvfp4"),
                 recipe="compressed-tensors-nvfp4")
    assert float(np.asarray(q.global_scale).reshape(-1)[0]) == 31744.0


def test_nonfinite_amax():
    """nan_to_num(nan=1, posinf=1): a NaN amax gives 1, an infinite one 2688/inf = 0, kept."""
    assert nvfp4_producer_global(float("nan"), REC, "bfloat16") == 1.0
    assert nvfp4_producer_global(float("inf"), REC, "bfloat16") == 0.0
