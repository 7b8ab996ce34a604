"""The fast paths of fp8ref.matmul against independent ones.

fp32: the C loop of fp8ref/_csrc/matmul.c against the numpy loop (sequential over k, written
separately in matmul.fp32._seq_sum) on shapes that cut every tile, panel, k-chunk and K-block, with
NaN/Inf/-0 operands. exact: the one-matmul path for K-blocked scales (matmul.exact._blocked) and its exact
repair against the per-block path and a Fraction oracle.
"""

from __future__ import annotations

import numpy as np
import pytest

import fp8ref.matmul.exact as mm
from fp8ref import FORMATS, encode
from fp8ref._native import kernels_available
from fp8ref.matmul import OUT_FORMATS, scaled_mm
from fp8ref.matmul.operands import _canonical_scales
from tests.support.matmul_oracle import fraction_oracle, rounded, same

E4M3, E5M2 = FORMATS["float8_e4m3fn"], FORMATS["float8_e5m2"]
f32 = np.float32
needs_c = pytest.mark.skipif(not kernels_available(), reason="C loops not built or FP8REF_NO_KERNELS set")


def codes(rng, shape, fmt=E4M3, specials=True):
    c = encode(rng.standard_normal(shape).astype(f32) * 40, fmt)
    if specials and c.size > 8:
        flat = c.reshape(-1)
        idx = rng.choice(flat.size, 6, replace=False)
        flat[idx[:2]] = 0x80  # -0
        flat[idx[2]] = encode(np.array([np.nan], f32), fmt)[0]
        if fmt is E5M2:
            flat[idx[3]], flat[idx[4]] = 0x7C, 0xFC  # +-Inf
    return c


def numpy_path(*args, **kw):
    with pytest.MonkeyPatch.context() as m:
        m.setenv("FP8REF_NO_KERNELS", "1")  # read at call time
        return scaled_mm(*args, **kw)


def bits_equal(x, y):
    """Identical float32 results, NaN payloads aside."""
    x, y = np.asarray(x), np.asarray(y)
    return x.shape == y.shape and bool(np.all((x.view(np.uint32) == y.view(np.uint32))
                                              | (np.isnan(x) & np.isnan(y))))


# M, K, N: below / across the 8-row tile, the 32-column panel, the 256 k-chunk and 128 K-blocks
SHAPES = [(1, 1, 1), (7, 5, 33), (9, 129, 31), (17, 300, 65), (8, 513, 32), (3, 257, 97)]


