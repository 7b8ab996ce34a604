"""AMD Quark 0.13 checkpoints (issue #13) on the committed real-tool fixtures quark_fp8 and
quark_mxfp4 (tools/make_fp4_mx_fixtures.py, FINDINGS-FP4-MX.md §4).

Load and validate; dequantization against a Fraction oracle; the producer forward against
Quark's own reloaded layers (transformers 5.24's quark integration, ``QParamsLinear`` on CPU);
rewrite and export from the original weights byte for byte; the recipes against every stored
byte; bad files as one-line CheckpointErrors.
"""

from __future__ import annotations

import json
import shutil
from fractions import Fraction
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

from fp8ref.checkpoint import export_checkpoint, load_checkpoint, write_checkpoint
from fp8ref.errors import CheckpointError
from fp8ref.io.safetensors import open_store, write_safetensors
from fp8ref.quant import QuantArgs, quantize
from tests.support.checkpoint_builders import without_recipe_record
from tests.support.matmul_oracle import round_fraction

pytestmark = pytest.mark.interop

ROOT = Path(__file__).resolve().parents[1] / "fixtures" / "interop" / "checkpoints"
EXPECTED = {  # fixture -> (layout of every layer, recipe, scheme exporting it from the original weights)
    "quark_fp8": ("W float8_e4m3fn tensor, input static", "quark-fp8", "FP8"),
    "quark_mxfp4": ("W float4_e2m1fn mx, input mx float4_e2m1fn", "quark-mxfp4", "MXFP4"),
}
FIXTURES = sorted(EXPECTED)
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
L = "model.layers.0."
KV = {L + "self_attn.k_proj.output_scale", L + "self_attn.v_proj.output_scale"}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16)


@pytest.mark.parametrize("name", FIXTURES)
def test_fixture_loads_with_its_layout(name):
    layout, recipe, _ = EXPECTED[name]
    ckpt = load_checkpoint(ROOT / name)
    assert ckpt.format == "quark" and ckpt.dtype == "bfloat16" and ckpt.warnings == []
    assert len(ckpt) == 7 and {layer.quant.describe() for layer in ckpt.values()} == {layout}
    assert {layer.scheme["recipe"] for layer in ckpt.values()} == {recipe}
    assert "lm_head.weight" in ckpt.unquantized
    assert set(ckpt.kv_scales) == (KV if name == "quark_fp8" else set())
    ckpt.validate_values()


def test_fp8_scales_are_bf16_scalars_and_kv_scales_shared():
    store = open_store(ROOT / "quark_fp8" / "model.safetensors")
    for n in store:
        if n.endswith("_scale"):
            assert (store.info(n).dtype, store.info(n).shape) == ("BF16", ())
    k, v = (np.asarray(store.get(n), np.float32) for n in sorted(KV))
    assert k == v  # export.kv_cache_group


# --- exact dequantization against Fractions ------------------------------------------------

