"""fp8ref's producer recipes bit for bit against the real tools' own code on CPU (issue #13): element
codes and scale bytes. ``tox -e tools`` (marker ``tools``, never in the default run; each test skips
when its tool is absent). What is loaded and what is stubbed: tests/support/producer_tools.py.

* TransformerEngine 2.20.2's shipped PyTorch reference quantizers (the references TE's own tests hold
  its CUDA kernels to), not the CUDA kernels: ``te-current``, ``te-current-pow2``, ``te-nvfp4``,
  ``te-nvfp4-2d``, with the two places the reference and the kernel (as read, the recipes) differ.
* DeepGEMM's ``deep_gemm/utils/math.py`` (its host-side casts; vLLM's bundled copy and a checkout):
  ``deepgemm-ue8m0``, per 1x128 token group and per 128x128 block, K not a multiple of 128 included.
* FBGEMM (fbgemm-gpu-genai 1.9.0): ``quantize_fp8_row``'s PyTorch path for CPU tensors (recipe variant
  ``fbgemm-cpu``; the CUDA op ``quantize_fp8_per_row`` of ``fbgemm-fp8`` has no CPU kernel).
* vLLM 0.33.0: ``QuantFP8.forward_native`` (the PyTorch path vLLM's kernels are tested against) and the
  Triton fallback of ``per_token_group_quant_fp8`` in Triton's CPU interpreter. Neither is the CUDA
  kernel ``vllm-dynamic``/``vllm-group`` model; what each computes is asserted here as a recipe variant.
"""

from __future__ import annotations

import os
from dataclasses import replace

import ml_dtypes
import numpy as np
import pytest

from fp8ref import QuantArgs, quantize
from fp8ref.recipes import with_amax_ub
from fp8ref.registry import get_recipe

torch = pytest.importorskip("torch")

from tests.support import producer_tools  # noqa: E402

pytestmark = pytest.mark.tools
BF16_MAX = float(ml_dtypes.finfo(ml_dtypes.bfloat16).max)