@needs_c
@pytest.mark.parametrize("M,K,N", SHAPES)
@pytest.mark.parametrize("layout", ["tensor", "rows", "blocks"])
@pytest.mark.parametrize("order", ["epilogue", "operands"])
def test_c_loop_matches_numpy_loop(M, K, N, layout, order):
    rng = np.random.default_rng(M * 1000 + K + N)
    fa, fb = (E5M2, E4M3) if K % 2 else (E4M3, E5M2)
    a, b = codes(rng, (M, K), fa), codes(rng, (K, N), fb)
    kb, nb = -(-K // 128), -(-N // 128)
    sa, sb = {"tensor": (f32(0.37), f32(1.9)),
              "rows": (rng.uniform(0.01, 3, (M, 1)).astype(f32), rng.uniform(0.01, 3, (1, N)).astype(f32)),
              "blocks": (rng.uniform(0.01, 3, (M, kb)).astype(f32), rng.uniform(0.01, 3, (kb, nb)).astype(f32))}[layout]
    kw = dict(accumulate="fp32", scale_order=order, fmt_a=fa, fmt_b=fb,
              bias=rng.standard_normal(N).astype(f32))
    got = scaled_mm(a, b, sa, sb, **kw)
    assert bits_equal(got, numpy_path(a, b, sa, sb, **kw))
    if layout == "tensor":  # accumulation blocks shorter than K with one scale
        kw["block_k"] = 100
        assert bits_equal(scaled_mm(a, b, sa, sb, **kw), numpy_path(a, b, sa, sb, **kw))


@needs_c
def test_c_loop_signed_zero_and_inf_minus_inf():
    # +0 start: (-0) + (-0) products stay +0; Inf and -Inf products give NaN; Inf * 0 gives NaN
    inf, minus_inf, one, minus_one, zero = 0x7C, 0xFC, 0x3C, 0xBC, 0x00  # e5m2 codes
    a = np.array([[minus_one, minus_one], [inf, one], [inf, zero]], np.uint8)
    b = np.array([[zero, one], [zero, zero]], np.uint8)
    b2 = np.array([[one, one], [minus_inf, zero]], np.uint8)
    for x, y in ((a, b), (a, b2)):
        got = scaled_mm(x, y, f32(1), f32(1), accumulate="fp32", fmt_a=E5M2, fmt_b=E5M2)
        assert bits_equal(got, numpy_path(x, y, f32(1), f32(1), accumulate="fp32", fmt_a=E5M2, fmt_b=E5M2))
    got = scaled_mm(a, b, f32(1), f32(1), accumulate="fp32", fmt_a=E5M2, fmt_b=E5M2)
    assert not np.signbit(got[0, 0]) and got[0, 0] == 0
    assert np.isnan(got[1, 0]) and np.isnan(got[2, 0])  # Inf * 0
    got = scaled_mm(a, b2, f32(1), f32(1), accumulate="fp32", fmt_a=E5M2, fmt_b=E5M2)
    assert np.isnan(got[1, 0]) and got[1, 1] == np.inf  # Inf - Inf; Inf + finite


@pytest.mark.parametrize("seed", range(4))
def test_blocked_exact_path_matches_per_block_path(seed):
    rng = np.random.default_rng(seed)
    M, K, N = 13, 300, 70
    a, b = codes(rng, (M, K), specials=False), codes(rng, (K, N), specials=False)
    sa = rng.uniform(0.01, 3, (M, 3)).astype(f32)
    sb = rng.uniform(0.01, 3, (3, 1)).astype(f32)
    full_a, full_b, bk = _canonical_scales(sa.astype(np.float64), sb.astype(np.float64), M, K, N, 128, 128)
    pa = [(mm.decode(a, E4M3).astype(np.float64), 0)]
    pb = [(mm.decode(b, E4M3).astype(np.float64), 0)]
    out = OUT_FORMATS["bfloat16"]
    fast = mm._blocked(pa, pb, full_a, full_b, bk, None, out, max_unsure=1.0)
    slow = mm._per_block(pa, pb, full_a, full_b, bk, None, out)
    assert same(fast, slow)


def test_blocked_repair_against_fraction_oracle():
    # every element through the exact repair, including a bias that cancels the block sums
    rng = np.random.default_rng(7)
    M, K, N = 4, 20, 5
    a, b = codes(rng, (M, K), specials=False), codes(rng, (K, N), specials=False)
    sa = rng.uniform(0.1, 4, (M, 3)).astype(f32)
    sb = rng.uniform(0.1, 4, (3, 2)).astype(f32)
    ref = fraction_oracle(a, b, sa, sb, block_k=8, block_n=4)
    bias = np.array([-float(np.float32(float(ref[0, n]))) for n in range(N)], f32)  # near-cancellation
    full_a, full_b, bk = _canonical_scales(sa.astype(np.float64), sb.astype(np.float64), M, K, N, 8, 4)
    pa = [(mm.decode(a, E4M3).astype(np.float64), 0)]
    pb = [(mm.decode(b, E4M3).astype(np.float64), 0)]
    idx = np.nonzero(np.ones((M, N), bool))
    got = mm._repair_rows(pa, pb, full_a, full_b, bk, bias.astype(np.float64), idx, OUT_FORMATS["float32"])
    want = rounded(fraction_oracle(a, b, sa, sb, bias=bias, block_k=8, block_n=4))
    assert same(got.reshape(M, N), want)
    assert same(scaled_mm(a, b, sa, sb, bias=bias, block_k=8, block_n=4), want)
