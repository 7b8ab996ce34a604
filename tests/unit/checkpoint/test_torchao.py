"""torchao Float8 checkpoints (fp8ref.checkpoint.torchao) and the ``torchao-float8`` recipe.

Evidence: tests/fixtures/torchao, written by torchao 0.18.0's own Float8Tensor.from_hp and
flatten_tensor_state_dict on CPU, with the config transformers' TorchAoConfig writes
(tools/make_torchao_fixtures.py); torchao's dequantization (fp32(q) * s, then bf16) written out
here with ml_dtypes.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fp8ref.checkpoint import load_checkpoint
from fp8ref.errors import CheckpointError
from fp8ref.io.safetensors import SafetensorsFile, save
from fp8ref.nn.verify import verify
from tests.support.cli import run_cli

FIX = Path(__file__).resolve().parents[2] / "fixtures" / "torchao"


@pytest.mark.parametrize("folder, strategy, scale_shape", [("float8_row", "channel", (32, 1)),
                                                           ("float8_tensor", "tensor", (1, 1))])
def test_reads_torchao_float8_and_dequantizes_as_torchao(folder, strategy, scale_shape):
    ckpt = load_checkpoint(FIX / folder)
    f = SafetensorsFile(FIX / folder / "model.safetensors")
    assert ckpt.format == "torchao" and len(ckpt) == 4
    for name in ckpt:
        layer = ckpt[name]
        assert layer.quant.weight_strategy == strategy and layer.quant.input == {
            "channel": "dynamic-token", "tensor": "dynamic-tensor"}[strategy]
        q = f.get(f"{name}._weight_qdata").view(ml_dtypes.float8_e4m3fn).astype(np.float32)
        s = f.get(f"{name}._weight_scale")
        assert s.shape == scale_shape
        want = (q * s).astype(ml_dtypes.bfloat16)
        got = np.asarray(layer.dequantize("bfloat16"))
        assert np.array_equal(got.view(np.uint16), want.view(np.uint16)), name


@pytest.mark.parametrize("folder", ["float8_row", "float8_tensor"])
def test_verify_reproduces_every_code_and_scale(folder, capsys):
    res = verify(load_checkpoint(FIX / folder), load_checkpoint(FIX / "original"))
    assert res["ok"] and {x["recipe"] for x in res["layers"]} == {"torchao-float8"}
    assert sum(x["codes"] for x in res["layers"]) == 4 * 32 * 64
    assert run_cli("verify", FIX / folder, "--original", FIX / "original") == 0
    assert run_cli("inspect", FIX / folder) == 0
    assert "torchao" in capsys.readouterr().out


def test_compressed_tensors_recipe_differs_only_by_its_zero_rule():
    """Same scales and quotient as compressed-tensors' GPU path; CT-eager divides in bf16 and differs."""
    res = verify(load_checkpoint(FIX / "float8_row"), load_checkpoint(FIX / "original"), recipe="compressed-tensors")
    assert not res["ok"]


def test_zero_row_nan_is_named():
    with pytest.raises(CheckpointError, match=r"pytorch/ao #4713") as info:
        load_checkpoint(FIX / "float8_row_zero")
    assert "model.layers.0.mlp.up_proj._weight_scale" in str(info.value) and "first row 0" in str(info.value)
    f = SafetensorsFile(FIX / "float8_row_zero" / "model.safetensors")
    codes = f.get("model.layers.0.mlp.up_proj._weight_qdata")
    assert (codes[0] == 0xFF).all()  # what torchao wrote: NaN


def _with_metadata(tmp_path: Path, edit) -> Path:
    dst = tmp_path / "ckpt"
    shutil.copytree(FIX / "float8_row", dst)
    f = SafetensorsFile(dst / "model.safetensors")
    tensors = {n: f.get(n) for n in f.tensors}
    meta = dict(f.metadata)
    edit(meta)
    (dst / "model.safetensors").unlink()
    save(dst / "model.safetensors", tensors, meta)
    return dst


