"""DeepSeek-V3-style ``quant_method: fp8`` with ``scale_fmt: ue8m0`` (issue #13) on a checkpoint
written by transformers 5.17.0's own Fp8Quantize (tools/make_fixture_ue8m0.py): F8_E8M0
``weight_scale_inv`` bytes, read as the multipliers 2**(b - 127); the power-of-two F32 form too."""

from __future__ import annotations

import json
import shutil
from fractions import Fraction
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from fp8ref.checkpoint import load_checkpoint, write_checkpoint
from fp8ref.checkpoint.forward import producer_weight
from fp8ref.errors import CheckpointError
from fp8ref.io.safetensors import open_store, write_safetensors

pytestmark = pytest.mark.interop

ROOT = Path(__file__).resolve().parents[1] / "fixtures" / "interop" / "checkpoints" / "hf_fp8_ue8m0"
Q = "model.layers.0.self_attn.q_proj"


def _raw(store, name: str) -> np.ndarray:
    return store.file_of(name).read_bytes(name)


def _ceil_log2(v: Fraction) -> int:
    e = v.numerator.bit_length() - v.denominator.bit_length()
    e = e if Fraction(2) ** e <= v else e - 1  # floor
    return e + (Fraction(2) ** e != v)


def test_loads_as_hf_fp8_block_with_e8m0_scales():
    ckpt = load_checkpoint(ROOT)
    assert ckpt.format == "hf-fp8" and ckpt.warnings == [] and len(ckpt) == 2
    store = open_store(ROOT / "model.safetensors")
    for layer in ckpt.values():
        assert layer.quant.describe() == "W float8_e4m3fn block[128, 128], input dynamic-group128"
        raw = _raw(store, layer.tensors["weight_scale"]).reshape(-1)
        assert store.info(layer.tensors["weight_scale"]).dtype == "F8_E8M0"
        assert [Fraction(float(v)) for v in layer.weight_scale.reshape(-1)] == [Fraction(2) ** (int(b) - 127)
                                                                                for b in raw]
    ckpt.validate_values()


def test_bytes_are_transformers_ue8m0_rule_from_the_original_weights():
    """byte = 127 + ceil(log2(fp32(1 / fp32(448 / amax)))) per 128x128 block, 127 (1.0) for a zero
    block; codes = e4m3(clamp(fp32(W) * 2**-k)) (exact product; ml_dtypes' cast as the peer)."""
    ref = load_file(ROOT / "reference_outputs.safetensors")
    store = open_store(ROOT / "model.safetensors")
    zero_blocks = 0
    for key in (k for k in ref if k.startswith("original.")):
        name = key.removeprefix("original.")
        w = ref[key].float().numpy()
        r, c = w.shape[0] // 128, w.shape[1] // 128
        amax = np.abs(w.reshape(r, 128, c, 128)).max(axis=(1, 3))
        want = np.full((r, c), 127)
        for (i, j), a in np.ndenumerate(amax):
            if a > 0:
                inv = np.float32(1.0) / (np.float32(448.0) / np.float32(a))
                want[i, j] = 127 + _ceil_log2(Fraction(float(inv)))
            else:
                zero_blocks += 1
        assert np.array_equal(_raw(store, f"{name}.weight_scale_inv").reshape(r, c), want)
        k = np.repeat(np.repeat(want - 127, 128, 0), 128, 1)
        codes = np.clip(w * np.ldexp(np.float32(1), -k), -448, 448).astype(np.float32).astype(ml_dtypes.float8_e4m3fn)
        assert np.array_equal(codes.view(np.uint8), store.get(f"{name}.weight").view(np.uint8))
    assert zero_blocks == 1


def test_producer_weight_equals_transformers_fp8_dequantize():
    ref = load_file(ROOT / "reference_outputs.safetensors")
    layer = load_checkpoint(ROOT)[Q]
    mine = torch.from_numpy(producer_weight(layer, "bfloat16")).to(torch.bfloat16)
    assert torch.equal(mine.view(torch.int16), ref[f"{Q}.dequantized"].view(torch.int16))


def _copy(tmp_path: Path, edit_tensors=None, edit_qc=None) -> Path:
    folder = tmp_path / "c"
    shutil.copytree(ROOT, folder)
    if edit_tensors:
        store = open_store(folder / "model.safetensors")
        tensors = {n: (store.info(n).dtype, _raw(store, n).reshape(store.info(n).shape)
                       if store.info(n).dtype == "F8_E8M0" else store.get(n)) for n in store}
        edit_tensors(tensors)
        write_safetensors(folder / "model.safetensors", tensors, {"format": "pt"})
    if edit_qc:
        config = json.loads((folder / "config.json").read_text())
        edit_qc(config["quantization_config"])
        (folder / "config.json").write_text(json.dumps(config))
    return folder


def _as_f32(t, factor=1.0):
    for n, (dt, a) in list(t.items()):
        if dt == "F8_E8M0":
            t[n] = ("F32", (np.ldexp(1.0, a.astype(np.int64) - 127) * factor).astype(np.float32))


def test_power_of_two_f32_scales_load_the_same(tmp_path):
    folder = _copy(tmp_path, _as_f32)
    ckpt = load_checkpoint(folder)
    assert ckpt.warnings == []
    x = np.random.default_rng(1).standard_normal((2, 256)).astype(np.float32)
    for n, layer in load_checkpoint(ROOT).items():
        assert np.array_equal(ckpt[n].dequantize("float32"), layer.dequantize("float32"))
        if n == Q:  # the reference forward reads E8M0 bytes as the same multipliers
            assert np.array_equal(ckpt[n].forward(x, out_dtype="float32").view(np.uint32),
                                  layer.forward(x, out_dtype="float32").view(np.uint32))


def test_non_power_of_two_scales_under_ue8m0_warn(tmp_path):
    ckpt = load_checkpoint(_copy(tmp_path, lambda t: _as_f32(t, 1.5)))
    assert len(ckpt.warnings) == 2 and "not powers of two" in ckpt.warnings[0]


def test_e8m0_scales_without_ue8m0_are_a_one_line_error(tmp_path):
    folder = _copy(tmp_path, edit_qc=lambda q: q.pop("scale_fmt"))
    with pytest.raises(CheckpointError, match=r"F8_E8M0 scales, but .*scale_fmt is not 'ue8m0'") as exc:
        load_checkpoint(folder)
    assert "\n" not in str(exc.value)


def test_unknown_scale_fmt_is_an_error(tmp_path):
    with pytest.raises(CheckpointError, match=r"scale_fmt: 'e5m2'; expected 'float' or 'ue8m0'"):
        load_checkpoint(_copy(tmp_path, edit_qc=lambda q: q.update(scale_fmt="e5m2")))


def test_rewrite_keeps_the_bytes_and_scale_fmt(tmp_path):
    write_checkpoint(load_checkpoint(ROOT), tmp_path / "out")
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == (ROOT / "model.safetensors").read_bytes()
    qc = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert qc == json.loads((ROOT / "config.json").read_text())["quantization_config"]
    assert load_checkpoint(tmp_path / "out").warnings == []


def test_e8m0_scales_do_not_travel_to_another_format(tmp_path):
    with pytest.raises(CheckpointError, match=r"F8_E8M0 \(ue8m0\) scales are kept only by hf-fp8"):
        write_checkpoint(load_checkpoint(ROOT), tmp_path / "ct", format="compressed-tensors")
    assert not (tmp_path / "ct").exists()
