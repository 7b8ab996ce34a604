"""``fp8ref explain CKPT --engine vllm``: the declared load-time steps and their exact effect,
checked against independent element-wise oracles (numpy float16 / ml_dtypes casts) on the
committed fixtures (the numbers FINDINGS-FP4-MX.md §8 reports: k/v 98.6 % / 98.8 %, up 99.7 %)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from fp8ref.checkpoint import load_checkpoint
from fp8ref.checkpoint.engine import explain, load_engine
from fp8ref.errors import Fp8RefError
from fp8ref.io.safetensors import open_store, write_safetensors
from tests.support.cli import run_cli

ROOT = Path(__file__).resolve().parents[2] / "fixtures" / "interop" / "checkpoints"
L = "model.layers.0."
FN, FNUZ = ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e4m3fnuz


def test_fnuz_reinterpretation_with_doubled_scale_keeps_every_value_but_0x80():
    codes = np.arange(256, dtype=np.uint8)
    fn = codes.view(FN).astype(np.float64)
    fnuz = codes.view(FNUZ).astype(np.float64) * 2
    finite = ~np.isnan(fn)
    assert np.isnan(fnuz[0x80]) and fn[0x80] == 0  # the one code the step rewrites
    keep = finite & (codes != 0x80)
    assert np.array_equal(fn[keep], fnuz[keep])


def _requant_oracle(codes: np.ndarray, s: np.float32, s_max: np.float32):
    old = codes.view(FN).astype(np.float64) * np.float64(s)
    v16 = old.astype(np.float16).astype(np.float32)  # numpy's double -> half is correctly rounded
    x = np.clip(v16 * np.float32(np.float32(1) / s_max), -448, 448).astype(np.float32)
    new_codes = x.astype(FN).view(np.uint8)
    new = new_codes.view(FN).astype(np.float64) * np.float64(s_max)
    return int((new_codes != codes).sum()), int((new != old).sum()), float(np.abs(new - old).max())


@pytest.mark.parametrize("name", ["modelopt_fp8", "quark_fp8"])
def test_requantize_fused_shards_matches_the_oracle(name):
    ckpt = load_checkpoint(ROOT / name)
    _, steps, effects = explain(ckpt, "vllm", target="cuda")
    assert [s.name for s in steps] == ["requantize-fused-shards-to-max-scale", "nvfp4-global-divisor-max-inversion",
                                       "moe-input-scale-merge", "nvfp4-moe-w13-gate-global"]
    rows = {e.layer: e for e in effects if e.step == "requantize-fused-shards-to-max-scale"}
    assert sorted(rows) == sorted(L + n for n in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                                  "mlp.gate_proj", "mlp.up_proj"))
    store = open_store(ROOT / name / "model.safetensors")
    for group in (["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"], ["mlp.gate_proj", "mlp.up_proj"]):
        s = {n: np.float32(np.asarray(store.get(f"{L}{n}.weight_scale")).astype(np.float32)) for n in group}
        s_max = max(s.values())
        for n in group:
            e = rows[L + n]
            want = _requant_oracle(store.get(f"{L}{n}.weight").view(np.uint8), s[n], s_max)
            assert (e.codes_changed, e.values_changed, e.max_abs_change) == want, n
    assert (rows[L + "self_attn.k_proj"].values_changed, rows[L + "self_attn.v_proj"].values_changed) == (2019, 2024)


def test_fnuz_runs_only_for_mi300_and_counts_0x80():
    ckpt = load_checkpoint(ROOT / "modelopt_fp8")
    cuda = explain(ckpt, target="cuda")[2]
    mi300 = explain(ckpt, target="rocm-mi300")[2]
    assert not any(e.step == "e4m3fn-to-e4m3fnuz" for e in cuda)
    rows = [e for e in mi300 if e.step == "e4m3fn-to-e4m3fnuz"]
    store = open_store(ROOT / "modelopt_fp8" / "model.safetensors")
    assert len(rows) == 7 and all(e.values_changed == 0 for e in rows)
    for e in rows:
        assert e.codes_changed == int((store.get(e.layer + ".weight").view(np.uint8) == 0x80).sum()) > 0


def _edited(tmp_path, name, edit, renames=None) -> Path:
    folder = tmp_path / name
    shutil.copytree(ROOT / name, folder)
    store = open_store(folder / "model.safetensors")
    tensors = {n: (store.info(n).dtype, np.array(store.get(n))) for n in store}
    edit(tensors)
    for old, new in (renames or {}).items():
        tensors = {n.replace(old, new): v for n, v in tensors.items()}
    write_safetensors(folder / "model.safetensors", tensors, {"format": "pt"})
    return folder


def test_nvfp4_divisor_max_scales_the_smaller_shards(tmp_path):
    k = L + "self_attn.k_proj"

    def halve(t):
        dt, a = t[k + ".weight_global_scale"]
        t[k + ".weight_global_scale"] = (dt, (a / 2).astype(np.float32))
    ckpt = load_checkpoint(_edited(tmp_path, "llmc_nvfp4", halve))
    assert [e for e in explain(load_checkpoint(ROOT / "llmc_nvfp4"))[2]] == []  # llm-compressor shares g
    rows = {e.layer: e for e in explain(ckpt)[2]}
    assert sorted(rows) == [k, L + "self_attn.q_proj", L + "self_attn.v_proj"]
    assert rows[L + "self_attn.q_proj"].values_changed == 0
    layer = ckpt[k]
    nib = layer.weight_codes
    vals = np.array([0, .5, 1, 1.5, 2, 3, 4, 6])[nib & 7] * np.where(nib & 8, -1, 1)
    sb = np.repeat(layer.weight_scale_codes.view(FN).astype(np.float64), 16, axis=1)
    g = np.float64(np.asarray(layer.weight_global).reshape(-1)[0])
    diff = np.abs(vals * sb / (2 * g) - vals * sb / g)
    assert rows[k].values_changed == int((vals != 0).sum()) and rows[k].max_abs_change == diff.max()


def test_moe_input_scales_merge_to_the_max_multiplier(tmp_path):
    up = L + "mlp.up_proj"

    def double(t):
        dt, a = t[up + ".input_scale"]
        t[up + ".input_scale"] = (dt, np.array(a * 2))
    folder = _edited(tmp_path, "modelopt_fp8", double, {"mlp.gate_proj": "mlp.experts.0.proj",
                                                        "mlp.up_proj": "mlp.experts.1.proj"})
    rows = [e for e in explain(load_checkpoint(folder))[2] if e.step == "moe-input-scale-merge"]
    assert len(rows) == 1 and rows[0].layer == L + "mlp.experts.*.proj" and (rows[0].values_changed,
                                                                              rows[0].elements) == (1, 2)


def test_cli_explain_json_and_errors(capsys):
    assert run_cli("explain", ROOT / "quark_fp8", "--engine", "vllm", "--json", "-") == 0
    out = json.loads(capsys.readouterr().out)
    assert out["engine"] == "vllm" and out["verified"] is False and len(out["effects"]) == 5
    assert run_cli("explain", ROOT / "quark_fp8", "--target", "rocm-mi300") == 0
    assert "codes changed 11/2048" in capsys.readouterr().out  # k_proj's 0x80 codes
    assert run_cli("explain", ROOT / "quark_fp8", "--engine", "sglangx") != 0
    err = capsys.readouterr().err
    assert "unknown engine 'sglangx'" in err and err.strip().count("\n") == 0


def test_engine_spec_is_strict():
    meta, steps = load_engine("vllm")
    assert meta["verified"] is False and all(s.source for s in steps)
    with pytest.raises(Fp8RefError):
        load_engine("nope")


def test_equal_shard_scales_are_requantized_too(tmp_path):
    """vLLM 0.33.0's requantize_with_max_scale skips only a weight stored fused: shards stored apart with
    equal scales still go through fp16(q * s) * fp32(1 / s), and their rows say what that changes."""
    group = [L + n for n in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")]

    def same(t):
        for n in group[1:]:
            t[n + ".weight_scale"] = t[group[0] + ".weight_scale"]
    ckpt = load_checkpoint(_edited(tmp_path, "modelopt_fp8", same))
    rows = {e.layer: e for e in explain(ckpt, "vllm", target="cuda")[2]
            if e.step == "requantize-fused-shards-to-max-scale"}
    store = open_store(tmp_path / "modelopt_fp8" / "model.safetensors")
    s = np.float32(np.asarray(store.get(group[0] + ".weight_scale")).astype(np.float32))
    for n in group:
        want = _requant_oracle(store.get(n + ".weight").view(np.uint8), s, s)
        assert (rows[n].codes_changed, rows[n].values_changed, rows[n].max_abs_change) == want, n
