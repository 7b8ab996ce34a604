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


# --- the query: q_scale [n_heads, 1, 1] in an attention group ------------------------------------

TOOL_Q = FIXTURE.parent / "llmc_fp8_attn_head_q"  # llm-compressor 0.14.0.1's own config for this layout
ATTN_NAMES = [f"model.layers.{i}.self_attn.{w}_scale" for i in range(2) for w in "qkv"]


def _qkv_amax(q=(0.5, 1.25, 3.0, 7.5), kv=(1.3984375, 3.75)):
    return {n: list(q if n.endswith("q_scale") else kv) for n in ATTN_NAMES}


def test_a_per_head_query_amax_exports_llm_compressors_layout_and_rewrites_byte_for_byte(tmp_path):
    """From a calibration file: the config equals the one llm-compressor wrote for FP8_DYNAMIC plus an
    attn_head group on LlamaAttention (its 'version' key aside), every scale tensor has the tool's
    name, dtype and shape, q_scale holds compressed-tensors' rule per head, and a rewrite is byte-identical."""
    import ml_dtypes

    from fp8ref.checkpoint import export_checkpoint, write_checkpoint
    from fp8ref.checkpoint.calibration_file import write_calibration

    amax = _qkv_amax()
    cal = write_calibration(tmp_path / "cal.json", {}, kv_amax=amax)
    export_checkpoint(ORIGINAL, tmp_path / "out", SPEC, calibration=cal, config_version="0.19")
    tool = json.loads((TOOL_Q / "config.json").read_text())["quantization_config"]
    tool.pop("version")
    assert json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"] == tool
    ckpt = fp8ref.load_checkpoint(tmp_path / "out")
    layout = json.loads((TOOL_Q / "fixture.json").read_text())["scale_tensors"]
    mine = {n: {"dtype": {"BF16": "bfloat16"}[ckpt.store.info(n).dtype], "shape": list(ckpt.store.info(n).shape)}
            for n in ckpt.store if n.endswith("_scale")}
    assert mine == layout
    assert sorted(ckpt.kv_scales) == sorted(ATTN_NAMES)
    for n, a in amax.items():
        want = (np.array(a, np.float32) / np.float32(448)).astype(ml_dtypes.bfloat16).astype(np.float32)
        assert np.array_equal(np.asarray(ckpt.store.get(n)).astype(np.float32).reshape(-1), want), n
    write_checkpoint(ckpt, tmp_path / "again")
    for f in ("config.json", "model.safetensors"):
        assert (tmp_path / "out" / f).read_bytes() == (tmp_path / "again" / f).read_bytes(), f


def test_a_safetensors_calibration_file_holds_per_head_amax(tmp_path):
    from fp8ref.checkpoint.calibration_file import CALIBRATION_FORMAT, load_calibration

    amax = _qkv_amax()
    tensors = {n: np.array(a, np.float32) for n, a in amax.items()}
    tensors["model.layers.0.mlp.up_proj"] = np.ones(1, np.float32)
    save_file(tensors, str(tmp_path / "cal.safetensors"), metadata={"format": CALIBRATION_FORMAT, "holds": "amax"})
    got = load_calibration(tmp_path / "cal.safetensors")
    assert {n: got[n] for n in amax} == amax and got["model.layers.0.mlp.up_proj"] == 1.0


