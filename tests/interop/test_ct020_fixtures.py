"""compressed-tensors 0.20.1 on its own fixtures (tools/make_ct020_fixtures.py: the wheel's presets,
calculate_qparams, compressors and config writer on CPU): MXFP6A16, MXFP6A8 (E2M3 weights packed four
codes in three bytes), MXFP4XFP8 (MXFP4 weights, FP8 inputs per 1 x 128) and FP8.

Load with the right layout; every code and scale byte re-derived from the original weights by recipe
``compressed-tensors-mx-0.20`` (export and verify); the config as 0.20.1 writes it (``version`` aside);
dequantization against compressed-tensors' own decompressor; bad packed bytes as one-line errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from fp8ref.checkpoint import export_checkpoint, load_checkpoint, write_checkpoint
from fp8ref.errors import CheckpointError
from fp8ref.io.safetensors import open_store, write_safetensors
from fp8ref.nn.verify import verify
from fp8ref.producers.compressed_tensors import to_ct_config
from fp8ref.spec import load_spec_dict
from tests.support.checkpoint_builders import without_recipe_record

pytestmark = pytest.mark.interop

ROOT = Path(__file__).resolve().parents[1] / "fixtures" / "interop" / "checkpoints"
EXPECTED = {  # fixture -> (preset, layout of every layer, recipe)
    "ct020_mxfp6a16": ("MXFP6A16", "W float6_e2m3fn mx, input none", "compressed-tensors-mx-0.20"),
    "ct020_mxfp6a8": ("MXFP6A8", "W float6_e2m3fn mx, input mx", "compressed-tensors-mx-0.20"),
    "ct020_mxfp4xfp8": ("MXFP4XFP8", "W float4_e2m1fn mx, input dynamic-group128", "compressed-tensors-mx"),
    "ct020_mxfp8": ("MXFP8", "W float8_e4m3fn mx, input mx", "compressed-tensors-mx"),
    "ct020_fp8": ("FP8", "W float8_e4m3fn tensor, input static", "compressed-tensors"),
}
FIXTURES = sorted(EXPECTED)
MX = [f for f in FIXTURES if f != "ct020_fp8"]


def _tool_config(name: str) -> dict:
    qc = json.loads((ROOT / name / "config.json").read_text())["quantization_config"]
    assert qc.pop("version") == "0.20.1"  # compressed-tensors' own version: fp8ref does not claim to be it
    return qc


def _original_source(name: str, folder: Path) -> dict[str, float]:
    """The model before quantization (the fixture's unquantized tensors and its original bf16 linears)
    and the calibrated input amax of each layer with a static input scale."""
    store = open_store(ROOT / name / "model.safetensors")
    ref = open_store(ROOT / name / "reference_outputs.safetensors")
    tensors = {n: ("BF16", store.get(n)) for n in store
               if store.info(n).dtype == "BF16" and not n.endswith(("_scale", "_zero_point"))}
    calibration = {}
    for n in ref:
        if n.startswith("original."):
            tensors[n.removeprefix("original.") + ".weight"] = ("BF16", ref.get(n))
        elif n.endswith(".input_amax"):
            calibration[n.removesuffix(".input_amax")] = float(np.asarray(ref.get(n), np.float32)[0])
    folder.mkdir()
    write_safetensors(folder / "model.safetensors", tensors, {"format": "pt"})
    config = json.loads((ROOT / name / "config.json").read_text())
    del config["quantization_config"]
    (folder / "config.json").write_text(json.dumps(config))
    return calibration


@pytest.mark.parametrize("name", FIXTURES)
def test_fixture_loads_with_its_layout(name):
    ckpt = load_checkpoint(ROOT / name)
    assert ckpt.format == "compressed-tensors" and ckpt.warnings == []
    assert len(ckpt) == 7
    assert {ckpt[n].quant.describe() for n in ckpt} == {EXPECTED[name][1]}
    assert {ckpt[n].scheme["recipe"] for n in ckpt} == {EXPECTED[name][2]}


@pytest.mark.parametrize("name", FIXTURES)
def test_config_writer_of_0_20_writes_what_compressed_tensors_0_20_1_writes(name):
    spec = load_spec_dict({"scheme": EXPECTED[name][0], "ignore": ["lm_head"]})
    assert to_ct_config(spec, version="0.20") == _tool_config(name)
    assert to_ct_config(spec) == _tool_config(name)  # the newest is the default
    if name == "ct020_fp8":  # the same scheme as 0.19 writes it: every key, no moe_sparsity_config
        old = to_ct_config(spec, version="0.19")
        assert "moe_sparsity_config" not in old and old["config_groups"]["group_0"]["weights"]["observer"] == \
            "memoryless_minmax"


@pytest.mark.parametrize("name", FIXTURES)
def test_export_from_original_weights_reproduces_tool_bytes(name, tmp_path):
    preset, _, recipe = EXPECTED[name]
    calibration = _original_source(name, tmp_path / "src")
    export_checkpoint(tmp_path / "src", tmp_path / "out", {"scheme": preset, "ignore": ["lm_head"]},
                      calibration=calibration or None, recipe=recipe)
    qc = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert qc == _tool_config(name)
    ours = without_recipe_record(tmp_path / "out" / "model.safetensors")
    assert ours == (ROOT / name / "model.safetensors").read_bytes()
    again = load_checkpoint(tmp_path / "out")
    assert {again[n].scheme["recipe"] for n in again} == {recipe}


@pytest.mark.parametrize("name", FIXTURES)
def test_rewrite_keeps_bytes_and_the_0_20_config(name, tmp_path):
    write_checkpoint(load_checkpoint(ROOT / name), tmp_path / "out")
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == (ROOT / name / "model.safetensors").read_bytes()
    qc = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert qc == _tool_config(name)


@pytest.mark.parametrize("name", MX)
def test_verify_names_the_recipe(name, tmp_path):
    _original_source(name, tmp_path / "src")
    res = verify(load_checkpoint(ROOT / name), load_checkpoint(tmp_path / "src"))
    assert res["ok"], res["mismatched_layers"]
    assert res["recipes"] == {EXPECTED[name][2]: 7}
    assert {x["recipe_source"] for x in res["layers"]} == {"discovered"}


@pytest.mark.parametrize("name", MX)
def test_dequantize_equals_compressed_tensors_decompressor(name):
    ckpt = load_checkpoint(ROOT / name)
    ref = open_store(ROOT / name / "reference_outputs.safetensors")
    probes = [n.removesuffix(".qdq_weight") for n in ref if n.endswith(".qdq_weight")]
    assert len(probes) == 2
    for layer in probes:
        ours = np.asarray(ckpt.dequantize(layer, "bfloat16")).view(np.uint16)
        assert np.array_equal(ours, np.asarray(ref.get(f"{layer}.qdq_weight")).view(np.uint16))


def test_packed_fp6_of_a_bad_length_is_one_error_naming_the_tensor(tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(ROOT / "ct020_mxfp6a16", bad)
    store = open_store(bad / "model.safetensors")
    name = "model.layers.0.mlp.down_proj.weight_packed"
    tensors = {n: (store.info(n).dtype, store.get(n)) for n in store}
    tensors[name] = ("U8", np.asarray(store.get(name))[:, :-1])  # 95 bytes a row: not whole quads
    (bad / "model.safetensors").unlink()
    write_safetensors(bad / "model.safetensors", tensors, {"format": "pt"})
    with pytest.raises(CheckpointError, match=rf"{name}.*not a multiple of 3") as e:
        load_checkpoint(bad)
    assert "\n" not in str(e.value)


def test_cli_on_a_bad_fp6_pack_prints_one_error_line_and_writes_nothing(tmp_path, capsys):
    from fp8ref.cli import main

    bad = tmp_path / "bad"
    shutil.copytree(ROOT / "ct020_mxfp6a8", bad)
    store = open_store(bad / "model.safetensors")
    name = "model.layers.0.self_attn.q_proj.weight_packed"
    tensors = {n: (store.info(n).dtype, store.get(n)) for n in store}
    tensors[name] = ("U8", np.asarray(store.get(name))[:, :47])  # 47 bytes a row
    (bad / "model.safetensors").unlink()
    write_safetensors(bad / "model.safetensors", tensors, {"format": "pt"})
    for argv in (["inspect", str(bad)], ["convert", str(bad), str(tmp_path / "out"), "--format", "compressed-tensors"]):
        assert main(argv) != 0
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("fp8ref: error: ") and "model.safetensors" in err[0], err
        assert f"tensor '{name}'" in err[0] and "not a multiple of 3" in err[0]
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("name", FIXTURES)
def test_producer_forward_equals_compressed_tensors_0_20_reload(name):
    """transformers 5.17 + compressed-tensors 0.20.1 reloading the fixture (its <probe>.y): producer mode
    bit for bit. Where compressed-tensors cannot run a layer (MXFP4XFP8's 1 x 128 input groups on K = 64:
    its unflatten raises), producer mode refuses it, naming why."""
    import torch

    ckpt = load_checkpoint(ROOT / name)
    ref = open_store(ROOT / name / "reference_outputs.safetensors")

    def bf16(n):
        return torch.from_numpy(np.asarray(ref.get(n)).view(np.int16).copy()).view(torch.bfloat16)

    probes = [n.removesuffix(".x") for n in ref if n.endswith(".x")]
    ran = 0
    for layer in probes:
        x = bf16(f"{layer}.x")
        if f"{layer}.y" not in ref:
            assert name == "ct020_mxfp4xfp8" and ckpt[layer].shape[1] % 128
            with pytest.raises(CheckpointError, match="needs the input width 64 to be a multiple of 128"):
                ckpt[layer].forward(x, mode="producer")
            continue
        y = ckpt[layer].forward(x, mode="producer")
        assert torch.equal(y.view(torch.int16), bf16(f"{layer}.y").view(torch.int16)), layer
        ran += 1
    assert ran == (1 if name == "ct020_mxfp4xfp8" else 3)
