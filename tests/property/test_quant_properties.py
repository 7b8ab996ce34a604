"""Properties of quantize over hypothesis-drawn tensors, checked with an exact-rational oracle."""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from fp8ref.codec import decode
from fp8ref.formats import FORMATS
from fp8ref.quant import QuantArgs, dequantize, expand, quantize
from tests.support.quant_oracle import oracle_codes

FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
FORMAT_NAMES = ["float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float6_e2m3fn",
                "float4_e2m1fn"]
finite32 = st.floats(width=32, allow_nan=False, allow_infinity=False)


def tensors():
    return st.tuples(st.integers(1, 6), st.integers(1, 40)).flatmap(lambda s: arrays(np.float32, s, elements=finite32))


def granularities():
    return st.sampled_from([QuantArgs(granularity="tensor"), QuantArgs(granularity="channel"),
                            QuantArgs(granularity="group", group_size=8), QuantArgs(granularity="token"),
                            QuantArgs(granularity="block", block_shape=(2, 16))])


@FAST
@given(tensors(), granularities(), st.sampled_from(FORMAT_NAMES),
       st.sampled_from(["rne", "rna", "rtz", "rup", "rdown", "rto"]))
def test_codes_are_the_exact_quotient_rounded_once(x, args, fmt, rounding):
    args = QuantArgs(**{**args.__dict__, "format": fmt, "rounding": rounding})
    q = quantize(x, args)
    s = expand(q.scale.astype(np.float64), x.shape, args.granularity, group_size=args.group_size,
               block_shape=args.block_shape)
    assert np.array_equal(q.codes, oracle_codes(x, s, FORMATS[fmt], rounding=rounding))


@FAST
@given(tensors(), granularities())
def test_scales_are_positive_and_nothing_overflows(x, args):
    q = quantize(x, args)
    assert np.all(q.scale > 0) and np.all(np.isfinite(q.scale))
    d = decode(q.codes, "float8_e4m3fn")
    assert np.all(np.isfinite(d))                    # amax/448 never lets a code overflow
    s = expand(q.scale.astype(np.float64), x.shape, args.granularity, group_size=args.group_size,
               block_shape=args.block_shape)
    dq = np.abs(dequantize(q, dtype="float64"))
    # With s = fp32(amax/448) nothing rounds above amax. The fp8ref recipe floors s at 2**-126 (a
    # subnormal scale would lose bits); there amax/s < 448, so x/s rounds to nearest and may land
    # above amax (1.43e-39 / 2**-126 = 0.1216 -> 0.125), but never above 448 * s.
    s = np.broadcast_to(s, x.shape)
    floored = s == 2.0 ** -126
    assert np.all(dq[~floored] <= float(np.abs(x).max()) * (1 + 2 ** -20) + 1e-300)  # float64: no overflow
    assert np.all(dq[floored] <= 448 * s[floored])


@FAST
@given(tensors(), granularities())
def test_negation_flips_only_the_sign_bit(x, args):
    a, b = quantize(x, args), quantize(-x, args)
    assert np.array_equal(a.scale, b.scale)
    assert np.array_equal(a.codes ^ np.uint8(0x80), b.codes)


@FAST
@given(tensors(), granularities(), st.sampled_from(["compressed-tensors", "auto-round", "fbgemm", "vllm-dynamic"]))
def test_producer_recipes_stay_within_one_step_of_fp8ref(x, args, recipe):
    """A producer's extra roundings can move a code by at most one grid step from the ideal when
    both use the same scale; codes from different scales are not compared."""
    from fp8ref.registry import get_recipe
    rec = get_recipe(recipe)
    if args.granularity not in rec.granularities:
        return
    p = quantize(x, args, recipe=recipe)
    scale = np.asarray(p.scale, np.float32)
    ideal = quantize(x, QuantArgs(**{**p.args.__dict__, "dynamic": False}), scale=scale)
    mag = lambda c: (c & 0x7F).astype(int) * np.where(c & 0x80, -1, 1)  # noqa: E731
    assert np.all(np.abs(mag(p.codes) - mag(ideal.codes)) <= 1)
