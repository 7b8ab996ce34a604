"""The reference attention's per-head scales and its KV-cache variants (fp8ref.attention,
``kv_cache``): against a scalar oracle written here one element at a time (numpy float32 scalars for
the float32 steps, the Fraction codec oracle of tests/support for every E4M3 / E2M1 code, Python
floats in the declared float64 order, a Fraction bmm2 where the sum is exact), over every
combination of small shapes, masks and model dtypes; and the variants differing from each other
where they must (the tests can fail)."""

from __future__ import annotations

import itertools
import math
from fractions import Fraction

import numpy as np
import pytest

from fp8ref import attention as ref
from fp8ref.errors import InputTypeError
from fp8ref.formats import get_format
from tests.support import oracle
from tests.support.matmul_oracle import round_fraction

E4M3, E2M1 = get_format("float8_e4m3fn"), get_format("float4_e2m1fn")
F32 = np.float32
SHAPES = [(1, 2, 1, 3, 4, 16), (1, 4, 2, 2, 5, 16), (2, 2, 2, 4, 4, 32)]  # B, H, Hkv, Tq, Tk, d
DTYPES = ("bfloat16", "float16", "float32")


def _inputs(shape, seed):
    B, H, Hkv, Tq, Tk, d = shape
    g = np.random.default_rng(seed)

    def t(*s, spread=1.0):
        x = g.standard_normal(s) * np.exp(spread * g.standard_normal(s))
        return x.astype(np.float32)

    k, v = t(B, Hkv, Tk, d, spread=1.5), t(B, Hkv, Tk, d, spread=1.5)
    k[0, 0, 0, 3] = -0.0
    v[..., 0, :16] *= 1e-3  # a small block (NVFP4 block scale far below the others)
    return t(B, H, Tq, d, spread=0.3), k, v


def _code_value(code: int, fmt) -> float:
    return float(oracle.decode(int(code), fmt))


def _e4m3(x: F32) -> int:
    return oracle.encode(Fraction(float(x)), E4M3)


def _exp(x: float) -> float:
    """docs/models.md's exp64 one Python float operation at a time."""
    if x == -math.inf:
        return 0.0
    x = max(x, -800.0)
    k = float(round(x * 1.44269504088896338700e+00))
    r = (x - k * 6.93147180369123816490e-01) - k * 1.90821492927058770002e-10
    p = 1.0 / math.factorial(13)
    for n in range(12, -1, -1):
        p = p * r + 1.0 / math.factorial(n)
    return math.ldexp(p, int(k))


# --- the oracle's cache writers: one element at a time --------------------------------------

def _fp8_static(row, s):
    return [_code_value(oracle.encode(Fraction(float(F32(F32(x) / F32(s)))), E4M3), E4M3) for x in row], float(F32(s))


def _fp8_token_head(row):
    amax = max(abs(F32(x)) for x in row)
    s = max(F32(amax / F32(448.0)), F32(1e-6))
    inv = F32(F32(1.0) / s)
    vals = []
    for x in row:
        y = min(max(F32(F32(x) * inv), F32(-448.0)), F32(448.0))
        vals.append(_code_value(oracle.encode(Fraction(float(y)), E4M3), E4M3))
    return vals, float(s)


def _nvfp4(row, g, multiplier=False):
    g = F32(g)
    out = []
    for b in range(0, len(row), 16):
        blk = [F32(x) for x in row[b:b + 16]]
        vmax = max(abs(x) for x in blk)
        if multiplier:  # FlashInfer nvfp4_kv_quantize: g multiplies on the way back
            sf = F32(F32(F32(1.0) / g) * F32(vmax * F32(1.0 / 6.0)))
            s8 = _code_value(_e4m3(sf), E4M3)
            r = F32(0.0) if s8 == 0 else F32(F32(1.0) / F32(F32(s8) * g))
        else:
            sf = F32(g * F32(vmax * F32(1.0 / 6.0)))
            s8 = _code_value(_e4m3(sf), E4M3)
            r = F32(0.0) if s8 == 0 else F32(F32(1.0) / F32(F32(s8) * F32(F32(1.0) / g)))
        out += [_code_value(oracle.encode(Fraction(float(F32(x * r))), E2M1), E2M1) * s8 for x in blk]
    return out, float(g) if multiplier else 1.0 / float(g)


