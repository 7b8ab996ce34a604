"""Per-head attention scales (llm-compressor's attn_head: q_scale [n_heads, 1, 1], k_scale /
v_scale [n_kv_heads, 1, 1]) checked against config.json's head counts at load: a count that
disagrees is one ``fp8ref: error:`` line naming the tensor, and nothing is written."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.numpy import load_file, save_file

import fp8ref
from fp8ref.errors import CheckpointError
from tests.support.cli import run_cli

FIXTURE = Path(__file__).resolve().parents[2] / "fixtures" / "interop" / "checkpoints" / "llmc_fp8_attn_head"
K0 = "model.layers.0.self_attn.k_scale"


def _copy(tmp_path, edit=None, config_edit=None) -> Path:
    out = tmp_path / "ckpt"
    shutil.copytree(FIXTURE, out)
    tensors = load_file(str(out / "model.safetensors"))
    if edit:
        edit(tensors)
        save_file(tensors, str(out / "model.safetensors"))
    if config_edit:
        cfg = json.loads((out / "config.json").read_text())
        config_edit(cfg)
        (out / "config.json").write_text(json.dumps(cfg))
    return out


def test_the_fixture_loads_with_per_head_scales():
    ckpt = fp8ref.load_checkpoint(FIXTURE)
    assert sorted(ckpt.kv_scales) == [f"model.layers.{i}.self_attn.{w}_scale" for i in range(2) for w in "kv"]
    assert ckpt.tensor(K0).shape == (2, 1, 1)


@pytest.mark.parametrize("shape", [(3, 1, 1), (4, 1, 1), (2, 2, 1), (1, 2), (4,)])
def test_a_head_count_the_config_does_not_have_is_one_error_line(tmp_path, capsys, shape):
    def edit(t):
        t[K0] = np.full(shape, 0.01, np.float32)

    out = _copy(tmp_path, edit)
    before = sorted(p.name for p in out.iterdir())
    assert run_cli("inspect", out) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("fp8ref: error: ") and K0 in err[0], err
    assert "num_key_value_heads 2" in err[0] and "[2, 1, 1]" in err[0]
    assert sorted(p.name for p in out.iterdir()) == before


def test_q_scale_is_checked_against_the_attention_heads(tmp_path):
    def edit(t):
        t["model.layers.0.self_attn.q_scale"] = np.full((2, 1, 1), 0.01, np.float32)  # 4 heads

    def config_edit(cfg):
        cfg["quantization_config"]["config_groups"] = {"attention": {
            "targets": ["LlamaAttention"], "weights": None, "output_activations": None, "format": "dense",
            "input_activations": dict(cfg["quantization_config"]["kv_cache_scheme"])}}

    out = _copy(tmp_path, edit, config_edit)
    with pytest.raises(CheckpointError, match=r"q_scale'?: shape \[2, 1, 1\]; config.json has num_attention_heads 4"):
        fp8ref.load_checkpoint(out)

    def good(t):
        t["model.layers.0.self_attn.q_scale"] = np.full((4, 1, 1), 0.01, np.float32)

    ckpt = fp8ref.load_checkpoint(_copy(tmp_path / "2", good, config_edit))
    assert "model.layers.0.self_attn.q_scale" in ckpt.kv_scales


def test_a_per_head_scale_needs_a_head_count(tmp_path):
    out = _copy(tmp_path, config_edit=lambda cfg: [cfg.pop("num_key_value_heads"), cfg.pop("num_attention_heads")])
    with pytest.raises(CheckpointError, match=r"k_scale'?: shape \[2, 1, 1\], one scale per head, but config.json"):
        fp8ref.load_checkpoint(out)


def test_a_dynamic_or_token_kv_scheme_is_refused(tmp_path):
    def config_edit(cfg):
        cfg["quantization_config"]["kv_cache_scheme"]["strategy"] = "token"

    with pytest.raises(CheckpointError, match=r"kv_cache_scheme: expected static per-tensor or per-head"):
        fp8ref.load_checkpoint(_copy(tmp_path, config_edit=config_edit))


# --- export: one KV-cache amax per head -------------------------------------------------------

ORIGINAL = FIXTURE.parent / "original_bf16"  # the same tiny Llama, unquantized (2 KV heads)
SPEC = {"scheme": "FP8_DYNAMIC", "ignore": ["lm_head"]}


def _per_head_calibration(values=(1.3984375, 3.75)):
    return {f"model.layers.{i}.self_attn.{w}_scale": list(values) for i in range(2) for w in "kv"}


def test_export_writes_attn_head_scales_and_writes_them_again_byte_for_byte(tmp_path):
    import ml_dtypes

    from fp8ref.checkpoint import export_checkpoint, write_checkpoint

    export_checkpoint(ORIGINAL, tmp_path / "out", SPEC, calibration=_per_head_calibration())
    qc = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert qc["kv_cache_scheme"]["strategy"] == "attn_head" and qc["kv_cache_scheme"]["dynamic"] is False
    ckpt = fp8ref.load_checkpoint(tmp_path / "out")
    # compressed-tensors' rule in a bf16 model: D(fp32(amax) / 448), one per head (ml_dtypes' cast)
    want = (np.array([1.3984375, 3.75], np.float32) / np.float32(448)).astype(ml_dtypes.bfloat16).astype(np.float32)
    for n in ckpt.kv_scales:
        assert ckpt.store.info(n).dtype == "BF16" and list(ckpt.store.info(n).shape) == [2, 1, 1], n
        assert np.array_equal(np.asarray(ckpt.store.get(n)).astype(np.float32).reshape(-1), want), n
    write_checkpoint(ckpt, tmp_path / "again")
    for f in ("config.json", "model.safetensors"):
        assert (tmp_path / "out" / f).read_bytes() == (tmp_path / "again" / f).read_bytes(), f


@pytest.mark.parametrize("calibration, message", [
    ({"model.layers.0.self_attn.k_scale": [1.0, 2.0, 3.0]}, r"holds 3 amax values; config.json has "
                                                            r"num_key_value_heads 2"),
    ({"model.layers.0.self_attn.k_scale": [1.0, 2.0], "model.layers.0.self_attn.v_scale": 2.0},
     r"holds one amax per head but .* one per tensor"),
    ({"model.layers.0.self_attn.k_scale": []}, r"an empty list"),
    ({"model.layers.0.self_attn.k_scale": [1.0, float("nan")]}, r"finite number >= 0"),
])
def test_bad_per_head_calibration_is_refused_before_writing(tmp_path, calibration, message):
    from fp8ref.checkpoint import export_checkpoint

    with pytest.raises(CheckpointError, match=message):
        export_checkpoint(ORIGINAL, tmp_path / "out", SPEC, calibration=calibration)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("fmt", ["modelopt", "quark"])
def test_formats_with_one_kv_scale_per_tensor_refuse_per_head(tmp_path, fmt):
    from fp8ref.checkpoint import export_checkpoint, write_checkpoint

    if fmt == "modelopt":  # (fp8ref writes Quark FP8 with static inputs only: FP8_DYNAMIC stops earlier there)
        with pytest.raises(CheckpointError, match=r"one amax per head; the modelopt format stores one KV-cache "
                                                  r"scale per tensor"):
            export_checkpoint(ORIGINAL, tmp_path / "out", SPEC, format=fmt, calibration=_per_head_calibration())
    ckpt = fp8ref.load_checkpoint(FIXTURE)
    with pytest.raises(CheckpointError, match=r"one KV-cache scale per head \(\[2, 1, 1\]\)"):
        write_checkpoint(ckpt, tmp_path / "w", format=fmt)
    assert not (tmp_path / "out").exists() and not (tmp_path / "w").exists()


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(amax=st.lists(st.lists(st.floats(0.0, 1e4, allow_nan=False, width=32), min_size=2, max_size=2),
                     min_size=4, max_size=4))
def test_per_head_export_load_write_is_byte_identical(tmp_path_factory, amax):
    """export -> load -> write_checkpoint gives the same bytes for any per-head KV amax (0 included)."""
    from fp8ref.checkpoint import export_checkpoint, write_checkpoint

    tmp = tmp_path_factory.mktemp("rt")
    names = [f"model.layers.{i}.self_attn.{w}_scale" for i in range(2) for w in "kv"]
    export_checkpoint(ORIGINAL, tmp / "out", SPEC, calibration=dict(zip(names, amax)))
    ckpt = fp8ref.load_checkpoint(tmp / "out")
    for n, a in zip(names, amax):
        assert list(ckpt.store.info(n).shape) == [2, 1, 1] and (np.asarray(ckpt.store.get(n)) > 0).all(), (n, a)
    write_checkpoint(ckpt, tmp / "again")
    for f in ("config.json", "model.safetensors"):
        assert (tmp / "out" / f).read_bytes() == (tmp / "again" / f).read_bytes(), f
