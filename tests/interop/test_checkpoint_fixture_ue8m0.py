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
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

from fp8ref.checkpoint import load_checkpoint, write_checkpoint
from fp8ref.checkpoint.forward import producer_weight
from fp8ref.errors import CheckpointError
from fp8ref.io.safetensors import open_store, write_safetensors
from tests.support.checkpoint_builders import without_recipe_record

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


# --- export: fp8ref writes ue8m0 (recipe hf-fp8-ue8m0; F8_E8M0 bytes or F32 powers of two) -----------

def _original(tmp_path: Path) -> Path:
    """The fixture's two layers before quantization (transformers quantized these bf16 weights)."""
    ref = open_store(ROOT / "reference_outputs.safetensors")
    folder = tmp_path / "src"
    folder.mkdir()
    write_safetensors(folder / "model.safetensors", {n.removeprefix("original.") + ".weight": ("BF16", ref.get(n))
                                                     for n in ref if n.startswith("original.")}, {"format": "pt"})
    config = json.loads((ROOT / "config.json").read_text())
    del config["quantization_config"]
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def _spec(scale_dtype: str) -> dict:
    """FP8_BLOCK (128x128 weights, dynamic 1x128 inputs) with the given scale_dtype."""
    return {"scheme": {"bits": 8, "group_size": [128, 128], "data_type": "fp", "act_bits": 8, "act_group_size": 128,
                       "act_data_type": "fp", "act_dynamic": True, "scale_dtype": scale_dtype}}


def test_export_from_original_weights_reproduces_transformers_bytes(tmp_path):
    from fp8ref.checkpoint import export_checkpoint

    export_checkpoint(_original(tmp_path), tmp_path / "out", _spec("float8_e8m0fnu"), format="hf-fp8",
                      recipe="hf-fp8-ue8m0")
    assert without_recipe_record(tmp_path / "out" / "model.safetensors") == (ROOT / "model.safetensors").read_bytes()
    qc = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert qc == json.loads((ROOT / "config.json").read_text())["quantization_config"]


def test_export_with_f32_power_of_two_scales(tmp_path):
    """scale_dtype float32: the same multipliers as F32 powers of two, the same codes, scale_fmt ue8m0."""
    from fp8ref.checkpoint import export_checkpoint

    export_checkpoint(_original(tmp_path), tmp_path / "out", _spec("float32"),
                      format="hf-fp8", recipe="hf-fp8-ue8m0")
    ckpt, theirs = load_checkpoint(tmp_path / "out"), load_checkpoint(ROOT)
    assert ckpt.warnings == [] and ckpt.quantization_config["scale_fmt"] == "ue8m0"
    store = open_store(tmp_path / "out" / "model.safetensors")
    for n, layer in theirs.items():
        assert store.info(layer.tensors["weight_scale"]).dtype == "F32"
        assert np.array_equal(ckpt[n].weight_codes, layer.weight_codes)
        assert np.array_equal(ckpt[n].dequantize("float32").view(np.uint32),
                              layer.dequantize("float32").view(np.uint32))


def test_pow2_rule_is_torch_ceil_log2_for_every_exponent():
    """scaling.pow2_exponent against torch.ceil(torch.log2(s)) (what Fp8Quantize runs) on every float32
    exponent: the window above 2**e where float32 log2 rounds down to e, and random significands."""
    from fp8ref.scaling import _LOG2_DOWN, pow2_exponent

    frac = np.abs(_LOG2_DOWN - np.round(_LOG2_DOWN))[_LOG2_DOWN > 0.5]
    assert frac.min() > 1e-3  # the float64 bounds decide every integer step exactly
    rng = np.random.default_rng(13)
    for e in range(-126, 128):
        base = np.ldexp(np.float32(1), e).astype(np.float32).view(np.uint32)
        steps = np.concatenate([np.arange(int(_LOG2_DOWN[e + 126]) + 4), rng.integers(0, 1 << 23, 64)])
        s = (base + steps.astype(np.uint32)).view(np.float32)
        s = s[np.isfinite(s)]
        want = torch.ceil(torch.log2(torch.from_numpy(s))).numpy().astype(np.int64)
        assert np.array_equal(pow2_exponent(s), want), e


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows=st.sampled_from([128, 256]), cols=st.sampled_from([128, 384]), seed=st.integers(0, 2**32 - 1),
       e8m0=st.booleans(), zero_block=st.booleans())
def test_ue8m0_export_load_round_trip_is_bit_exact(tmp_path_factory, rows, cols, seed, e8m0, zero_block):
    """Random bf16 weights (heavy-tailed, maybe an all-zero block) -> export ue8m0 -> load: every scale a
    power of two equal to torch's 2**ceil(log2(fp32(1 / (448 * fp32(1 / amax))))) per block, codes the
    peer cast of W * 2**-k, and write_checkpoint gives the same bytes again."""
    from fp8ref.checkpoint import export_checkpoint

    tmp = tmp_path_factory.mktemp("ue8m0")
    rng = np.random.default_rng(seed)
    w = (rng.standard_t(3, (rows, cols)) * 10.0 ** rng.uniform(-6, 3)).astype(np.float32)
    if zero_block:
        w[:128, :128] = 0
    wt = torch.from_numpy(w).to(torch.bfloat16)
    (tmp / "src").mkdir()
    bf16 = wt.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    write_safetensors(tmp / "src" / "model.safetensors", {"layer.weight": ("BF16", bf16)}, {"format": "pt"})
    spec = _spec("float8_e8m0fnu" if e8m0 else "float32")
    export_checkpoint(tmp / "src", tmp / "out", spec, format="hf-fp8", recipe="hf-fp8-ue8m0")
    layer = load_checkpoint(tmp / "out")["layer"]
    w32 = wt.float()
    amax = w32.reshape(rows // 128, 128, cols // 128, 128).abs().amax(dim=(1, 3))
    safe = torch.where(amax > 0, amax, torch.ones_like(amax))
    inv = (1.0 / torch.where(amax > 0, 448.0 / safe, torch.ones_like(amax))).to(torch.float32)
    want = torch.pow(2.0, torch.ceil(torch.log2(inv.clamp(min=torch.finfo(torch.float32).tiny))))
    assert np.array_equal(layer.weight_scale.astype(np.float32), want.numpy())
    k = torch.repeat_interleave(torch.repeat_interleave(want, 128, 0), 128, 1)
    codes = torch.clamp(w32 * (1.0 / k), -448, 448).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    assert np.array_equal(layer.weight_codes, codes)
    write_checkpoint(load_checkpoint(tmp / "out"), tmp / "again")
    assert (tmp / "again" / "model.safetensors").read_bytes() == (tmp / "out" / "model.safetensors").read_bytes()
