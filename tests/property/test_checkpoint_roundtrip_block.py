"""export -> load -> write round trips for the NVFP4 / MX / ModelOpt / Quark formats fp8ref writes: the
codes, block-scale bytes and global scales a checkpoint holds are bit-identical to
``fp8ref.quant.quantize`` with the layout's producer recipe (NVFP4 globals from the fused q/k/v
amax), the input global to ``nvfp4_producer_global`` of the calibrated amax, and load -> write
-> load reproduces the file bytes."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fp8ref.checkpoint import load_checkpoint
from fp8ref.checkpoint.convert import write_checkpoint
from fp8ref.checkpoint.export import export_checkpoint
from fp8ref.checkpoint.layout import LayerQuant, to_scheme
from fp8ref.errors import CheckpointError
from fp8ref.io.safetensors import write_safetensors
from fp8ref.quant import QuantArgs, nvfp4_producer_global, quantize
from fp8ref.registry import get_recipe

NP = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16, "float32": np.float32}
ST = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}
FP4, FP6, E4M3 = "float4_e2m1fn", "float6_e2m3fn", "float8_e4m3fn"
CASES = [  # (format, layout, recipe)
    ("compressed-tensors", LayerQuant("nvfp4", None, "nvfp4", weight_fmt=FP4, global_scale="divisor", input_fmt=FP4),
     "compressed-tensors-nvfp4"),
    ("compressed-tensors", LayerQuant("nvfp4", None, None, weight_fmt=FP4, global_scale="divisor"),
     "compressed-tensors-nvfp4"),
    ("compressed-tensors", LayerQuant("mx", None, "mx", weight_fmt=FP4, input_fmt=FP4), "compressed-tensors-mx"),
    ("compressed-tensors", LayerQuant("mx", None, "mx"), "compressed-tensors-mx"),
    # compressed-tensors 0.20: MXFP6A16, MXFP6A8, MXFP4XFP8
    ("compressed-tensors", LayerQuant("mx", None, None, weight_fmt=FP6), "compressed-tensors-mx-0.20"),
    ("compressed-tensors", LayerQuant("mx", None, "mx", weight_fmt=FP6, input_fmt=E4M3), "compressed-tensors-mx-0.20"),
    # MXFP4XFP8's weights: 0.20.1 writes MXFP4 codes and scales as 0.19 does (recipe compressed-tensors-mx)
    ("compressed-tensors", LayerQuant("mx", None, "dynamic-group", 128, weight_fmt=FP4), "compressed-tensors-mx"),
    ("modelopt", LayerQuant("nvfp4", None, "nvfp4", weight_fmt=FP4, global_scale="multiplier", input_fmt=FP4),
     "modelopt-nvfp4"),
    ("modelopt", LayerQuant("mx", None, "mx"), "modelopt-mxfp8"),
    ("modelopt", LayerQuant("tensor", None, "static"), "modelopt-fp8"),
    ("modelopt", LayerQuant("channel", None, "dynamic-token"), "modelopt-fp8-pc"),
    ("quark", LayerQuant("tensor", None, "static"), "quark-fp8"),
    ("quark", LayerQuant("mx", None, "mx", weight_fmt=FP4, input_fmt=FP4), "quark-mxfp4"),
]
NAMES = ("model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj")


@st.composite
def weights(draw, dtype: str, out: int, inp: int):
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    w = (rng.standard_normal((out, inp)) * 2.0 ** draw(st.integers(-12, 8))).astype(NP[dtype])
    if draw(st.booleans()):
        w[rng.integers(0, out)] = 0  # all-zero blocks: each recipe's zero rule
    if draw(st.booleans()):
        w.reshape(-1)[rng.integers(0, w.size)] = -0.0
    return w


def _bits(a) -> bytes:
    return np.ascontiguousarray(np.asarray(a)).tobytes()


def test_modelopt_nvfp4_all_zero_group_is_refused_as_non_finite(tmp_path):
    """The example hypothesis found outside the ci profile: a fused group of all-zero bf16 weights
    under ModelOpt NVFP4 (0/0 global scale, NaN block scales) must be the one-line non-finite
    refusal, and write nothing."""
    ws = {n: np.zeros((1, 2), ml_dtypes.bfloat16) for n in NAMES}
    (tmp_path / "src").mkdir()
    write_safetensors(tmp_path / "src" / "model.safetensors", {f"{n}.weight": ("BF16", w) for n, w in ws.items()},
                      {"format": "pt"})
    (tmp_path / "src" / "config.json").write_text(json.dumps({"model_type": "llama", "dtype": "bfloat16"}))
    quant = next(q for f, q, r in CASES if r == "modelopt-nvfp4")
    with pytest.raises(CheckpointError, match="non-finite .*0/0"):
        export_checkpoint(tmp_path / "src", tmp_path / "out", {"scheme": to_scheme(quant, "modelopt-nvfp4")},
                          format="modelopt", calibration={n: 0.5 for n in NAMES})
    assert not (tmp_path / "out").exists()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_export_load_write_is_bit_identical(data):
    fmt, quant, recipe = data.draw(st.sampled_from(CASES), label="case")
    dtype = data.draw(st.sampled_from(sorted(NP)), label="dtype")
    # packed FP4 needs an even K, packed FP6 a multiple of 4; producers pack whole blocks (16 NVFP4, 32 MX)
    # once K reaches one, so K is either below a block (one partial group) or a multiple of 32
    step = 4 if quant.weight_fmt == FP6 else 2
    inp = data.draw(st.one_of(st.integers(1, 7).map(lambda h: step * h),
                              st.integers(1, 5).map(lambda b: 32 * b)), label="K")
    ws = {n: data.draw(weights(dtype, data.draw(st.integers(1, 24)), inp), label=n) for n in NAMES}
    amax = {n: data.draw(st.sampled_from([0.5, 3.0, 448.0, 1e-3]), label=f"amax {n}") for n in NAMES}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        (tmp / "src").mkdir()
        write_safetensors(tmp / "src" / "model.safetensors", {f"{n}.weight": (ST[dtype], w) for n, w in ws.items()},
                          {"format": "pt"})
        (tmp / "src" / "config.json").write_text(json.dumps({"model_type": "llama", "dtype": dtype}))
        fused = max(float(np.abs(w.astype(np.float32)).max()) for w in ws.values())
        spec = {"scheme": to_scheme(quant, recipe)}
        if fmt == "modelopt" and quant.weight_strategy == "nvfp4" and fused == 0:
            with pytest.raises(CheckpointError, match="non-finite"):  # ModelOpt: 0/0 block scales
                export_checkpoint(tmp / "src", tmp / "out", spec, format=fmt, calibration=amax)
            return
        export_checkpoint(tmp / "src", tmp / "out", spec, format=fmt, calibration=amax)
        ckpt = load_checkpoint(tmp / "out")
        assert ckpt.format == fmt and sorted(ckpt) == sorted(NAMES) and ckpt.warnings == []
        for n, w in ws.items():
            layer = ckpt[n]
            assert layer.quant == quant and layer.scheme["recipe"] == recipe
            if quant.weight_strategy in ("nvfp4", "mx"):
                kw = {"amax": fused} if quant.weight_strategy == "nvfp4" else {}
                ref = quantize(w, QuantArgs(format=quant.weight_fmt, granularity=quant.weight_strategy),
                               recipe=recipe, **kw)
                assert _bits(layer.weight_scale_codes) == _bits(np.asarray(ref.scale_codes, np.uint8))
                if quant.global_scale:
                    assert _bits(np.asarray(layer.weight_global, np.float32).reshape(-1)) == _bits(ref.global_scale)
                if quant.input == "nvfp4":
                    g = nvfp4_producer_global(max(amax.values()), get_recipe(recipe), dtype)  # fused input amax
                    assert _bits(np.asarray(layer.input_scale, np.float32).reshape(-1)) == _bits(np.float32(g))
            else:
                ref = quantize(w, to_scheme(quant, recipe), recipe=recipe)
                assert _bits(np.asarray(layer.weight_scale, np.float32).reshape(-1)) == _bits(
                    np.asarray(ref.scale, np.float32).reshape(-1))
            assert _bits(layer.weight_codes) == _bits(ref.codes)
            x = np.random.default_rng(inp).standard_normal((2, inp)).astype(np.float32)
            y = layer.forward(x, out_dtype="float32")
            assert y.shape == (2, w.shape[0])
        write_checkpoint(ckpt, tmp / "again")
        assert (tmp / "again" / "model.safetensors").read_bytes() == (tmp / "out" / "model.safetensors").read_bytes()
        assert json.loads((tmp / "again" / "config.json").read_text()) == json.loads(
            (tmp / "out" / "config.json").read_text())
        assert load_checkpoint(tmp / "again")[NAMES[0]].quant == quant