KEY = "model.layers.0.mlp.up_proj.weight"
HOSTILE = {
    "malformed JSON": (lambda m: m.update({KEY: "{not json"}), "malformed JSON"),
    "unknown subclass": (lambda m: m.update({KEY: json.dumps({"_type": "os.system", "_data": {}})}),
                         "unknown torchao tensor subclass 'os.system'"),
    "MXTensor": (lambda m: m.update({KEY: json.dumps({"_type": "MXTensor", "_data": {}})}), "an MXTensor needs"),
    "bad block size": (lambda m: m.update({KEY: m[KEY].replace('"block_size": [1, 64]', '"block_size": [2, 64]')}),
                       "block_size"),
    "not an object": (lambda m: m.update({KEY: "[1, 2]"}), "expected a JSON object"),
    "description missing": (lambda m: m.pop(KEY), "no torchao tensor description"),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_metadata_is_one_error_line(tmp_path, capsys, case):
    edit, words = HOSTILE[case]
    ckpt = _with_metadata(tmp_path, edit)
    with pytest.raises(CheckpointError, match=words):
        load_checkpoint(ckpt)
    capsys.readouterr()
    assert run_cli("inspect", ckpt) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("fp8ref: error:") and "model.safetensors" in err[0]


# --- writing -----------------------------------------------------------------------------------

def _spec(preset: str) -> dict:
    """The preset with torchao's recipe; FP8 (per tensor) with dynamic per-tensor inputs, as torchao's PerTensor."""
    from fp8ref.scheme import PRESETS

    d = PRESETS[preset].to_dict()
    d.update(recipe="torchao-float8", act_dynamic=True)
    return {"scheme": d}


@pytest.mark.parametrize("preset, folder", [("FP8_DYNAMIC", "float8_row"), ("FP8", "float8_tensor")])
def test_export_writes_torchaos_tensors_descriptions_and_config(tmp_path, preset, folder):
    import fp8ref

    out = fp8ref.export_checkpoint(FIX / "original", tmp_path / "o", _spec(preset), format="torchao")
    mine, tool = SafetensorsFile(out / "model.safetensors"), SafetensorsFile(FIX / folder / "model.safetensors")
    assert sorted(mine.tensors) == sorted(tool.tensors)
    for n in tool.tensors:
        assert mine.get(n).tobytes() == tool.get(n).tobytes(), n
    for key, value in tool.metadata.items():
        if key == "tensor_names":
            assert sorted(json.loads(mine.metadata[key])) == sorted(json.loads(value))
        else:
            assert mine.metadata[key] == value, key
    ours = json.loads((out / "config.json").read_text())["quantization_config"]
    assert ours == json.loads((FIX / folder / "config.json").read_text())["quantization_config"]


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2 ** 32 - 1), rows=st.integers(1, 5), cols=st.integers(1, 40),
       dtype=st.sampled_from(["bfloat16", "float16", "float32"]))
def test_export_load_export_is_byte_identical(tmp_path_factory, seed, rows, cols, dtype):
    import fp8ref
    from fp8ref.checkpoint import write_checkpoint
    from fp8ref.rounding import round_to

    tmp = tmp_path_factory.mktemp("rt")
    rng = np.random.default_rng(seed)
    w = round_to(rng.standard_normal((rows, cols)) * 0.1 + 0.01, dtype)
    w = w.astype(ml_dtypes.bfloat16) if dtype == "bfloat16" else w.astype(dtype)
    (tmp / "src").mkdir()
    save(tmp / "src" / "model.safetensors", {"m.proj.weight": w})
    (tmp / "src" / "config.json").write_text(json.dumps({"torch_dtype": dtype}))
    a = fp8ref.export_checkpoint(tmp / "src", tmp / "a", _spec("FP8_DYNAMIC"), format="torchao")
    b = write_checkpoint(load_checkpoint(a), tmp / "b")
    for name in ("model.safetensors", "config.json"):
        assert (Path(a) / name).read_bytes() == (Path(b) / name).read_bytes(), name
