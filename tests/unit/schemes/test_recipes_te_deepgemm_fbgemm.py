"""TransformerEngine current scaling (and its power-of-two option), DeepGEMM's and vLLM's UE8M0
group scales, FBGEMM's CUDA per-row quantizer and run-time amax upper bounds (``scale_ub``),
each checked against an independent Fraction oracle written here from the producers' source:
scales from exact rationals rounded once to float32 (tests/support/quant_oracle.fp32_nearest),
powers of two by integer search, codes by the Fraction grid (quant_oracle.exact_code).
"""

from __future__ import annotations

from fractions import Fraction

import ml_dtypes
import numpy as np
import pytest

from fp8ref import QuantArgs, quantize
from fp8ref.errors import Fp8RefError, RecipeError
from fp8ref.formats import FORMATS
from fp8ref.recipes import with_amax_ub
from fp8ref.registry import get_recipe
from fp8ref.scaling import ceil_to_ue8m0
from tests.support.quant_oracle import (
    code_of,
    fbgemm_oracle,
    fp32_nearest,
    frac,
    group_ue8m0_oracle,
    is_negative,
    pow2_ceil,
    te_nvfp4_oracle,
    te_oracle,
)

E4M3 = FORMATS["float8_e4m3fn"]
E5M2 = FORMATS["float8_e5m2"]
BF16 = ml_dtypes.bfloat16


# --- inputs: random values plus the edges ------------------------------------------------------
def _edges(dtype, rows=6, k=256, seed=0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((rows, k)) * np.exp2(rng.integers(-12, 8, (rows, 1)))).astype(np.float32)
    x[1, :128] = 0.0                                   # an all-zero group
    x[2, :] = 0.0                                      # an all-zero row
    x[2, 7] = -0.0
    tiny = float((ml_dtypes.finfo(BF16) if dtype is BF16 else np.finfo(np.float32)).smallest_subnormal)
    x[3, :128] = tiny * rng.integers(-3, 4, 128)       # subnormals only
    x[4, 3] = 448.0 * 2.0 ** -3                        # amax exactly 448 * 2^k: the scale lands on a power of two
    x[4, 130] = 448.0 * 2.0 ** 5 * (1 + 2.0 ** -7)     # ... and just above one
    x[5, :] = rng.integers(-6, 7, k) * 2.0 ** -9        # many ties on the e4m3 grid
    return x.astype(dtype)


DTYPES = [np.float32, BF16]


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bfloat16"])
@pytest.mark.parametrize("recipe,fmt", [("te-current", E4M3), ("te-current", E5M2), ("te-current-pow2", E4M3),
                                        ("te-current-pow2", E5M2)])
def test_te_current_scaling_matches_the_oracle(recipe, fmt, dtype):
    x = _edges(dtype)
    for part in (x, x[1:3], x[2:3], x[3:4]):     # per tensor: whole, zero-heavy, all-zero, subnormal-only
        q = quantize(part, QuantArgs(format=fmt.name, granularity="tensor"), recipe=recipe)
        codes, s = te_oracle(part, fmt, pow2=recipe.endswith("pow2"))
        assert np.array_equal(q.codes, codes)
        assert q.scale.reshape(-1).view(np.uint32)[0] == np.float32(s).view(np.uint32)