def _oracle(q, k, v, kv_cache, ks, vs, qs, causal, dtype):
    B, H, Tq, d = q.shape
    Hkv, Tk = k.shape[1], k.shape[2]
    out = np.zeros(q.shape)
    for b, h in itertools.product(range(B), range(H)):
        gh = h // (H // Hkv)

        def cache(x, s, j, b=b, gh=gh):
            row = x[b, gh, j]
            if kv_cache == "fp8":
                return _fp8_static(row, s[gh])
            if kv_cache == "fp8_per_token_head":
                return _fp8_token_head(row)
            return _nvfp4(row, s[gh], multiplier=kv_cache == "nvfp4_mult")

        kc = [cache(k, ks, j) for j in range(Tk)]
        vc = [cache(v, vs, j) for j in range(Tk)]
        if qs is None:
            qrows, qm = [[float(x) for x in q[b, h, i]] for i in range(Tq)], 1.0
        else:
            qrows = [_fp8_static(q[b, h, i], qs[h])[0] for i in range(Tq)]
            qm = float(F32(qs[h]))
        sm = 1.0 / math.sqrt(d)
        for i in range(Tq):
            s = []
            for j in range(Tk):
                a = qrows[i][0] * kc[j][0][0]
                for t in range(1, d):
                    a = a + qrows[i][t] * kc[j][0][t]
                s.append(a * ((qm * kc[j][1]) * sm) if not causal or j <= i + Tk - Tq else -math.inf)
            m = max(s)
            e = [_exp(x - m) for x in s]
            z = e[0]
            for x in e[1:]:
                z = z + x
            p = [x / z for x in e]
            for t in range(d):
                if kv_cache == "fp8_per_token_head":
                    o = (p[0] * vc[0][1]) * vc[0][0][t]
                    for j in range(1, Tk):
                        o = o + (p[j] * vc[j][1]) * vc[j][0][t]
                else:
                    o = p[0] * vc[0][0][t]
                    for j in range(1, Tk):
                        o = o + p[j] * vc[j][0][t]
                    o = o * vc[0][1]
                out[b, h, i, t] = round_fraction(Fraction(o), dtype)
    return out


def _scales(shape, kv_cache, k, v, q):
    B, H, Hkv = shape[:3]
    if kv_cache == "fp8_per_token_head":
        return None, None
    if kv_cache == "nvfp4":  # FlashInfer's global: 448 / amax, here per KV head
        return ([F32(448.0 / np.abs(x[:, h]).max()) for h in range(Hkv)] for x in (k, v))
    if kv_cache == "nvfp4_mult":  # a decode multiplier: amax / 448
        return ([F32(np.abs(x[:, h]).max() / 448.0) for h in range(Hkv)] for x in (k, v))
    return ([F32(np.abs(x[:, h]).max() / 448.0 * (1.5 if h % 2 else 0.75)) for h in range(Hkv)] for x in (k, v))


