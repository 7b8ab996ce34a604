"""export -> load is lossless against the in-memory reference, in every format.

For random layer shapes (block and group sizes that do not divide them included), schemes,
recipes, model dtypes and values (zeros, +-dtype max, subnormals, sign mixes): the codes and
scales a checkpoint holds are bit-identical to ``fp8ref.quant.quantize`` in memory, the input
scale to the recipe's ``compute_scale`` of the calibrated amax, and ``forward(x)`` to
``fp8ref.matmul.linear`` on the in-memory result. Load -> write -> load is identical down to
the file bytes, and a format that cannot hold a scheme raises instead of writing.
"""

from __future__ import annotations

import dataclasses
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
from fp8ref.checkpoint.hf_fp8 import transformers_block_quirk
from fp8ref.checkpoint.layout import LayerQuant, to_scheme
from fp8ref.errors import CheckpointError
from fp8ref.formats import FORMATS
from fp8ref.io.safetensors import write_safetensors
from fp8ref.matmul import linear
from fp8ref.quant import as_args, quantize
from fp8ref.recipes import compute_scale
from fp8ref.registry import get_recipe

NP = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16, "float32": np.float32}
ST = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}
BLOCK = 16  # small blocks keep examples fast while still cutting shapes unevenly

# (format, storage layout, recipes whose producer implements it)
CASES = [
    ("compressed-tensors", LayerQuant("tensor", None, "static"), ("compressed-tensors", "fp8ref", "auto-round")),
    ("compressed-tensors", LayerQuant("channel", None, "dynamic-token"), ("compressed-tensors", "fp8ref")),
    ("compressed-tensors", LayerQuant("channel", None, "static"), ("auto-round", "compressed-tensors")),
    ("compressed-tensors", LayerQuant("block", (BLOCK, BLOCK), "dynamic-group", BLOCK),
     ("compressed-tensors", "fp8ref")),
    ("compressed-tensors", LayerQuant("tensor", None, "dynamic-tensor"), ("compressed-tensors",)),
    ("auto-round", LayerQuant("channel", None, "static"), ("auto-round", "compressed-tensors", "fp8ref")),
    ("hf-fp8", LayerQuant("block", (BLOCK, BLOCK), "dynamic-group", BLOCK), ("hf-fp8", "fp8ref",
                                                                          "compressed-tensors")),
    ("hf-fp8", LayerQuant("tensor", None, "static"), ("hf-fp8", "fp8ref")),
]


@st.composite
def weights(draw, dtype: str):
    out = draw(st.integers(1, 40))
    inp = draw(st.integers(1, 40))
    info = np.finfo(NP[dtype]) if dtype != "bfloat16" else ml_dtypes.finfo(ml_dtypes.bfloat16)
    special = [0.0, -0.0, float(info.max), -float(info.max), float(info.smallest_subnormal),
               -float(info.smallest_subnormal), float(info.smallest_normal), 1.0, -3.5]
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((out, inp)) * 2.0 ** draw(st.integers(-20, 10))).astype(NP[dtype])
    n_special = draw(st.integers(0, min(6, out * inp)))
    idx = rng.choice(out * inp, size=n_special, replace=False)
    w.reshape(-1)[idx] = np.array([special[i % len(special)] for i in rng.integers(0, len(special), n_special)],
                                  dtype=NP[dtype])
    if draw(st.booleans()):
        w[rng.integers(0, out)] = 0  # an all-zero row: the zero-amax rule of each recipe
    return w


def _write_source(folder: Path, layers: dict[str, np.ndarray], dtype: str) -> None:
    folder.mkdir()
    tensors = {f"{n}.weight": (ST[dtype], w) for n, w in layers.items()}
    tensors["model.norm.weight"] = (ST[dtype], np.ones(8, NP[dtype]))
    write_safetensors(folder / "model.safetensors", tensors, {"format": "pt"})
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "dtype": dtype}))
    (folder / "tokenizer.json").write_text('{"kept": true}')