def _inputs(seed: int, rows: int = 64, k: int = 512):
    """bf16 rows of N(0, 1) * 2^U(-14, 9) with the edges: an all-zero group and row (with a -0.0),
    a subnormal-only group, amax exactly 448 * 2^j and just above it for j in -12..11, e4m3 ties."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g) * torch.exp2(torch.randint(-14, 10, (rows, 1), generator=g).float())
    x[1, :128] = 0.0
    x[2, :] = 0.0
    x[2, 7] = -0.0
    x[3, :128] = 2.0 ** -133 * torch.randint(-3, 4, (128,), generator=g)
    x[4, 3], x[4, 130] = 448 * 2.0 ** -3, 448 * 2.0 ** 5 * (1 + 2 ** -7)
    x[5, :] = torch.randint(-6, 7, (k,), generator=g) * 2.0 ** -9
    for r in range(6, 30):
        x[r, 0], x[r, 128] = 448 * 2.0 ** (r - 18) * (1 + 2 ** -7), 448 * 2.0 ** (r - 18)
    return x.to(torch.bfloat16)


INPUTS = [_inputs(seed) for seed in range(4)]


def _np(x) -> np.ndarray:
    return x.float().numpy().astype(ml_dtypes.bfloat16)


def _bytes(t) -> np.ndarray:
    return t.contiguous().view(torch.uint8).numpy()


def _f32(t) -> np.ndarray:
    return t.float().contiguous().numpy().view(np.uint32).reshape(-1)


# --- TransformerEngine ------------------------------------------------------------------------------
def _te(name: str):
    module = producer_tools.te_reference(name)
    if module is None:
        pytest.skip("transformer_engine (2.20.2) is not installed")
    return module


@pytest.fixture(scope="module")
def te_cs():
    return _te("reference_current_scaling")


@pytest.fixture(scope="module")
def te_nv():
    return _te("reference_nvfp4")


@pytest.mark.parametrize("fmt", ["float8_e4m3fn", "float8_e5m2"])
@pytest.mark.parametrize("recipe", ["te-current", "te-current-pow2"])
def test_te_current_scaling_reference(te_cs, recipe, fmt):
    """Every code and scale_inv of CurrentScalingQuantizerRef (whole tensors, an all-zero tensor)."""
    for x in [*INPUTS, *(x[2:3] for x in INPUTS), *(x[:1] for x in INPUTS)]:
        ref = te_cs.CurrentScalingQuantizerRef(dtype=getattr(torch, fmt), rowwise=True, columnwise=False,
                                               pow_2_scales=recipe.endswith("pow2")).quantize(x)
        q = quantize(_np(x), QuantArgs(format=fmt, granularity="tensor"), recipe=recipe)
        assert np.array_equal(_bytes(ref.data), q.codes)
        assert np.array_equal(_f32(ref.scale), q.scale.view(np.uint32))


@pytest.mark.parametrize("recipe", ["te-current", "te-current-pow2"])
def test_te_current_scaling_reference_overflow(te_cs, recipe):
    """448/amax = inf (a subnormal-only tensor): the reference substitutes torch.finfo(x.dtype).max (bf16
    0x7F7F0000), the CUDA kernel FLT_MAX (current_scaling.cu, the recipe). Without pow2 the scale_inv
    differs (codes do not); with pow2 both clear the mantissa to 2^127."""
    for x in INPUTS:
        part = x[3:4, :128]
        ref = te_cs.CurrentScalingQuantizerRef(dtype=torch.float8_e4m3fn, rowwise=True, columnwise=False,
                                               pow_2_scales=recipe.endswith("pow2")).quantize(part)
        q = quantize(_np(part), QuantArgs(granularity="tensor"), recipe=recipe)
        assert np.array_equal(_bytes(ref.data), q.codes)
        if recipe == "te-current":
            assert ref.scale.item() == np.float32(1.0) / np.float32(BF16_MAX)
            assert q.scale[0] == np.float32(1.0) / np.finfo(np.float32).max
        else:
            assert np.array_equal(_f32(ref.scale), q.scale.view(np.uint32))


@pytest.mark.parametrize("tile,recipe", [((1, 16), "te-nvfp4"), ((16, 16), "te-nvfp4-2d")])
def test_te_nvfp4_reference(te_nv, tile, recipe):
    """Every packed E2M1 byte (element 2i in the low nibble) and E4M3 block-scale byte of NVFP4QuantizerRef
    (no RHT), except one documented difference: the reference's cast_to_fp4x2 maps an input -0.0 to
    nibble 0x0, the kernel's cvt.rn.satfinite.e2m1x2 keeps the sign (0x8, the recipe)."""
    for x in INPUTS:
        ref = te_nv.NVFP4QuantizerRef(dtype=te_nv.reference_utils.Fp4Formats.E2M1, rowwise=True, columnwise=False,
                                      quant_tile_shape=tile).quantize(x)
        q = quantize(_np(x), QuantArgs(format="float4_e2m1fn", granularity="nvfp4"), recipe=recipe)
        assert np.array_equal(_bytes(ref.scale), q.scale_codes)
        ref_codes = np.stack([_bytes(ref.data) & 0xF, _bytes(ref.data) >> 4], axis=-1).reshape(q.codes.shape)
        negzero = np.signbit(x.float().numpy()) & (x.float().numpy() == 0)
        assert negzero.sum() == 1
        assert np.array_equal(ref_codes[~negzero], q.codes[~negzero])
        assert set(ref_codes[negzero]) == {0x0} and set(q.codes[negzero]) == {0x8}


# --- DeepGEMM ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module", params=["vllm", "checkout"])
def deepgemm(request):
    module = producer_tools.deepgemm_math(request.param)
    if module is None:
        pytest.skip("vllm (its bundled DeepGEMM) is not installed" if request.param == "vllm"
                    else "FP8REF_DEEPGEMM (a DeepGEMM checkout) is not set")
    return module