@pytest.mark.parametrize("kv_cache", ref.KV_CACHES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("quantize_q", [False, True])
def test_reference_equals_the_scalar_oracle(kv_cache, shape, causal, quantize_q):
    q, k, v = _inputs(shape, seed=hash((kv_cache, shape, causal)) % 2**31)
    ks, vs = _scales(shape, kv_cache, k, v, q)
    qs = [F32(np.abs(q[:, h]).max() / 448.0 * (1 + h)) for h in range(shape[1])] if quantize_q else None
    for dtype in DTYPES:
        ksa, vsa = (None if x is None else np.array(x, F32) for x in (ks, vs))
        got = ref.attention(q, k, v, ksa, vsa,
                            dtype=dtype, q_scale=None if qs is None else np.array(qs, F32), causal=causal,
                            kv_cache=kv_cache)
        want = _oracle(q, k, v, kv_cache, ks, vs, qs, causal, dtype)
        assert np.array_equal(got.astype(np.float64), want), (dtype, np.argwhere(got != want)[:3])


def test_per_head_scales_matter_and_equal_ones_are_per_tensor():
    shape = (1, 4, 2, 3, 6, 16)
    q, k, v = _inputs(shape, 1)
    s = np.float32(np.abs(k).max() / 448)
    one = ref.attention(q, k, v, s, s, dtype="float32", causal=True)
    same = ref.attention(q, k, v, np.array([s, s]), np.array([s, s]), dtype="float32", causal=True)
    assert np.array_equal(one.view(np.int32), same.view(np.int32))
    other = ref.attention(q, k, v, np.array([s, s * 8]), np.array([s * 8, s]), dtype="float32", causal=True)
    assert not np.array_equal(one, other)


def test_variants_differ_from_each_other():
    shape = (1, 2, 2, 4, 8, 32)
    q, k, v = _inputs(shape, 2)
    ks, vs = (np.float32(np.abs(x).max() / 448) for x in (k, v))
    fp8 = ref.attention(q, k, v, ks, vs, dtype="float32")
    pth = ref.attention(q, k, v, None, None, dtype="float32", kv_cache="fp8_per_token_head")
    g = [np.float32(448 / np.abs(x).max()) for x in (k, v)]
    fp4 = ref.attention(q, k, v, g[0], g[1], dtype="float32", kv_cache="nvfp4")
    assert not np.array_equal(fp8, pth) and not np.array_equal(fp8, fp4) and not np.array_equal(pth, fp4)
    # the two NVFP4 conventions with the same global value: G = 448/amax encodes, g = 1/G decodes
    mult = ref.attention(q, k, v, np.float32(1) / g[0], np.float32(1) / g[1], dtype="float32", kv_cache="nvfp4_mult")
    assert np.isfinite(mult).all() and not np.array_equal(mult, fp8)


def test_per_token_head_scales_and_the_floor():
    """Per token and head: amax / 448 in float32, floored at 1e-6 (an all-zero row: scale 1e-6, codes 0)."""
    x = np.zeros((1, 2, 3, 8), F32)
    x[0, 0, 0] = np.arange(8) - 3.5
    x[0, 1, 2, 0] = 1e-9  # amax / 448 below the floor
    codes, s = ref.quantize_per_token_head(x)
    assert s[0, 0, 0] == F32(F32(3.5) / F32(448)) and s[0, 0, 1] == F32(1e-6) and s[0, 1, 2] == F32(1e-6)
    assert np.all(codes[0, 0, 1] == 0) and codes[0, 0, 0, 0] == 0xFE  # -448 saturates onto the largest negative code


def test_nvfp4_kv_zero_block_and_layout():
    x = np.zeros((1, 1, 1, 32), F32)
    x[0, 0, 0, 16:] = np.linspace(-6, 6, 16)
    codes, s8 = ref.quantize_nvfp4_kv(x, F32(448 / 6))
    assert s8.shape == (1, 1, 1, 2) and s8[0, 0, 0, 0] == 0 and np.all(codes[0, 0, 0, :16] == 0)
    # amax 6 with G = 448/6: sf = G * fp32(6 * fp32(1/6)), one E4M3 rounding
    want = _e4m3(F32(F32(448 / 6) * F32(6 * F32(1 / 6))))
    assert float(oracle.decode(int(s8[0, 0, 0, 1]), E4M3)) == float(oracle.decode(want, E4M3))
    with pytest.raises(InputTypeError, match="head_dim a multiple of 16"):
        ref.quantize_nvfp4_kv(np.zeros((1, 1, 1, 24), F32), F32(1))


@pytest.mark.parametrize("kwargs, message", [
    ({"k_scale": np.ones(3, F32)}, r"k_scale has 3 values; expected 1 or 2 \(one per head\)"),
    ({"q_scale": np.ones(2, F32)}, r"q_scale has 2 values; expected 1 or 4"),
    ({"kv_cache": "int8"}, r"kv_cache 'int8'; expected one of fp8, fp8_per_token_head, nvfp4, nvfp4_mult"),
    ({"kv_cache": "fp8_per_token_head"}, r"computes its scales; k_scale must be None"),
    ({"kv_cache": "nvfp4", "p_scale": F32(1 / 448)}, r"defined for kv_cache 'fp8' only"),
])
def test_bad_scales_are_refused(kwargs, message):
    q, k, v = _inputs((1, 4, 2, 2, 3, 16), 3)
    args = {"k_scale": F32(0.01), "v_scale": F32(0.01), **kwargs}
    ks, vs = args.pop("k_scale"), args.pop("v_scale")
    with pytest.raises(InputTypeError, match=message):
        ref.attention(q, k, v, ks, vs, dtype="float32", **args)