@pytest.mark.parametrize("name", FIXTURES)
def test_dequantize_is_the_exact_product_rounded_once(name):
    ckpt = load_checkpoint(ROOT / name)
    store = open_store(ROOT / name / "model.safetensors")
    layer = ckpt[L + "self_attn.k_proj"]
    raw = store.get(layer.tensors["weight"])
    s = store.get(layer.tensors["weight_scale"])
    if name == "quark_mxfp4":  # independent unpacking: low nibble first; E8M0 bytes 2**(b - 127)
        codes = np.stack([raw & 15, raw >> 4], -1).reshape(raw.shape[0], -1)
        values = [[(-1 if c & 8 else 1) * Fraction(E2M1[c & 7]) for c in row] for row in codes]
        scale = [[Fraction(2) ** (int(b) - 127) for b in row] for row in s]
    else:
        values = [[Fraction(float(v)) for v in row] for row in raw.view(ml_dtypes.float8_e4m3fn).astype(np.float64)]
        scale = Fraction(float(np.asarray(s, np.float32)))
    mine = layer.dequantize("bfloat16").astype(np.float64)
    for i, row in enumerate(values):
        for j, v in enumerate(row):
            sc = scale[i][j // 32] if name == "quark_mxfp4" else scale
            assert mine[i, j] == round_fraction(v * sc, "bfloat16"), (i, j)


# --- every stored byte from the original weights, by the recipes -------------------------

@pytest.mark.parametrize("name", FIXTURES)
def test_recipe_reproduces_every_code_and_scale(name):
    _, recipe, _ = EXPECTED[name]
    store = open_store(ROOT / name / "model.safetensors")
    ref = load_file(ROOT / name / "reference_outputs.safetensors")
    mx = name == "quark_mxfp4"
    args = QuantArgs(format="float4_e2m1fn", granularity="mx") if mx else QuantArgs(format="float8_e4m3fn")
    originals = [k for k in ref if k.startswith("original.")]
    assert len(originals) == 7
    for key in originals:
        lin = key.removeprefix("original.")
        r = quantize(ref[key], args, recipe=recipe)
        codes = np.asarray(r.codes)
        if mx:
            codes = codes[:, 0::2] | (codes[:, 1::2] << 4)  # low nibble = even element
            assert np.array_equal(np.asarray(r.scale_codes), store.get(lin + ".weight_scale"))
            assert not np.any(np.asarray(r.codes) == 8)  # Quark writes no -0 nibble
        else:
            stored = torch.from_numpy(store.get(lin + ".weight_scale").view(np.int16)).view(torch.bfloat16)
            assert torch.equal(_bits(r.scale.reshape(())), _bits(stored))
        assert np.array_equal(codes.astype(np.uint8), store.get(lin + ".weight").view(np.uint8)), lin


def test_quark_mxfp4_zero_blocks_store_byte_1():
    store = open_store(ROOT / "quark_mxfp4" / "model.safetensors")
    ref = load_file(ROOT / "quark_mxfp4" / "reference_outputs.safetensors")
    w = ref["original." + L + "mlp.down_proj"].float().numpy()
    zero = np.abs(w.reshape(w.shape[0], -1, 32)).max(-1) == 0
    assert zero.sum() == 4 and set(store.get(L + "mlp.down_proj.weight_scale")[zero].tolist()) == {1}


# --- what Quark's own loader computes -------------------------------------------------------

@pytest.mark.parametrize("name", FIXTURES)
def test_producer_forward_equals_quark_reload(name):
    ref = load_file(ROOT / name / "reference_outputs.safetensors")
    ckpt = load_checkpoint(ROOT / name)
    probes = [k[: -len(".x")] for k in ref if k.endswith(".x")]
    assert len(probes) == 3
    for layer in probes:
        y = ckpt[layer].forward(ref[f"{layer}.x"], mode="producer")
        assert y.dtype == torch.bfloat16 and torch.equal(_bits(y), _bits(ref[f"{layer}.y"])), layer
        if f"{layer}.y_in_memory" in ref:  # FP8: Quark writes what it runs
            assert torch.equal(_bits(ref[f"{layer}.y"]), _bits(ref[f"{layer}.y_in_memory"]))


def test_k_proj_output_is_fake_quantized_with_its_kv_scale():
    """Without the output quantizer the k_proj probe differs: the KV-cache QDQ is part of the layer."""
    from fp8ref.checkpoint.forward import producer_weight
    from fp8ref.checkpoint.quark import emulate

    ref = load_file(ROOT / "quark_fp8" / "reference_outputs.safetensors")
    layer = load_checkpoint(ROOT / "quark_fp8")[L + "self_attn.k_proj"]
    x = ref[L + "self_attn.k_proj.x"]
    w, x32 = emulate(layer, producer_weight(layer, "bfloat16"), x.float().numpy(), "bfloat16")
    plain = torch.nn.functional.linear(torch.from_numpy(x32).bfloat16(), torch.from_numpy(w).bfloat16())
    assert not torch.equal(_bits(plain), _bits(ref[L + "self_attn.k_proj.y"]))


# --- bytes: rewrite, and export from the original weights ---------------------------------

def _qc(folder: Path) -> dict:
    return json.loads((folder / "config.json").read_text())["quantization_config"]


@pytest.mark.parametrize("name", FIXTURES)
def test_rewrite_reproduces_tool_bytes_and_config(name, tmp_path):
    write_checkpoint(load_checkpoint(ROOT / name), tmp_path / "out")
    ours = (tmp_path / "out" / "model.safetensors").read_bytes()
    assert ours == (ROOT / name / "model.safetensors").read_bytes()
    assert _qc(tmp_path / "out") == _qc(ROOT / name)
    again = load_checkpoint(tmp_path / "out")
    assert again.format == "quark" and again.warnings == []


def _original_source(name: str, folder: Path) -> dict[str, float]:
    """The model before quantization, and an input amax per layer that gives the stored BF16
    input scale (Quark keeps only the scale: bf16(fp32(amax) / 448) of amax = s * 448 is s)."""
    store = open_store(ROOT / name / "model.safetensors")
    ref = open_store(ROOT / name / "reference_outputs.safetensors")
    tensors = {n: ("BF16", store.get(n)) for n in store if store.info(n).dtype == "BF16" and not n.endswith("_scale")}
    for n in ref:
        if n.startswith("original."):
            tensors[n.removeprefix("original.") + ".weight"] = ("BF16", ref.get(n))
    calibration = {n.removesuffix(".input_scale"): float(np.float32(store.get(n).astype(np.float32)) * 448)
                   for n in store if n.endswith(".input_scale")}
    folder.mkdir()
    write_safetensors(folder / "model.safetensors", tensors, {"format": "pt"})
    config = json.loads((ROOT / name / "config.json").read_text())
    del config["quantization_config"]
    (folder / "config.json").write_text(json.dumps(config))
    return calibration


# KV-cache amax for quark_fp8 (Quark keeps only the shared scale bf16(fp32(amax) / 448) = 0.0091553): a bf16
# k amax giving that scale, and a smaller v amax (export.kv_cache_group stores the larger scale for both)
QUARK_KV_AMAX = {L + "self_attn.k_proj.output_amax": 4.09375, L + "self_attn.v_proj.output_amax": 3.5}


@pytest.mark.parametrize("name", FIXTURES)
def test_export_from_original_weights_reproduces_tool_bytes(name, tmp_path):
    _, recipe, scheme = EXPECTED[name]
    calibration = _original_source(name, tmp_path / "src")
    if name == "quark_fp8":
        calibration.update(QUARK_KV_AMAX)
    spec = {"scheme": scheme if scheme != "MXFP4" else {"bits": 4, "data_type": "mx_fp", "group_size": 32,
                                                         "act_bits": 4, "act_data_type": "mx_fp"},
            "ignore": ["lm_head"]}
    export_checkpoint(tmp_path / "src", tmp_path / "out", spec, format="quark", recipe=recipe,
                      calibration=calibration or None)
    assert _qc(tmp_path / "out") == _qc(ROOT / name)
    ours = without_recipe_record(tmp_path / "out" / "model.safetensors")  # the tool file, plus the record
    assert ours == (ROOT / name / "model.safetensors").read_bytes()


@settings(max_examples=25, deadline=None)
@given(k=st.floats(2.0**-10, 2.0**13, width=16), v=st.floats(2.0**-10, 2.0**13, width=16))
def test_kv_export_round_trips_with_one_shared_scale(tmp_path_factory, k, v):
    """KV amax -> k_proj/v_proj.output_scale BF16 [] = max over k, v of bf16(fp32(amax) / 448) (a
    Fraction oracle); loaded back as Quark KV scales without warnings; written again byte for byte."""
    tmp = tmp_path_factory.mktemp("kv")
    calibration = _original_source("quark_fp8", tmp / "src")
    calibration.update({L + "self_attn.k_scale": k, L + "self_attn.v_scale": v})
    export_checkpoint(tmp / "src", tmp / "out", {"scheme": "FP8", "ignore": ["lm_head"]}, format="quark",
                      recipe="quark-fp8", calibration=calibration)
    ckpt = load_checkpoint(tmp / "out")
    assert ckpt.warnings == [] and set(ckpt.kv_scales) == KV
    assert _qc(tmp / "out") == _qc(ROOT / "quark_fp8")
    store = open_store(tmp / "out" / "model.safetensors")
    want = max(_rne(_rne(Fraction(a), 23) / 448, 7) for a in (k, v))
    for name in KV:
        assert store.info(name).dtype == "BF16" and store.info(name).shape == ()
        assert Fraction(float(np.asarray(store.get(name), np.float32))) == want
    write_checkpoint(ckpt, tmp / "again")
    assert (tmp / "again" / "model.safetensors").read_bytes() == (tmp / "out" / "model.safetensors").read_bytes()


def _rne(v: Fraction, mantissa: int) -> Fraction:
    """A positive Fraction rounded to ``mantissa`` fraction bits (normal range), ties to even."""
    e = v.numerator.bit_length() - v.denominator.bit_length()
    e = e if Fraction(2) ** e <= v else e - 1
    ulp = Fraction(2) ** (e - mantissa)
    n, r = divmod(v, ulp)
    return (n + (1 if r > ulp / 2 or (r == ulp / 2 and n % 2) else 0)) * ulp


# --- bad files: one-line errors naming the file ---------------------------------------------

def _broken_config(tmp_path: Path, name: str, edit) -> Path:
    folder = tmp_path / name
    shutil.copytree(ROOT / name, folder)
    config = json.loads((folder / "config.json").read_text())
    edit(config["quantization_config"])
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("name,edit,match", [
    ("quark_fp8", lambda q: q["global_quant_config"]["weight"].update(dtype="int8"),
     r"global_quant_config.weight: dtype 'int8' qscheme 'per_tensor'; fp8ref reads"),
    ("quark_fp8", lambda q: q.update(exclude=["*q_proj"]), r"q_proj.weight'?: quantized weight, but .*exclude lists"),
    ("quark_fp8", lambda q: q.update(layer_quant_config={}), r"k_proj.output_scale'?: an output scale, but"),
    ("quark_mxfp4", lambda q: q["global_quant_config"]["weight"].update(scale_calculation_mode="floor"),
     r"weight.scale_calculation_mode: 'floor'; fp8ref reads Quark's default 'even'"),
    ("quark_mxfp4", lambda q: q["global_quant_config"]["weight"].update(group_size=16), r"group_size: 16"),
    ("quark_mxfp4", lambda q: q.update(layer_type_quant_config={"Linear": {}}), r"layer_type_quant_config"),
])
def test_bad_configs_are_one_line_errors(tmp_path, name, edit, match):
    folder = _broken_config(tmp_path, name, edit)
    with pytest.raises(CheckpointError, match=match) as exc:
        load_checkpoint(folder)
    assert "\n" not in str(exc.value) and str(folder) in str(exc.value)


def test_bad_scale_is_a_one_line_error(tmp_path):
    folder = tmp_path / "q"
    shutil.copytree(ROOT / "quark_fp8", folder)
    store = open_store(folder / "model.safetensors")
    tensors = {n: (store.info(n).dtype, store.get(n)) for n in store}
    dt, a = tensors[L + "self_attn.q_proj.weight_scale"]
    tensors[L + "self_attn.q_proj.weight_scale"] = (dt, np.array(-a))
    write_safetensors(folder / "model.safetensors", tensors, {"format": "pt"})
    with pytest.raises(CheckpointError, match=r"q_proj.weight_scale': .*\(negative\)") as exc:
        load_checkpoint(folder).validate_values()
    assert "\n" not in str(exc.value)


def test_weight_only_quark_layers_load_but_are_not_written(tmp_path):
    def weight_only(q):
        q["global_quant_config"]["input_tensors"] = None
    folder = _broken_config(tmp_path, "quark_mxfp4", weight_only)
    ckpt = load_checkpoint(folder)
    assert {layer.quant.describe() for layer in ckpt.values()} == {"W float4_e2m1fn mx, input none"}
    ref = load_file(ROOT / "quark_mxfp4" / "reference_outputs.safetensors")
    x = ref[L + "self_attn.q_proj.x"]
    y = ckpt[L + "self_attn.q_proj"].forward(x, mode="producer")  # the input is not quantized
    w = torch.from_numpy(ckpt[L + "self_attn.q_proj"].dequantize("bfloat16").astype(np.float32)).bfloat16()
    assert torch.equal(_bits(y), _bits(torch.nn.functional.linear(x, w)))
    with pytest.raises(CheckpointError, match="fp8ref writes Quark FP8"):
        write_checkpoint(ckpt, tmp_path / "out")