@pytest.mark.parametrize("k", [512, 300])
def test_deepgemm_ue8m0_casts(deepgemm, k):
    """per_token_cast_to_fp8 (1x128) and per_block_cast_to_fp8 (128x128) with use_ue8m0=True."""
    for x in INPUTS:
        x = x[:, :k].contiguous()
        q8, sf = deepgemm.per_token_cast_to_fp8(x, use_ue8m0=True)
        q = quantize(_np(x), QuantArgs(granularity="group", group_size=128), recipe="deepgemm-ue8m0")
        assert np.array_equal(_bytes(q8), q.codes) and np.array_equal(_f32(sf), q.scale.view(np.uint32).reshape(-1))
        q8, sf = deepgemm.per_block_cast_to_fp8(x, use_ue8m0=True)
        q = quantize(_np(x), QuantArgs(granularity="block", block_shape=(128, 128)), recipe="deepgemm-ue8m0")
        assert np.array_equal(_bytes(q8), q.codes) and np.array_equal(_f32(sf), q.scale.view(np.uint32).reshape(-1))


# --- vLLM ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def vllm():
    if os.environ.get("TRITON_INTERPRET") != "1" or os.environ.get("CUDA_VISIBLE_DEVICES") != "":
        pytest.skip("needs TRITON_INTERPRET=1 CUDA_VISIBLE_DEVICES= (tox -e tools sets them)")
    modules = producer_tools.vllm_modules()
    if modules is None:
        pytest.skip("vllm (0.33.0) is not installed")
    return modules


NATIVE_TOKEN, NATIVE_GROUP = producer_tools.native_recipes()["token"], producer_tools.native_recipes()["group"]


def test_vllm_native_per_token_and_scale_ub(vllm):
    """QuantFP8(PER_TOKEN).forward_native, without and with scale_ub (min(amax, ub) first): every code
    and scale. It multiplies by fp32(1/s); the CUDA kernel's recipe vllm-dynamic divides."""
    with vllm["context"]():
        op = vllm["QuantFP8"](static=False, group_shape=vllm["GroupShape"].PER_TOKEN)
    args = QuantArgs(granularity="token")
    for x in INPUTS:
        for ub in (None, 1.0, 2.0 ** -9):
            q8, s = op.forward_native(x, scale_ub=None if ub is None else torch.tensor([ub]))
            recipe = NATIVE_TOKEN if ub is None else with_amax_ub(NATIVE_TOKEN, ub)
            q = quantize(_np(x), args, recipe=recipe)
            assert np.array_equal(_bytes(q8), q.codes) and np.array_equal(_f32(s), q.scale.view(np.uint32).reshape(-1))
            kernel = quantize(_np(x), args, recipe="vllm-dynamic" if ub is None
                              else with_amax_ub(get_recipe("vllm-dynamic"), ub))
            assert np.array_equal(kernel.scale, q.scale)       # the same scales; codes only where x/s != x*(1/s)


def test_vllm_native_group(vllm):
    """QuantFP8(GroupShape(1, 128)).forward_native with fp32 scales: every code and scale."""
    with vllm["context"]():
        op = vllm["QuantFP8"](static=False, group_shape=vllm["GroupShape"](1, 128), use_ue8m0=False)
    for x in INPUTS:
        q8, s = op.forward_native(x)
        q = quantize(_np(x), QuantArgs(granularity="group", group_size=128), recipe=NATIVE_GROUP)
        assert np.array_equal(_bytes(q8), q.codes) and np.array_equal(_f32(s), q.scale.view(np.uint32).reshape(-1))


def test_vllm_triton_group_ue8m0_scales(vllm):
    """per_token_group_quant_fp8(use_ue8m0=True)'s Triton kernel in Triton's CPU interpreter: every scale
    equals vllm-group-ue8m0's exact ceil on these inputs (the interpreter's log2/exp2 are numpy's, not the
    GPU's approximations). Its codes are not evidence: the interpreter's fp32 -> fp8e4nv conversion is not
    round-to-nearest (31.625 -> 16.0), so they are not compared."""
    for x in INPUTS:
        _, s = vllm["fp8_utils"].per_token_group_quant_fp8(x, 128, use_ue8m0=True)
        q = quantize(_np(x), QuantArgs(granularity="group", group_size=128), recipe="vllm-group-ue8m0")
        assert np.array_equal(_f32(s), q.scale.view(np.uint32).reshape(-1))


