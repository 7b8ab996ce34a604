"""The 2026 checkpoint formats (issue #13) on the committed real-tool fixtures: compressed-tensors
NVFP4 / NVFP4A16 / MXFP4 / MXFP8 (llm-compressor 0.14.0.1) and NVIDIA ModelOpt 0.47.0 FP8 /
FP8_PER_CHANNEL_PER_TOKEN / NVFP4 / MXFP8 exports (tools/make_fp4_mx_fixtures.py, FINDINGS-FP4-MX.md).

Load and validate; exact dequantization against a Fraction oracle; the producer forward against
compressed-tensors' reloaded layers (ModelOpt has no CPU loader: transformers 5.14.1 skips
``quant_method: modelopt``; its producer forward, its in-memory model, is test_modelopt_in_memory.py's);
rewrite and export from the original weights byte for byte; the declared scale semantics against the
stored tensors; bad files as one-line CheckpointErrors.
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

from fp8ref.checkpoint import base, export_checkpoint, load_checkpoint, write_checkpoint
from fp8ref.checkpoint.forward import producer_weight
from fp8ref.errors import CheckpointError
from fp8ref.io.safetensors import open_store, write_safetensors
from tests.support.checkpoint_builders import without_recipe_record
from tests.support.matmul_oracle import round_fraction

pytestmark = pytest.mark.interop

ROOT = Path(__file__).resolve().parents[1] / "fixtures" / "interop" / "checkpoints"
CT, MO = "compressed-tensors", "modelopt"
EXPECTED = {  # fixture -> (format, layout of every layer, spec and recipe that export it from the original weights)
    "llmc_nvfp4": (CT, "W float4_e2m1fn nvfp4 (global divisor), input nvfp4 float4_e2m1fn", "NVFP4",
                   "compressed-tensors-nvfp4"),
    "llmc_nvfp4a16": (CT, "W float4_e2m1fn nvfp4 (global divisor), input none",
                      {"bits": 4, "data_type": "nv_fp", "group_size": 16, "act_bits": 16}, "compressed-tensors-nvfp4"),
    "llmc_mxfp4": (CT, "W float4_e2m1fn mx, input mx float4_e2m1fn", "MXFP4", "compressed-tensors-mx"),
    "llmc_mxfp8": (CT, "W float8_e4m3fn mx, input mx", "MXFP8", "compressed-tensors-mx"),
    "modelopt_fp8": (MO, "W float8_e4m3fn tensor, input static", "FP8", "modelopt-fp8"),
    "modelopt_fp8_pc_pt": (MO, "W float8_e4m3fn channel, input dynamic-token", "FP8_DYNAMIC", "modelopt-fp8-pc"),
    "modelopt_nvfp4": (MO, "W float4_e2m1fn nvfp4 (global multiplier), input nvfp4 float4_e2m1fn", "NVFP4",
                       "modelopt-nvfp4"),
    "modelopt_mxfp8": (MO, "W float8_e4m3fn mx, input mx", "MXFP8", "modelopt-mxfp8"),
}
FIXTURES = sorted(EXPECTED)
CT_FIXTURES = [f for f in FIXTURES if EXPECTED[f][0] == CT]
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16)


@pytest.mark.parametrize("name", FIXTURES)
def test_fixture_loads_with_its_layout(name):
    fmt, layout, _, recipe = EXPECTED[name]
    ckpt = load_checkpoint(ROOT / name)
    assert ckpt.format == fmt and ckpt.dtype == "bfloat16" and ckpt.warnings == []
    assert len(ckpt) == 7 and {layer.quant.describe() for layer in ckpt.values()} == {layout}
    assert {layer.scheme["recipe"] for layer in ckpt.values()} == {recipe}
    assert "lm_head.weight" in ckpt.unquantized
    kv = {"model.layers.0.self_attn.k_proj.k_scale", "model.layers.0.self_attn.v_proj.v_scale"}
    assert set(ckpt.kv_scales) == (kv if name == "modelopt_fp8" else set())
    ckpt.validate_values()


# --- exact dequantization: decode(q) * s_b (* m or / g), rounded once, against Fractions --------

@pytest.mark.parametrize("name", FIXTURES)
def test_dequantize_is_the_exact_product_rounded_once(name):
    ckpt = load_checkpoint(ROOT / name)
    store = open_store(ROOT / name / "model.safetensors")
    layer = ckpt["model.layers.0.self_attn.k_proj"]  # holds the underflowing block
    t = layer.tensors
    raw = store.get(t["weight"])
    if layer.quant.packed:  # independent unpacking: low nibble first
        codes = np.stack([raw & 15, raw >> 4], -1).reshape(raw.shape[0], -1)
        values = [[(-1 if c & 8 else 1) * Fraction(E2M1[c & 7]) for c in row] for row in codes]
    else:
        values = [[Fraction(float(v)) for v in row] for row in raw.view(ml_dtypes.float8_e4m3fn).astype(np.float64)]
    s = store.get(t["weight_scale"])
    q = layer.quant
    if q.weight_strategy == "nvfp4":
        s = s.view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    elif q.weight_strategy == "mx":
        s = np.ldexp(1.0, s.astype(np.int64) - 127)
    s = np.asarray(s, np.float64)
    block = {"nvfp4": 16, "mx": 32}.get(q.weight_strategy)
    g = Fraction(float(store.get(t["weight_global"]).reshape(-1)[0])) if "weight_global" in t else None
    mine = layer.dequantize("bfloat16").astype(np.float64)
    for i, row in enumerate(values):
        for j, v in enumerate(row):
            sc = Fraction(float(s.reshape(-1)[0] if s.size == 1 else s[i] if s.ndim == 1 else s[i, j // block]))
            exact = v * sc if g is None else (v * sc / g if q.global_scale == "divisor" else v * sc * g)
            assert mine[i, j] == round_fraction(exact, "bfloat16"), (i, j)


# --- what compressed-tensors' own loader computes -----------------------------------------

@pytest.mark.parametrize("name", CT_FIXTURES)
def test_producer_forward_equals_compressed_tensors_reload(name):
    ref = load_file(ROOT / name / "reference_outputs.safetensors")
    ckpt = load_checkpoint(ROOT / name)
    probes = [k[: -len(".x")] for k in ref if k.endswith(".x")]
    assert len(probes) == 3
    for layer in probes:
        y = ckpt[layer].forward(ref[f"{layer}.x"], mode="producer")
        assert y.dtype == torch.bfloat16 and torch.equal(_bits(y), _bits(ref[f"{layer}.y"]))
        assert torch.equal(_bits(ref[f"{layer}.y"]), _bits(ref[f"{layer}.y_in_memory"]))  # CT writes what it runs


@pytest.mark.parametrize("name", CT_FIXTURES)
def test_reloaded_weight_is_the_fp32_product_rounded_to_bf16(name):
    """compressed-tensors decompresses D(fp32(decode(q) * fp32(s_b / g))): producer_weight."""
    ref = load_file(ROOT / name / "reference_outputs.safetensors")
    ckpt = load_checkpoint(ROOT / name)
    keys = [k for k in ref if k.endswith(".reloaded_weight")]
    assert keys
    for key in keys:
        layer = ckpt[key[: -len(".reloaded_weight")]]
        mine = torch.from_numpy(producer_weight(layer, "bfloat16")).to(torch.bfloat16)  # float32 holding bf16 values
        assert torch.equal(_bits(mine), _bits(ref[key]))


# --- bytes: rewrite, and export from the original weights ---------------------------------

def _config_without_provenance(folder: Path, fmt: str) -> tuple[dict, dict | None]:
    qc = json.loads((folder / "config.json").read_text())["quantization_config"]
    qc.pop("version", None)
    qc.pop("producer", None)
    if "ignore" in qc:  # ModelOpt also lists the embedding, which is no linear layer
        qc["ignore"] = [i for i in qc["ignore"] if i != "model.embed_tokens"]
    hf = folder / "hf_quant_config.json"
    hq = json.loads(hf.read_text()) if hf.exists() else None
    if hq is not None:
        hq.pop("producer")
        hq["quantization"]["exclude_modules"] = [m for m in hq["quantization"]["exclude_modules"]
                                                 if m != "model.embed_tokens"]
    return qc, hq


@pytest.mark.parametrize("name", FIXTURES)
def test_rewrite_reproduces_tool_bytes_and_config(name, tmp_path):
    write_checkpoint(load_checkpoint(ROOT / name), tmp_path / "out")
    ours = (tmp_path / "out" / "model.safetensors").read_bytes()
    assert ours == (ROOT / name / "model.safetensors").read_bytes()
    fmt = EXPECTED[name][0]
    assert _config_without_provenance(tmp_path / "out", fmt) == _config_without_provenance(ROOT / name, fmt)
    again = load_checkpoint(tmp_path / "out")
    assert again.format == fmt and again.warnings == []


def _original_source(name: str, folder: Path) -> dict[str, float]:
    """The model before quantization: the fixture's unquantized tensors plus its original bf16
    linears; returns the calibration the tool used (input amax; for compressed-tensors NVFP4 an
    amax that gives the stored input divisor, since the tool keeps only the divisor)."""
    store = open_store(ROOT / name / "model.safetensors")
    ref = open_store(ROOT / name / "reference_outputs.safetensors")
    tensors = {n: ("BF16", store.get(n)) for n in store if store.info(n).dtype == "BF16"}
    calibration = {}
    for n in ref:
        if n.startswith("original."):
            tensors[n.removeprefix("original.") + ".weight"] = ("BF16", ref.get(n))
        elif n.endswith(".in_memory_input_quantizer_amax"):
            calibration[n.removesuffix(".in_memory_input_quantizer_amax")] = float(ref.get(n).astype(np.float32)[()])
        elif n.endswith(".in_memory_input_global_scale") and name == "llmc_nvfp4":
            calibration[n.removesuffix(".in_memory_input_global_scale")] = float(np.float32(2688) / ref.get(n)[0])
    folder.mkdir()
    write_safetensors(folder / "model.safetensors", tensors, {"format": "pt"})
    config = json.loads((ROOT / name / "config.json").read_text())
    del config["quantization_config"]
    (folder / "config.json").write_text(json.dumps(config))
    return calibration


# the amax of ModelOpt's k_bmm_quantizer / v_bmm_quantizer on the fixture (bf16 key/value states; the tool
# stores only amax/448): the bf16 values whose fp32(amax / 448) are the stored k_scale / v_scale
MO_KV_AMAX = {"model.layers.0.self_attn.k_proj.output_amax": 3.703125,
              "model.layers.0.self_attn.v_proj.output_amax": 3.40625}


@pytest.mark.parametrize("name", FIXTURES)
def test_export_from_original_weights_reproduces_tool_bytes(name, tmp_path):
    fmt, _, scheme, recipe = EXPECTED[name]
    calibration = _original_source(name, tmp_path / "src")
    if name == "modelopt_fp8":  # with its KV-cache amax: k_proj.k_scale / v_proj.v_scale F32 [] too
        calibration.update(MO_KV_AMAX)
    export_checkpoint(tmp_path / "src", tmp_path / "out", {"scheme": scheme, "ignore": ["lm_head"]}, format=fmt,
                      recipe=recipe, calibration=calibration or None,
                      config_version="0.19" if fmt == CT else None)  # llm-compressor 0.14's writer
    assert _config_without_provenance(tmp_path / "out", fmt) == _config_without_provenance(ROOT / name, fmt)
    ours = without_recipe_record(tmp_path / "out" / "model.safetensors")  # the tool file, plus the record
    assert ours == (ROOT / name / "model.safetensors").read_bytes()


def _fp32_rne(v: Fraction) -> float:
    """Round a positive Fraction to float32 (normal range), ties to even (independent of fp8ref)."""
    e = v.numerator.bit_length() - v.denominator.bit_length()
    e = e if Fraction(2) ** e <= v else e - 1
    ulp = Fraction(2) ** (e - 23)
    n, r = divmod(v, ulp)
    n += 1 if r > ulp / 2 or (r == ulp / 2 and n % 2) else 0
    return float(n * ulp)


@settings(max_examples=25, deadline=None)
@given(k=st.floats(2.0**-20, 2.0**13, width=32), v=st.floats(2.0**-20, 2.0**13, width=32))
def test_modelopt_kv_export_round_trips(tmp_path_factory, k, v):
    """KV amax -> k_proj.k_scale / v_proj.v_scale F32 [] = fp32(amax / 448) (a Fraction oracle);
    loaded back as ModelOpt KV scales; written again byte for byte."""
    tmp = tmp_path_factory.mktemp("kv")
    calibration = _original_source("modelopt_fp8", tmp / "src")
    calibration.update({"model.layers.0.self_attn.k_scale": k, "model.layers.0.self_attn.v_scale": v})
    export_checkpoint(tmp / "src", tmp / "out", {"scheme": "FP8", "ignore": ["lm_head"]}, format=MO,
                      recipe="modelopt-fp8", calibration=calibration)
    ckpt = load_checkpoint(tmp / "out")
    assert ckpt.warnings == [] and set(ckpt.kv_scales) == {"model.layers.0.self_attn.k_proj.k_scale",
                                                           "model.layers.0.self_attn.v_proj.v_scale"}
    store = open_store(tmp / "out" / "model.safetensors")
    for which, amax in (("k", k), ("v", v)):
        name = f"model.layers.0.self_attn.{which}_proj.{which}_scale"
        assert store.info(name).dtype == "F32" and store.info(name).shape == ()
        assert float(store.get(name)) == _fp32_rne(Fraction(amax) / 448)
    write_checkpoint(ckpt, tmp / "again")
    assert (tmp / "again" / "model.safetensors").read_bytes() == (tmp / "out" / "model.safetensors").read_bytes()


@pytest.mark.parametrize("name", ["modelopt_nvfp4", "modelopt_fp8_pc_pt"])
def test_modelopt_checkpoints_convert_to_compressed_tensors_only_where_exact(name, tmp_path):
    ckpt = load_checkpoint(ROOT / name)
    if name == "modelopt_nvfp4":  # a multiplier global has no exact divisor
        with pytest.raises(CheckpointError, match="divisors"):
            write_checkpoint(ckpt, tmp_path / "ct", format=CT)
        return
    write_checkpoint(ckpt, tmp_path / "ct", format=CT)
    ct = load_checkpoint(tmp_path / "ct")
    assert not (tmp_path / "ct" / "hf_quant_config.json").exists()  # a stale ModelOpt config is not copied
    for n, layer in ckpt.items():
        assert np.array_equal(ct[n].dequantize("float32"), layer.dequantize("float32"))


# --- the declared scale semantics cover exactly what is stored ----------------------------

@pytest.mark.parametrize("name", FIXTURES)
def test_scale_declarations_describe_the_stored_tensors(name):
    ckpt = load_checkpoint(ROOT / name)
    decls = base.get(ckpt.format).scales
    for layer in ckpt.values():
        for role in ("weight_scale", "weight_global", "input_scale"):
            if role not in layer.tensors:
                continue
            tensor = layer.tensors[role][len(layer.name) + 1:]
            info = ckpt.store.info(layer.tensors[role])
            match = [d for d in decls if d.tensor == tensor and d.layout.split(" ")[0].rstrip(",").split("/")[0]
                     in (layer.quant.weight_strategy, "tensor")
                     and d.dtype.split(" ")[0] in (info.dtype, "D" if info.dtype == "BF16" else "")]
            assert match, (layer.name, role, tensor, info.dtype)
            meaning = {"multiplier": "multiplier", "divisor": "divisor"}.get(layer.quant.global_scale)
            if role == "weight_global" or (role == "input_scale" and layer.quant.input == "nvfp4"):
                assert {d.meaning for d in match} == {meaning}
            if role == "weight_scale" and layer.quant.weight_strategy == "mx":
                assert {d.meaning for d in match} == {"E8M0 exponent"}


def test_docs_scale_table_is_generated_from_the_declarations():
    doc = (Path(__file__).resolve().parents[2] / "docs" / "checkpoints.md").read_text()
    begin, end = "<!-- scale-table: generated by fp8ref.checkpoint.base.scale_table() -->\n", "<!-- /scale-table -->"
    assert begin in doc and end in doc
    assert doc.split(begin, 1)[1].split(end, 1)[0] == base.scale_table()


# --- bad files: one-line errors naming the file and the tensor ----------------------------

def _broken(tmp_path: Path, name: str, edit) -> Path:
    folder = tmp_path / name
    shutil.copytree(ROOT / name, folder)
    store = open_store(folder / "model.safetensors")
    tensors = {n: (store.info(n).dtype, store.get(n)) for n in store}
    edit(tensors)
    write_safetensors(folder / "model.safetensors", tensors, {"format": "pt"})
    return folder


Q = "model.layers.0.self_attn.q_proj"


def _set(name, dtype=None, value=None, drop=False):
    def edit(t):
        if drop:
            del t[name]
            return
        dt, a = t[name]
        a = a.copy() if value is None else value(a.copy())
        t[name] = (dtype or dt, a)
    return edit


def _nan_byte(a):
    a.reshape(-1)[3] = 0x7F
    return a


def _e8m0_nan(a):
    a.reshape(-1)[1] = 0xFF
    return a


@pytest.mark.parametrize("name,edit,match", [
    ("llmc_nvfp4", _set(f"{Q}.weight_scale", "U8"), r"weight_scale'?: dtype U8, expected F8_E4M3"),
    ("llmc_nvfp4", _set(f"{Q}.weight_global_scale", drop=True), r"missing tensor '.*q_proj.weight_global_scale'"),
    ("llmc_nvfp4", _set(f"{Q}.weight_scale", value=_nan_byte), r"weight_scale': 1 of 256 scale values .*\(NaN\)"),
    ("llmc_nvfp4", _set(f"{Q}.weight_global_scale", value=lambda a: a * 0), r"weight_global_scale': 1 of 1 .*\(zero\)"),
    ("llmc_nvfp4", _set(f"{Q}.weight_packed", value=lambda a: a[:, :16]),
     r"weight_scale'?: shape \[64, 4\] does not fit"),
    ("llmc_mxfp4", _set(f"{Q}.weight_scale", value=_e8m0_nan), r"weight_scale': 1 of 128 scale values .*\(NaN\)"),
    ("llmc_mxfp8", _set(f"{Q}.weight", "U8"), r"q_proj.weight_scale': unexpected tensor"),  # U8 weight: no layer
    ("modelopt_nvfp4", _set(f"{Q}.weight_scale_2", value=lambda a: a.reshape(1, 1)), r"weight_scale_2'?: F32 \[1, 1\]"),
    ("modelopt_nvfp4", _set(f"{Q}.input_scale", drop=True), r"missing tensor '.*q_proj.input_scale'"),
    ("modelopt_fp8_pc_pt", _set(f"{Q}.weight_scale", value=lambda a: a.reshape(64, 1)), r"shape \[64, 1\] does not"),
    ("modelopt_fp8", _set("model.layers.0.self_attn.k_proj.k_scale", value=lambda a: -a), r"k_scale': .*\(negative\)"),
])
def test_bad_tensors_are_one_line_errors(tmp_path, name, edit, match):
    folder = _broken(tmp_path, name, edit)
    with pytest.raises(CheckpointError, match=match) as exc:
        load_checkpoint(folder)
    message = str(exc.value)
    assert "\n" not in message and str(folder / "model.safetensors") in message


@pytest.mark.parametrize("edit,match", [
    (lambda q: q.update(quant_algo="W4A8_AWQ"), r"quantization_config.quant_algo: 'W4A8_AWQ'; fp8ref reads FP8"),
    (lambda q: q.update(ignore=["model.layers.0.self_attn.q_proj"]),
     r"q_proj.weight'?: quantized weight, but .*ignore lists"),
    (lambda q: q.update(ignore="lm_head"), r"quantization_config.ignore: expected a list"),
])
def test_bad_modelopt_configs_are_one_line_errors(tmp_path, edit, match):
    folder = tmp_path / "m"
    shutil.copytree(ROOT / "modelopt_nvfp4", folder)
    config = json.loads((folder / "config.json").read_text())
    edit(config["quantization_config"])
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=match) as exc:
        load_checkpoint(folder)
    assert "\n" not in str(exc.value) and "config.json" in str(exc.value)


def test_bad_compressed_tensors_fp4_config_is_an_error(tmp_path):
    folder = tmp_path / "c"
    shutil.copytree(ROOT / "llmc_nvfp4", folder)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"] = 32
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"config_groups.group_0.weights: 4-bit tensor_group group_size 32"):
        load_checkpoint(folder)


# --- fp8ref's exports read by compressed-tensors itself (interop env only) ----------------

@pytest.mark.parametrize("scheme,recipe", [
    ("NVFP4", "compressed-tensors-nvfp4"),
    ({"bits": 4, "data_type": "nv_fp", "group_size": 16, "act_bits": 16}, "compressed-tensors-nvfp4"),
    ("MXFP4", "compressed-tensors-mx"), ("MXFP8", "compressed-tensors-mx")],
    ids=["NVFP4", "NVFP4A16", "MXFP4", "MXFP8"])
def test_compressed_tensors_loads_fp8ref_block_exports(tmp_path, scheme, recipe, monkeypatch):
    pytest.importorskip("compressed_tensors")
    transformers = pytest.importorskip("transformers")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=128, max_position_embeddings=64,
                                   tie_word_embeddings=False)
    transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(tmp_path / "src")
    layers = [f"model.layers.0.{n}" for n in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                                "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")]
    export_checkpoint(tmp_path / "src", tmp_path / "out", {"scheme": scheme, "ignore": ["lm_head"]}, format=CT,
                      recipe=recipe, calibration={n: 2.0 + i / 8 for i, n in enumerate(layers)})
    ckpt = load_checkpoint(tmp_path / "out")
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.bfloat16)
    with torch.no_grad():
        model(torch.tensor([[1, 2, 3]]))  # compressed-tensors decompresses on the first forward
    modules = dict(model.named_modules())
    x = torch.randn(1, 3, 64, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    for name in layers:
        mod = modules[name]
        mine = torch.from_numpy(producer_weight(ckpt[name], "bfloat16")).to(torch.bfloat16)
        assert torch.equal(_bits(mod.weight.to(torch.bfloat16)), _bits(mine)), name
        if mod.in_features == 64:
            with torch.no_grad():
                assert torch.equal(_bits(mod(x)), _bits(ckpt[name].forward(x, mode="producer"))), name
