"""The NVFP4, MX, ModelOpt and Quark producer recipes (specs/recipes: compressed-tensors-nvfp4, compressed-tensors-mx,
modelopt-nvfp4, modelopt-mxfp8, modelopt-fp8, modelopt-fp8-pc) reproduce every element code and
every scale byte the real tools wrote (tests/fixtures/interop/checkpoints, FINDINGS-FP4-MX.md) from
the fixtures' original bf16 weights, with fp8ref's own codec and scale steps.

The stored tensors are read as bytes (uint8 codes, packed FP4 split low nibble = even element
here, independently of fp8ref's unpacking); fused q/k/v and gate/up share the global amax (both
tools fuse NVFP4 global scales, FINDINGS-FP4-MX §1.1, §3.3.1).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from fp8ref.io.safetensors import open_store
from fp8ref.quant import QuantArgs, dequantize, quantize

pytestmark = pytest.mark.interop

ROOT = Path(__file__).resolve().parents[1] / "fixtures" / "interop" / "checkpoints"
L = "model.layers.0."
LINEARS = [L + n for n in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")]
FUSED = [LINEARS[0:3], LINEARS[4:6]]
CASES = {  # fixture -> (recipe, element format, granularity, weight tensor, global scale tensor)
    "llmc_nvfp4": ("compressed-tensors-nvfp4", "float4_e2m1fn", "nvfp4", "weight_packed", "weight_global_scale"),
    "llmc_nvfp4a16": ("compressed-tensors-nvfp4", "float4_e2m1fn", "nvfp4", "weight_packed", "weight_global_scale"),
    "modelopt_nvfp4": ("modelopt-nvfp4", "float4_e2m1fn", "nvfp4", "weight", "weight_scale_2"),
    "llmc_mxfp4": ("compressed-tensors-mx", "float4_e2m1fn", "mx", "weight_packed", None),
    "llmc_mxfp8": ("compressed-tensors-mx", "float8_e4m3fn", "mx", "weight", None),
    "modelopt_mxfp8": ("modelopt-mxfp8", "float8_e4m3fn", "mx", "weight", None),
    "modelopt_fp8": ("modelopt-fp8", "float8_e4m3fn", "tensor", "weight", None),
    "modelopt_fp8_pc_pt": ("modelopt-fp8-pc", "float8_e4m3fn", "channel", "weight", None),
}


def _nibbles(packed: np.ndarray) -> np.ndarray:
    p = packed.astype(np.uint8)
    return np.stack([p & 0xF, p >> 4], -1).reshape(p.shape[0], -1)


def _fused_amax(orig: dict, name: str) -> float:
    group = next((g for g in FUSED if name in g), [name])
    return max(float(np.abs(orig[m].astype(np.float32)).max()) for m in group)


@pytest.mark.parametrize("fixture", sorted(CASES))
@pytest.mark.parametrize("layer", LINEARS, ids=lambda n: n.rsplit(".", 1)[-1])
def test_recipe_reproduces_tool_bytes(fixture, layer):
    recipe, fmt, gran, wkey, gkey = CASES[fixture]
    ref = open_store(ROOT / fixture / "reference_outputs.safetensors")
    store = open_store(ROOT / fixture / "model.safetensors")
    orig = {n: ref.get(f"original.{n}") for n in LINEARS}
    amax = {"amax": _fused_amax(orig, layer)} if gran == "nvfp4" else {}
    q = quantize(orig[layer], QuantArgs(format=fmt, granularity=gran), recipe=recipe, **amax)
    stored = store.get(f"{layer}.{wkey}")
    codes = _nibbles(stored) if fmt == "float4_e2m1fn" else stored
    assert np.array_equal(q.codes, codes)
    scale = store.get(f"{layer}.weight_scale")
    if gran in ("nvfp4", "mx"):  # E4M3 / E8M0 bytes
        assert np.array_equal(q.scale_codes, scale.view(np.uint8))
    else:
        assert np.array_equal(np.asarray(q.scale, np.float32).reshape(-1).view(np.uint32),
                              scale.astype(np.float32).reshape(-1).view(np.uint32))
    if gkey:
        assert np.float32(q.global_scale[0]).tobytes() == store.get(f"{layer}.{gkey}").tobytes()


@pytest.mark.parametrize("fixture", ["llmc_nvfp4", "llmc_mxfp4", "llmc_mxfp8"])
def test_ct_in_memory_qdq_equals_recipe_dequantize(fixture):
    """compressed-tensors' in-memory fake-quantized weight (fake_quantize with the module's own
    parameters) equals dequantize() of the recipe's result in the model dtype, bit for bit."""
    recipe, fmt, gran, _, _ = CASES[fixture]
    ref = open_store(ROOT / fixture / "reference_outputs.safetensors")
    orig = {n: ref.get(f"original.{n}") for n in LINEARS}
    for layer in (LINEARS[0], LINEARS[1]):
        amax = {"amax": _fused_amax(orig, layer)} if gran == "nvfp4" else {}
        q = quantize(orig[layer], QuantArgs(format=fmt, granularity=gran), recipe=recipe, **amax)
        mine = np.asarray(dequantize(q, dtype="bfloat16"))
        theirs = ref.get(f"{layer}.qdq_in_memory")
        assert mine.view(np.uint16).tobytes() == theirs.view(np.uint16).tobytes()