def test_vllm_native_group_ue8m0(vllm):
    """forward_native's UE8M0 option, torch.exp2(torch.ceil(torch.log2(s))): on bf16 inputs every code and
    scale is the exact ceil (vllm-native-group with pow2 ceil: a bf16 amax / 448 is never within 2^-8 of a
    power of two unless it is one). torch's float32 log2 is not exact just above a power of two, so on
    float32 inputs with s = 2^j (1 + 2^-23) it picks 2^j for some j, not 2^(j+1), and the group's amax
    element clamps to 448 (0x7E) instead of 224 (0x76)."""
    with vllm["context"]():
        op = vllm["QuantFP8"](static=False, group_shape=vllm["GroupShape"](1, 128), use_ue8m0=True)
    args = QuantArgs(granularity="group", group_size=128)
    exact = replace(NATIVE_GROUP, scale_pow2="ceil")
    for x in INPUTS:
        q8, s = op.forward_native(x)
        q = quantize(_np(x), args, recipe=exact)
        assert np.array_equal(_bytes(q8), q.codes) and np.array_equal(_f32(s), q.scale.view(np.uint32).reshape(-1))
    j = torch.arange(-12, 12, dtype=torch.float32)
    x = torch.zeros(j.numel(), 128)
    x[:, 0] = 448 * torch.exp2(j) * (1 + 2.0 ** -23)
    q8, s = op.forward_native(x)
    q = quantize(x.numpy(), args, recipe=exact)
    assert np.array_equal(q.scale.reshape(-1), torch.exp2(j + 1).numpy()) and set(q.codes[:, 0]) == {0x76}
    s = s.reshape(-1)
    low = (s == torch.exp2(j)).numpy()                          # 16 of these 24 on this machine's torch
    assert low.any() and np.array_equal(s[~low].numpy(), torch.exp2(j + 1).numpy()[~low])
    assert set(_bytes(q8)[low, 0]) == {0x7E} and set(_bytes(q8)[~low, 0]) == {0x76}


# --- FBGEMM -----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def fbgemm():
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs TRITON_INTERPRET=1 (tox -e tools sets it)")
    module = producer_tools.fbgemm_fp8_gemm()
    if module is None:
        pytest.skip("fbgemm-gpu-genai (1.9.0) is not installed")
    return module


@pytest.mark.parametrize("ub", [None, 1200.0, 1.0])
def test_fbgemm_quantize_fp8_row_cpu(fbgemm, ub):
    """quantize_fp8_row on CPU tensors (its PyTorch path; on a GPU it runs the Triton kernel the fbgemm
    recipe models): every code and scale is fbgemm-cpu, i.e. fbgemm with 448 * fp32(1/amax) and the eps
    floor in bf16; it differs from the fbgemm recipe's fp32(448/amax) on some codes."""
    recipe = producer_tools.native_recipes()["fbgemm-cpu"]
    kernel = get_recipe("fbgemm")
    args = QuantArgs(granularity="channel")
    differ = 0
    for x in INPUTS:
        q8, s = fbgemm.quantize_fp8_row(x, scale_ub=None if ub is None else torch.tensor([ub]))
        q = quantize(_np(x), args, recipe=recipe if ub is None else with_amax_ub(recipe, ub))
        assert np.array_equal(_bytes(q8), q.codes) and np.array_equal(_f32(s), q.scale.view(np.uint32).reshape(-1))
        k = quantize(_np(x), args, recipe=kernel if ub is None else with_amax_ub(kernel, ub))
        differ += int((k.codes != q.codes).sum())
    assert differ > 0