def _bits(a) -> bytes:
    return np.ascontiguousarray(np.asarray(a)).tobytes()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_export_load_is_bit_identical_to_quantize(data):
    fmt, quant, recipes = data.draw(st.sampled_from(CASES), label="case")
    recipe = data.draw(st.sampled_from(recipes), label="recipe")
    dtype = data.draw(st.sampled_from(sorted(NP)), label="dtype")
    w = data.draw(weights(dtype), label="weight")
    scheme = to_scheme(quant, recipe)
    name = "model.layers.0.mlp.up_proj"
    amax = data.draw(st.sampled_from([0.0, 1.0, 3.0e-5, 448.0, 12345.678]), label="amax")
    rec = get_recipe(recipe)
    divisible = not quant.block or (w.shape[0] % BLOCK == 0 and w.shape[1] % BLOCK == 0)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        _write_source(tmp / "src", {name: w}, dtype)
        if rec.require_divisible and not divisible:
            with pytest.raises(CheckpointError, match="divide"):
                export_checkpoint(tmp / "src", tmp / "out", {"scheme": scheme}, format=fmt,
                                  calibration={name: amax})
            assert not (tmp / "out").exists()
            return
        ref = quantize(w, dataclasses.replace(as_args(scheme), dynamic=True), recipe=recipe)
        ref_scale = np.asarray(ref.scale).astype(np.float32)
        if not (np.isfinite(ref_scale) & (ref_scale > 0)).all():
            # e.g. hf-fp8 on a subnormal weight: fp32(448/amax) = inf, so weight_scale_inv = 0
            with pytest.raises(CheckpointError, match="a dequantization scale must be > 0 and finite"):
                export_checkpoint(tmp / "src", tmp / "out", {"scheme": scheme}, format=fmt,
                                  calibration={name: amax})
            assert not (tmp / "out").exists()
            return
        export_checkpoint(tmp / "src", tmp / "out", {"scheme": scheme}, format=fmt, calibration={name: amax})
        ckpt = load_checkpoint(tmp / "out")
        assert ckpt.format == fmt and list(ckpt) == [name]
        layer = ckpt[name]
        flagged = fmt == "auto-round" and np.asarray(layer.input_scale).astype(np.float32).reshape(-1)[0] == 1
        # hf-fp8 warns where transformers' reload would take other blocks than the declared ones (a grid
        # of scales that divides the weight in other blocks: [1, 18] in 16x16 blocks is read as 1x9)
        quirk = (fmt == "hf-fp8" and bool(quant.block)
                 and transformers_block_quirk(*w.shape, tuple(quant.block)) is not None)
        expected = [(True, False)] * bool(flagged) + [(False, True)] * quirk  # #1390: an input_scale of 1.0
        assert [("#1390" in w, "Fp8Dequantize" in w) for w in ckpt.warnings] == expected
        assert layer.quant == quant

        assert _bits(layer.weight_codes) == _bits(ref.codes)
        stored = np.asarray(layer.weight_scale).astype(np.float32)
        assert stored.size == np.asarray(ref.scale).size
        assert _bits(stored.reshape(-1)) == _bits(np.asarray(ref.scale).astype(np.float32).reshape(-1))
        in_scale = None
        if quant.input == "static":
            in_scale, _ = compute_scale(np.array([amax]), rec, FORMATS["float8_e4m3fn"], dtype)
            assert _bits(np.asarray(layer.input_scale).astype(np.float32).reshape(-1)) == _bits(
                np.asarray(in_scale, np.float32).reshape(-1))

        # forward: the layer as loaded == linear() on the in-memory quantization
        rng = np.random.default_rng(w.shape[0] * 41 + w.shape[1])
        x = (rng.standard_normal((3, w.shape[1])) * 4).astype(np.float32)
        kw = {"block_k": quant.block[1] if quant.block else BLOCK, "block_n": quant.block[0] if quant.block else 128}
        expect = linear(x, ref.codes, np.asarray(ref.scale).astype(np.float32),
                        input_scale=None if in_scale is None else np.asarray(in_scale, np.float32),
                        dynamic=None if quant.input == "static" else quant.input.removeprefix("dynamic-"),
                        out_dtype="float32", **kw)
        got = layer.forward(x, out_dtype="float32")
        assert _bits(got) == _bits(expect)

        # unquantized tensors and other files are copied untouched
        assert _bits(ckpt.tensor("model.norm.weight")) == _bits(np.ones(8, NP[dtype]))
        assert (tmp / "out" / "tokenizer.json").read_text() == '{"kept": true}'

        # load -> write -> load: same tensors, same bytes
        write_checkpoint(ckpt, tmp / "again")
        assert (tmp / "again" / "model.safetensors").read_bytes() == (tmp / "out" / "model.safetensors").read_bytes()
        again = load_checkpoint(tmp / "again")
        assert again[name].quant == quant and len(again.warnings) == len(ckpt.warnings)
        assert json.loads((tmp / "again" / "config.json").read_text()) == json.loads(
            (tmp / "out" / "config.json").read_text())