def test_te_corner_scales():
    """amax 0 and Inf give scale 1; a subnormal amax whose 448/amax overflows gives FLT_MAX (scale_inv
    fp32(1/FLT_MAX)), and with power-of-two scales 2^127."""
    args = QuantArgs(granularity="tensor")
    assert quantize(np.zeros(4, np.float32), args, recipe="te-current").scale[0] == 1.0
    inf = np.array([1.0, np.inf], np.float32)
    q = quantize(inf, args, recipe="te-current")
    assert q.scale[0] == 1.0 and list(q.codes) == [0x38, 0x7E]   # x * 1, Inf saturates to 448
    sub = np.array([1e-39, -2e-39], np.float32)
    q = quantize(sub, args, recipe="te-current")
    assert q.scale[0] == np.float32(1.0) / np.finfo(np.float32).max
    q2 = quantize(sub, args, recipe="te-current-pow2")
    assert q2.scale[0] == np.float32(2.0 ** -127)


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bfloat16"])
@pytest.mark.parametrize("recipe,floor", [("deepgemm-ue8m0", 1e-4), ("vllm-group-ue8m0", 1e-10)])
def test_ue8m0_group_scales_match_the_oracle(recipe, floor, dtype):
    x = _edges(dtype)
    q = quantize(x, QuantArgs(granularity="group", group_size=128), recipe=recipe)
    codes, scales = group_ue8m0_oracle(x, 128, floor, divide=recipe.startswith("vllm"))
    assert np.array_equal(q.codes, codes)
    assert np.array_equal(q.scale.view(np.uint32), scales.view(np.uint32))
    m, _ = np.frexp(q.scale)
    assert (m == 0.5).all()                                   # every scale a power of two (UE8M0)
    assert q.scale[4, 0] == 2.0 ** -3 and q.scale[4, 1] == 2.0 ** 6   # on a power of two: kept; above: up


def test_deepgemm_partial_group_and_block():
    """K not a multiple of 128 (DeepGEMM zero-pads) and 128x128 weight blocks."""
    x = _edges(np.float32, rows=6, k=200, seed=4)
    q = quantize(x, QuantArgs(granularity="group", group_size=128), recipe="deepgemm-ue8m0")
    codes, scales = group_ue8m0_oracle(x, 128, 1e-4, divide=False)
    assert np.array_equal(q.codes, codes) and np.array_equal(q.scale, scales)
    w = _edges(BF16, rows=130, k=256, seed=5)
    qb = quantize(w, QuantArgs(granularity="block", block_shape=(128, 128)), recipe="deepgemm-ue8m0")
    wf = w.astype(np.float32)
    for bi in range(2):
        for bj in range(2):
            blk = wf[bi * 128:(bi + 1) * 128, bj * 128:(bj + 1) * 128]
            s = pow2_ceil(frac(fp32_nearest(max(frac(np.abs(blk).max()), frac(np.float32(1e-4))) / 448)))
            assert qb.scale[bi, bj] == float(s)
            got = qb.codes[bi * 128:(bi + 1) * 128, bj * 128:(bj + 1) * 128]
            want = [code_of(frac(v) / s, is_negative(v)) for v in blk.reshape(-1)[::97]]
            assert list(got.reshape(-1)[::97]) == want


def test_ceil_to_ue8m0_bit_rule():
    """Exponent + [mantissa != 0] clamped to 1..254, for every kind of float32."""
    s = np.array([1.0, 1.5, 2.0 ** -130, 0.0, 2.0 ** 127 * 1.5, np.inf, 3.0, 2.0 ** -126], np.float32)
    want = [1.0, 2.0, 2.0 ** -126, 2.0 ** -126, 2.0 ** 127, 2.0 ** 127, 4.0, 2.0 ** -126]
    assert ceil_to_ue8m0(s).tolist() == want
    rng = np.random.default_rng(1)
    r = (rng.random(2000) * np.exp2(rng.integers(-120, 120, 2000))).astype(np.float32)
    assert [float(v) for v in ceil_to_ue8m0(r)] == [float(pow2_ceil(frac(v))) for v in r]


