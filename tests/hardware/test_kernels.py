"""Kernel models: the K loop composed of instruction calls, promotion, split-K, the FP32 fma, and
the strict declared form."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest

from fp8ref.errors import SpecError
from fp8ref.hardware import KERNELS, Kernel, kernel_mm, mma
from fp8ref.hardware.kernels import fma32


def _codes(rng, shape, hi=0x7E):
    c = rng.integers(0, hi, shape).astype(np.uint8)
    return c | (rng.integers(0, 2, shape).astype(np.uint8) << 7)


def _chain(op, arch, s, A, B, m, n, k, c0=None):
    """The instruction issued over K tile by tile through the public mma(), C chained."""
    M, K = A.shape
    N = B.shape[1]
    D = np.zeros((M, N), np.float32) if c0 is None else c0.copy()
    for i in range(0, M, m):
        for j in range(0, N, n):
            for k0 in range(0, K, k):
                D[i:i + m, j:j + n] = mma(op, arch, s, A[i:i + m, k0:k0 + k], B[k0:k0 + k, j:j + n],
                                          D[i:i + m, j:j + n])
    return D


def test_fast_accum_is_the_instruction_chained_over_k():
    rng = np.random.default_rng(3)
    A, B = _codes(rng, (64, 256)), _codes(rng, (256, 16))
    want = _chain("wgmma", "hopper", "m64n8k32.f32.e4m3.e4m3", A, B, 64, 8, 32)
    got = kernel_mm(A, B, kernel="hopper-fast-accum")
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


def test_promoted_adds_each_128_block_in_fp32():
    rng = np.random.default_rng(4)
    A, B = _codes(rng, (64, 512)), _codes(rng, (512, 8))
    acc = np.zeros((64, 8), np.float32)
    for k0 in range(0, 512, 128):
        acc = acc + _chain("wgmma", "hopper", "m64n8k32.f32.e4m3.e4m3", A[:, k0:k0 + 128], B[k0:k0 + 128], 64, 8, 32)
    got = kernel_mm(A, B, kernel="hopper-promoted")
    assert np.array_equal(got.view(np.uint32), acc.view(np.uint32))
    assert not np.array_equal(got, kernel_mm(A, B, kernel="hopper-fast-accum"))


def test_deepgemm_block_scales_fma_at_each_promotion():
    rng = np.random.default_rng(5)
    M, K, N = 64, 256, 128
    A, B = _codes(rng, (M, K)), _codes(rng, (K, N))
    sa = rng.uniform(0.01, 2, (M, 2)).astype(np.float32)
    sb = rng.uniform(0.01, 2, (2, 1)).astype(np.float32)
    acc = np.zeros((M, N), np.float32)
    for blk in range(2):
        d = _chain("wgmma", "hopper", "m64n8k32.f32.e4m3.e4m3", A[:, blk * 128:(blk + 1) * 128],
                   B[blk * 128:(blk + 1) * 128], 64, 8, 32)
        s = (sa[:, blk:blk + 1] * sb[blk, 0]).astype(np.float32)
        acc = fma32(d, np.broadcast_to(s, d.shape), acc)
    got = kernel_mm(A, B, sa, sb, kernel="deepgemm-1x128-128x128")
    assert np.array_equal(got.view(np.uint32), acc.view(np.uint32))


def test_split_k_adds_the_parts_in_order():
    rng = np.random.default_rng(6)
    A, B = _codes(rng, (64, 256)), _codes(rng, (256, 8))
    k = Kernel("split", ("wgmma", "hopper", "m64n8k32.f32.e4m3.e4m3"), split_k=2)
    parts = [kernel_mm(A[:, i:i + 128], B[i:i + 128], kernel="hopper-fast-accum") for i in (0, 128)]
    assert np.array_equal(kernel_mm(A, B, kernel=k).view(np.uint32), (parts[0] + parts[1]).view(np.uint32))


def test_instruction_scaled_kernel_and_epilogue():
    rng = np.random.default_rng(8)
    M, K, N = 128, 64, 8
    A, B = _codes(rng, (M, K)), _codes(rng, (K, N))
    SA = rng.integers(120, 134, (M, 2)).astype(np.uint8)
    SB = rng.integers(120, 134, (2, N)).astype(np.uint8)
    s = "m128n8k32.kind::mxf8f6f4.block32.f32.e4m3.e4m3.ue8m0"
    want = np.zeros((M, N), np.float32)
    for k0 in (0, 32):
        want = mma("tcgen05.mma", "blackwell", s, A[:, k0:k0 + 32], B[k0:k0 + 32], want,
                   scale_a=SA[:, k0 // 32:k0 // 32 + 1], scale_b=SB[k0 // 32:k0 // 32 + 1])
    alpha = np.float32(0.3)
    got = kernel_mm(A, B, SA, SB, kernel="blackwell-mxfp8", alpha=alpha)
    assert np.array_equal(got.view(np.uint32), (want * alpha).astype(np.float32).view(np.uint32))


def _fma_oracle(x, y, z) -> np.float32:
    """fp32 RNE of the exact x*y + z (Fraction), with overflow to Inf."""
    v = Fraction(float(x)) * Fraction(float(y)) + Fraction(float(z))
    if v == 0:
        return np.float32(0.0)
    a = abs(v)
    e = max(a.numerator.bit_length() - a.denominator.bit_length(), -126)
    while Fraction(2) ** e > a and e > -126:
        e -= 1
    ulp = Fraction(2) ** (e - 23)
    r = round(a / ulp) * ulp
    out = math.inf if r >= 2 ** 128 else float(r)
    return np.float32(math.copysign(out, v))


def test_fma32_is_correctly_rounded():
    rng = np.random.default_rng(9)
    x = (rng.standard_normal(3000) * 2.0 ** rng.integers(-30, 30, 3000)).astype(np.float32)
    y = (rng.standard_normal(3000) * 2.0 ** rng.integers(-30, 30, 3000)).astype(np.float32)
    z = (-(x.astype(np.float64) * y) * (1 + rng.choice([0, 2.0 ** -24, 2.0 ** -23, 3e-8], 3000))).astype(np.float32)
    # hard cases: x*y + z where the double sum sits exactly on a float32 midpoint
    x[:4] = np.float32(1 + 2.0 ** -12)
    y[:4] = np.float32(1 + 2.0 ** -12)
    z[:4] = np.float32(-1.0)
    got = fma32(x, y, z)
    want = np.array([_fma_oracle(a, b, c) for a, b, c in zip(x, y, z)], np.float32)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


def test_kernel_declared_as_a_dict_round_trips_and_is_strict():
    d = KERNELS["deepgemm-1x128-128x128"].to_dict()
    assert Kernel.from_dict(d) == KERNELS["deepgemm-1x128-128x128"]
    with pytest.raises(SpecError, match="unknown key 'promote_evry'"):
        Kernel.from_dict({"name": "x", "instruction": ["wgmma", "hopper", "m64n8k32.f32.e4m3.e4m3"],
                          "promote_evry": 128})
    with pytest.raises(SpecError, match="promote_every: expected null or a multiple"):
        Kernel("x", ("wgmma", "hopper", "m64n8k32.f32.e4m3.e4m3"), promote_every=100)
    with pytest.raises(SpecError, match="instruction:"):
        Kernel("x", ("wgmma", "hopper", "m64n8k16.f32.e4m3.e4m3"))


def test_scaled_mm_runs_the_registered_kernel_models():
    from fp8ref import scaled_mm
    from fp8ref.errors import InputTypeError

    rng = np.random.default_rng(10)
    A, B = _codes(rng, (64, 256)), _codes(rng, (256, 16))
    sa = rng.uniform(0.1, 1, (64, 1)).astype(np.float32)
    sb = rng.uniform(0.1, 1, (1, 16)).astype(np.float32)
    for name in ("hopper-fast-accum", "hopper-promoted", "blackwell-fp8"):
        want = kernel_mm(A, B, sa, sb, kernel=name)
        assert np.array_equal(scaled_mm(A, B, sa, sb, accumulate=name).view(np.uint32), want.view(np.uint32))
    ga = rng.uniform(0.1, 1, (64, 2)).astype(np.float32)
    gb = rng.uniform(0.1, 1, (2, 1)).astype(np.float32)
    want = kernel_mm(A, B, ga, gb, kernel="deepgemm-1x128-128x128")
    got = scaled_mm(A, B, ga, gb, accumulate="deepgemm-1x128-128x128")
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    with pytest.raises(InputTypeError, match="kernel_mm"):
        scaled_mm(A, B, sa, sb, accumulate="blackwell-mxfp8")


@pytest.mark.parametrize("name", list(KERNELS))
def test_an_empty_k_loop_leaves_the_epilogue_of_zero(name):
    """K = 0: no instruction runs, the accumulator stays +0, the output is the epilogue's (bias
    rounded to the output dtype), the same as scaled_mm's exact sum of nothing."""
    from fp8ref import scaled_mm

    k = KERNELS[name]
    M, N = 3, 5
    bias = np.array([1.5, -2.0, 0.0, -0.0, 3e38], np.float32)
    A, B = np.zeros((M, 0), np.uint8), np.zeros((0, N), np.uint8)
    sa = sb = None
    if k.scales == "instruction":
        sa, sb = np.zeros((M, 0), np.uint8), np.zeros((0, N), np.uint8)
    elif k.scales == "promotion":
        sa, sb = np.zeros((M, 0), np.float32), np.zeros((0, 1), np.float32)
    got = kernel_mm(A, B, sa, sb, kernel=name, bias=bias)
    assert np.array_equal(got.view(np.uint32), np.broadcast_to(bias + np.float32(0), (M, N)).view(np.uint32))
    if k.scales == "epilogue" and k.ins.a_fmt.name == "float8_e4m3fn":
        one = np.float32(1)
        want = scaled_mm(A, B, one, one, bias=bias, accumulate="exact")
        assert np.array_equal(scaled_mm(A, B, one, one, bias=bias, accumulate=name).view(np.uint32),
                              np.asarray(want).view(np.uint32))