@pytest.mark.parametrize("edit, fmt, message", [
    (lambda a: a.update({"model.layers.0.self_attn.q_scale": [1.0, 2.0, 3.0]}), "compressed-tensors",
     r"q_scale' holds 3 amax values; config.json has num_attention_heads 4: give one per attention head"),
    (lambda a: a.pop("model.layers.1.self_attn.q_scale"), "compressed-tensors",
     r"a query amax for 1 of 2 attention modules; none for \['model.layers.1.self_attn'\]"),
    (lambda a: a.update({"model.layers.0.self_attn.q_scale": 2.0}), "compressed-tensors",
     r"one amax per head but 'model.layers.0.self_attn.q_scale' one per tensor"),
    (lambda a: [a.update({n: 2.0}) for n in a if not n.endswith("q_scale")], "compressed-tensors",
     r"one amax per head but .* one per tensor"),
    (lambda a: a.update({n: 2.0 for n in a}), "modelopt", r"a query amax; the modelopt format stores no query scale"),
])
def test_bad_query_calibration_is_refused_before_writing(tmp_path, edit, fmt, message):
    from fp8ref.checkpoint import export_checkpoint

    amax = _qkv_amax()
    edit(amax)
    with pytest.raises(CheckpointError, match=message):
        export_checkpoint(ORIGINAL, tmp_path / "out", SPEC, format=fmt, calibration=amax)
    assert not (tmp_path / "out").exists()


def test_per_tensor_query_and_kv_scales_export_with_strategy_tensor(tmp_path):
    from fp8ref.checkpoint import export_checkpoint, write_checkpoint

    export_checkpoint(ORIGINAL, tmp_path / "out", SPEC, calibration={n: 2.0 for n in ATTN_NAMES})
    qc = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert qc["kv_cache_scheme"]["strategy"] == "tensor"
    assert qc["config_groups"]["group_0"]["targets"] == ["LlamaAttention"]
    ckpt = fp8ref.load_checkpoint(tmp_path / "out")
    assert all(list(ckpt.store.info(n).shape) == [1] for n in ATTN_NAMES)
    write_checkpoint(ckpt, tmp_path / "again")
    assert (tmp_path / "out" / "config.json").read_bytes() == (tmp_path / "again" / "config.json").read_bytes()
    with pytest.raises(CheckpointError, match=r"q_scale'?: a query scale; the modelopt format stores none"):
        write_checkpoint(ckpt, tmp_path / "m", format="modelopt")
    assert not (tmp_path / "m").exists()


def test_without_an_architecture_the_attention_group_targets_the_modules(tmp_path):
    from fp8ref.checkpoint import export_checkpoint

    src = tmp_path / "src"
    shutil.copytree(ORIGINAL, src)
    cfg = json.loads((src / "config.json").read_text())
    cfg.pop("architectures")
    (src / "config.json").write_text(json.dumps(cfg))
    export_checkpoint(src, tmp_path / "out", SPEC, calibration=_qkv_amax())
    qc = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert qc["config_groups"]["group_0"]["targets"] == ["model.layers.0.self_attn", "model.layers.1.self_attn"]


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(amax=st.lists(st.lists(st.floats(0.0, 1e4, allow_nan=False, width=32), min_size=4, max_size=4),
                     min_size=6, max_size=6),
       version=st.sampled_from(["0.19", "0.20"]))
def test_per_head_qkv_export_load_write_is_byte_identical(tmp_path_factory, amax, version):
    """export -> load -> write_checkpoint with per-head Q, K and V amax (0 included), either config writer."""
    from fp8ref.checkpoint import export_checkpoint, write_checkpoint

    tmp = tmp_path_factory.mktemp("rt")
    cal = {n: a if n.endswith("q_scale") else a[:2] for n, a in zip(ATTN_NAMES, amax)}
    export_checkpoint(ORIGINAL, tmp / "out", SPEC, calibration=cal, config_version=version)
    ckpt = fp8ref.load_checkpoint(tmp / "out")
    for n in ATTN_NAMES:
        assert list(ckpt.store.info(n).shape) == [4 if n.endswith("q_scale") else 2, 1, 1], n
        assert (np.asarray(ckpt.store.get(n)).astype(np.float32) > 0).all(), n
    write_checkpoint(ckpt, tmp / "again")
    for f in ("config.json", "model.safetensors"):
        assert (tmp / "out" / f).read_bytes() == (tmp / "again" / f).read_bytes(), f