@pytest.mark.parametrize("ub", [None, 1200.0, 0.5])
def test_fbgemm_cuda_rowwise_matches_the_oracle(ub):
    x = _edges(BF16, seed=7)
    x[0, 9] = 3000.0                                            # an outlier above activation_scale_ub
    rec = get_recipe("fbgemm-fp8") if ub is None else with_amax_ub(get_recipe("fbgemm-fp8"), ub)
    q = quantize(x, QuantArgs(granularity="token"), recipe=rec)
    codes, scales = fbgemm_oracle(x, ub)
    assert np.array_equal(q.codes, codes)
    assert np.array_equal(q.scale.view(np.uint32), scales.view(np.uint32))
    if ub == 1200.0:
        assert q.scale[0, 0] == np.float32(np.float32(1200.0) / np.float32(448)) and q.codes[0, 9] == 0x7E


def test_vllm_dynamic_scale_ub():
    """vLLM's dynamic per-token quantization with scale_ub: min(amax, ub) / 448, floor 1/(448*512)."""
    x = np.array([[1.0, -900.0, 3.0], [0.0, 0.0, 0.0]], np.float32)
    q = quantize(x, QuantArgs(granularity="token"), recipe=with_amax_ub(get_recipe("vllm-dynamic"), 448.0))
    assert q.scale[0, 0] == 1.0 and list(q.codes[0]) == [0x38, 0xFE, 0x44]   # -900 clamps to -448
    assert q.scale[1, 0] == np.float32(1 / 229376)


def test_scale_ub_refuses_bad_bounds():
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(RecipeError, match="scale_ub"):
            with_amax_ub(get_recipe("fbgemm-fp8"), bad)


def test_vllm_ue8m0_requires_whole_groups():
    with pytest.raises(Fp8RefError, match="128"):
        quantize(np.ones((2, 200), np.float32), QuantArgs(granularity="group", group_size=128),
                 recipe="vllm-group-ue8m0")


def test_recipe_validation_of_the_new_keys(tmp_path):
    """floor-multiplier needs a multiplier form; a scaling.POW2_RULES rule acts on the scale of any form
    (a multiplier form's multiplier is then the exact 2**-k); unknown values are refused."""
    from fp8ref.io.yaml import load_yaml
    from fp8ref.recipes import compute_scale, recipe_from_document
    from fp8ref.registry import RECIPES_DIR

    base = (RECIPES_DIR / "te-current.yaml").read_text()
    path = tmp_path / "te-current.yaml"
    path.write_text(base.replace("pow2: null", "pow2: up"))
    with pytest.raises(Fp8RefError, match="pow2"):
        recipe_from_document(load_yaml(path))
    path.write_text(base.replace("pow2: null", "pow2: ceil"))
    rec = recipe_from_document(load_yaml(path))
    stored, m = compute_scale(np.array([3.0, 448.0, 0.001]), rec, FORMATS["float8_e4m3fn"], "bfloat16")
    assert [Fraction(float(v)) for v in stored] == [Fraction(1, 128), Fraction(1), Fraction(1, 2 ** 18)]
    assert [float(v) for v in m] == [128.0, 1.0, 2.0 ** 18]  # ceil(log2(amax/448)) with the exact reciprocal
    dg = tmp_path / "deepgemm-ue8m0.yaml"
    dg.write_text((RECIPES_DIR / "deepgemm-ue8m0.yaml").read_text().replace("pow2: ceil", "pow2: floor-multiplier"))
    with pytest.raises(Fp8RefError, match="floor-multiplier goes with a float32 multiplier form"):
        recipe_from_document(load_yaml(dg))
    path.write_text(base.replace("    pow2: null\n", ""))   # an optional key: absent means null
    assert recipe_from_document(load_yaml(path)).scale_pow2 is None