UNEXPRESSIBLE = [
    ("auto-round", LayerQuant("tensor", None, "static")),
    ("auto-round", LayerQuant("channel", None, "dynamic-token")),
    ("auto-round", LayerQuant("block", (BLOCK, BLOCK), "dynamic-group", BLOCK)),
    ("hf-fp8", LayerQuant("channel", None, "static")),
    ("hf-fp8", LayerQuant("block", (BLOCK, BLOCK), "dynamic-group", 8)),
    ("hf-fp8", LayerQuant("tensor", None, "dynamic-token")),
    ("compressed-tensors", LayerQuant("tensor", None, "static", weight_fmt="float8_e5m2")),
]


@pytest.mark.parametrize("fmt,quant", UNEXPRESSIBLE, ids=lambda v: str(v))
def test_format_refuses_what_it_cannot_express(tmp_path, fmt, quant):
    _write_source(tmp_path / "src", {"model.layers.0.mlp.up_proj": np.ones((32, 32), ml_dtypes.bfloat16)},
                  "bfloat16")
    with pytest.raises(CheckpointError, match="cannot express"):
        export_checkpoint(tmp_path / "src", tmp_path / "out", {"scheme": to_scheme(quant, "fp8ref")}, format=fmt,
                          calibration={"model.layers.0.mlp.up_proj": 1.0})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


@settings(max_examples=25, deadline=None)
@given(case=st.sampled_from([c for c in CASES if c[0] == "compressed-tensors" and c[1].input == "static"
                             and c[1].weight_strategy == "channel"]),
       dtype=st.sampled_from(["bfloat16", "float16"]), seed=st.integers(0, 1000))
def test_cross_format_conversion_keeps_codes_and_scales(case, dtype, seed):
    """auto-round <-> compressed-tensors (what auto-round's llm_compressor export does): the
    same codes and scale values, only names and scale shapes change."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((24, 20)).astype(NP[dtype])
    name = "model.layers.1.self_attn.o_proj"
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        _write_source(tmp / "src", {name: w}, dtype)
        export_checkpoint(tmp / "src", tmp / "ar", {"scheme": "FP8_STATIC"}, format="auto-round",
                          calibration={name: 2.5})
        ar = load_checkpoint(tmp / "ar")
        write_checkpoint(ar, tmp / "ct", format="compressed-tensors")
        ct = load_checkpoint(tmp / "ct")
        assert ct.format == "compressed-tensors" and ct[name].weight_scale.shape == (24, 1)
        assert _bits(ct[name].weight_codes) == _bits(ar[name].weight_codes)
        assert _bits(ct[name].weight_scale) == _bits(ar[name].weight_scale)
        assert _bits(ct[name].input_scale) == _bits(ar[name].input_scale)
        write_checkpoint(ct, tmp / "ar2", format="auto-round")
        assert (tmp / "ar2" / "model.safetensors").read_bytes() == (tmp / "ar" / "model.safetensors").read_bytes()