# --- TransformerEngine NVFP4 -----------------------------------------------------------------
def _nvfp4_input(dtype, seed=0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((32, 40)) * np.exp2(rng.integers(-10, 6, (32, 1)))).astype(np.float32)
    x[0, :16] = 0.0                                     # an all-zero 1x16 block
    x[16:32, 16:32] = 0.0                               # an all-zero 16x16 tile
    x[3, 16:32] = 6.0 * 2.0 ** -4                       # block amax = 6 * 2^k
    x[5, 20] = -0.0
    tiny = float((ml_dtypes.finfo(BF16) if dtype is BF16 else np.finfo(np.float32)).smallest_subnormal)
    x[7, 32:] = tiny * rng.integers(-3, 4, 8)          # subnormals only (a partial block: K = 40)
    return x.astype(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bfloat16"])
@pytest.mark.parametrize("recipe,tile", [("te-nvfp4", 1), ("te-nvfp4-2d", 16)])
def test_te_nvfp4_matches_the_oracle(recipe, tile, dtype):
    x = _nvfp4_input(dtype)
    for part in (x, x[16:32, 16:32], np.zeros((16, 16), dtype)):
        q = quantize(part, QuantArgs(format="float4_e2m1fn", granularity="nvfp4"), recipe=recipe)
        codes, scale_codes, g = te_nvfp4_oracle(part, tile)
        assert np.array_equal(q.codes, codes)
        assert np.array_equal(q.scale_codes, scale_codes)
        assert q.global_scale[0] == g and q.global_meaning == "divisor"
    if tile == 16:  # the 16 rows of a tile carry one scale
        assert (q.scale_codes.reshape(-1, 16, q.scale_codes.shape[-1]) == q.scale_codes[::16, None]).all()


def test_te_nvfp4_global_corners():
    from fp8ref.quant import nvfp4_producer_global

    rec = get_recipe("te-nvfp4")
    assert nvfp4_producer_global(0.0, rec, "float32") == 1.0
    assert nvfp4_producer_global(float("inf"), rec, "float32") == 1.0            # 2688/inf = 0 -> 1
    assert nvfp4_producer_global(1e-42, rec, "float32") == np.finfo(np.float32).max
    assert nvfp4_producer_global(float("nan"), rec, "float32") == np.finfo(np.float32).max  # fminf(NaN, max)
    with pytest.raises(Fp8RefError, match="2-D"):
        quantize(np.ones(32, np.float32), QuantArgs(format="float4_e2m1fn", granularity="nvfp4"),
                 recipe="te-nvfp4-2d")


@pytest.mark.parametrize("recipe", ["te-current", "te-current-pow2"])
def test_te_amax_on_the_edges(recipe):
    """amax exactly max*2^k (m a power of two), the largest bf16, and just above a power of two."""
    big = float(ml_dtypes.finfo(BF16).max)
    for amax in (448.0 * 2.0 ** -3, 448.0 * 2.0 ** 20, big, 448.0 * (1 + 2.0 ** -7), 2.0 ** -133):
        x = np.array([[amax, -amax / 3, 1e-3, -0.0], [0.0, amax / 7, -amax, 2.0 ** -130]], np.float32)
        x = x.astype(BF16).astype(np.float32)
        q = quantize(x, QuantArgs(granularity="tensor"), recipe=recipe)
        codes, s = te_oracle(x, E4M3, pow2=recipe.endswith("pow2"))
        assert np.array_equal(q.codes, codes) and q.scale[0] == s, amax


def test_fbgemm_floor_and_ub_edges():
    """amax = 1/512 puts amax/448 exactly on the 1/(448*512) floor; amax = ub exactly."""
    x = np.array([[2.0 ** -9, -2.0 ** -10, 0.0], [1200.0, -600.0, 3.0], [1e-30, 0.0, -0.0]], np.float32)
    for ub in (None, 1200.0):
        rec = get_recipe("fbgemm-fp8") if ub is None else with_amax_ub(get_recipe("fbgemm-fp8"), ub)
        q = quantize(x, QuantArgs(granularity="token"), recipe=rec)
        codes, scales = fbgemm_oracle(x, ub)
        assert np.array_equal(q.codes, codes) and np.array_equal(q.scale, scales)
    assert q.scale[0, 0] == np.float32(1 / 229376) and q.scale[2, 0] == np.float32(1 / 229376)
