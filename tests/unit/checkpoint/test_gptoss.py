"""gpt-oss MXFP4 checkpoints: the format (load, validate, dequantize, export), its two recipes
(transformers' ROUND_UP and the OCP floor rule) against independent transcriptions, the export ->
load -> export round trip, and verify naming the recipe that made a hand-made checkpoint."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fp8ref
from fp8ref.checkpoint.convert import write_checkpoint
from fp8ref.errors import CheckpointError
from fp8ref.formats import FORMATS
from fp8ref.nn.verify import verify
from fp8ref.scaling import mx_scale_exponent
from tests.support.checkpoint_builders import build_gptoss_original, gptoss_quantized, snapshot, write
from tests.support.cli import run_cli

E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
M = "model.layers.0.mlp.experts"
FIXTURES_CKPTS = Path(__file__).resolve().parents[2] / "fixtures" / "interop" / "checkpoints"


def e2m1_oracle(v: np.ndarray) -> np.ndarray:
    """Nearest E2M1 magnitude (ties to the even code), saturating at 6; the sign bit copied (-0 too)."""
    mag = np.minimum(np.abs(v), 6.0)[..., None]
    dist = np.abs(mag - E2M1)
    best = dist.min(-1, keepdims=True)
    ties = dist == best
    idx = np.where(ties[..., ::2].any(-1), np.argmax(ties & (np.arange(8) % 2 == 0), -1), np.argmax(ties, -1))
    return (idx | (np.signbit(v) << 3)).astype(np.uint8)


def round_up_oracle(rows: np.ndarray):
    """triton_kernels' downcast_to_mxfp_torch ROUND_UP, re-stated in torch from its source: fp32 amax / 6,
    the exponent rounded up on the int32 bits, x * fp32(1 / scale), then E2M1."""
    x = torch.from_numpy(rows).float().reshape(rows.shape[0], -1, 32)
    d = x.abs().amax(-1, keepdim=True) / 6.0
    r = (d.view(torch.int32) + 0x007FFFFF) & 0x7F800000
    scale = r.view(torch.float32)
    q = x * torch.where(scale == 0, torch.zeros_like(scale), 1.0 / scale)
    return e2m1_oracle(q.reshape(rows.shape).double().numpy()), (r >> 23).squeeze(-1).numpy().astype(np.uint8)


def ocp_floor_oracle(rows: np.ndarray):
    """OCP MX v1.0: X = 2**(floor(log2 amax) - 2) clipped to E8M0's 2**-127 (the elements of a block below
    it round to zero), exact division, saturating E2M1; zero block byte 0."""
    blocks = rows.reshape(rows.shape[0], -1, 32)
    amax = np.abs(blocks).max(-1)
    e = np.vectorize(lambda a: max(math.frexp(a)[1] - 1 - 2, -127) if a > 0 else -127)(amax).astype(np.int64)
    q = blocks / np.ldexp(1.0, e)[..., None]
    return e2m1_oracle(q.reshape(rows.shape)), (e + 127).astype(np.uint8)


def _original(tmp_path, seed=0, **kw):
    tensors, config = build_gptoss_original(seed, **kw)
    return write(tmp_path / "orig", tensors, config), tensors, config


# --- the rules ------------------------------------------------------------------------------------
def _bf16_positive() -> np.ndarray:
    """Every positive finite bfloat16 value, as float64."""
    bits = np.arange(1, 0x7F80, dtype=np.uint32) << 16
    return bits.view(np.float32).astype(np.float64)


def test_round_up_rule_on_every_bf16_amax_against_the_torch_transcription():
    a = _bf16_positive()
    rows = np.zeros((a.size, 32))
    rows[:, 0] = a
    _, want = round_up_oracle(rows)
    got = mx_scale_exponent(a, FORMATS["float4_e2m1fn"], "round-up") + 127
    assert np.array_equal(got.astype(np.uint8), want[:, 0])


def test_round_up_against_ocp_floor_and_rceil_on_every_bf16_amax():
    """ROUND_UP = rceil wherever amax / 6 is a normal float32 (and one more below, where ROUND_UP stops
    at 2**-126); ROUND_UP = OCP floor + [significand > 1.5]."""
    a, elem = _bf16_positive(), FORMATS["float4_e2m1fn"]
    up, floor, rceil = (mx_scale_exponent(a, elem, r) for r in ("round-up", "ocp-floor", "rceil"))
    m, _ = np.frexp(a)
    normal = a / 6 >= 2.0 ** -126  # below, ROUND_UP stops at 2**-126 (byte 1) and the others go on down
    assert np.array_equal((up - floor)[normal], (2 * m[normal] > 1.5).astype(np.int64))
    assert np.array_equal(up[normal], rceil[normal]) and (up[~normal] == -126).all()


@pytest.mark.parametrize("recipe, oracle", [("gpt-oss-mxfp4", round_up_oracle), ("fp8ref", ocp_floor_oracle)])
def test_recipe_codes_and_scales_against_the_oracle(recipe, oracle):
    from fp8ref.quant import QuantArgs, quantize

    rng = np.random.default_rng(1)
    rows = (rng.standard_normal((64, 256)) * 2.0 ** rng.normal(0, 20, (64, 1))).astype(np.float32)
    rows[0, :32] = 0
    rows[1, :32] = -0.0
    rows[2, :64] = np.float32(2.0 ** -133) * np.sign(rng.standard_normal(64))
    import ml_dtypes

    rows = rows.astype(ml_dtypes.bfloat16).astype(np.float64)
    res = quantize(rows.astype(np.float32), QuantArgs(format="float4_e2m1fn", granularity="mx"), recipe=recipe)
    codes, scales = oracle(rows)
    assert np.array_equal(np.asarray(res.codes), codes) and np.array_equal(np.asarray(res.scale_codes), scales)


# --- load, dequantize, round trip --------------------------------------------------------------------
def test_load_and_dequantize_against_a_lut(tmp_path):
    orig, tensors, config = _original(tmp_path)
    qt, qconfig = gptoss_quantized(tensors, config, round_up_oracle)
    ckpt = fp8ref.load_checkpoint(write(tmp_path / "q", qt, qconfig))
    assert ckpt.format == "gpt-oss" and sorted(ckpt) == [f"{M}.down_proj", f"{M}.gate_up_proj"]
    layer = ckpt[f"{M}.gate_up_proj"]
    assert (layer.experts, layer.expert_shape, layer.shape) == (4, (64, 64), (256, 64))
    blocks, scales = qt[f"{M}.gate_up_proj_blocks"][1], qt[f"{M}.gate_up_proj_scales"][1]
    lut = np.concatenate([E2M1, -E2M1])
    vals = np.stack([lut[blocks & 15], lut[blocks >> 4]], -1).reshape(4, 64, 2, 32)
    want = (vals * np.ldexp(1.0, scales.astype(np.int64) - 127)[..., None]).reshape(4, 64, 64).transpose(0, 2, 1)
    assert np.array_equal(layer.experts_weight("float64"), want)
    assert ckpt.unquantized == sorted(n for n in tensors if "experts" not in n)


_ROWS = st.sampled_from([32, 64])


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 2**16), experts=st.integers(1, 3), hidden=_ROWS, inter=_ROWS,
       spread=st.sampled_from([0.0, 4.0, 30.0]), recipe=st.sampled_from(["gpt-oss-mxfp4", "fp8ref"]))
def test_export_load_export_is_byte_identical(tmp_path_factory, seed, experts, hidden, inter, spread, recipe):
    tmp = tmp_path_factory.mktemp("rt")
    tensors, config = build_gptoss_original(seed, experts=experts, hidden=hidden, inter=inter, spread=spread)
    orig = write(tmp / "orig", tensors, config)
    spec = {"scheme": {"bits": 4, "group_size": 32, "data_type": "mx_fp", "act_bits": 16, "recipe": recipe}}
    a = fp8ref.export_checkpoint(orig, tmp / "a", spec, format="gpt-oss")
    ckpt = fp8ref.load_checkpoint(a)
    b = write_checkpoint(ckpt, tmp / "b")
    files = sorted(p.name for p in a.iterdir())
    assert files == sorted(p.name for p in b.iterdir())
    for name in files:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    oracle = round_up_oracle if recipe == "gpt-oss-mxfp4" else ocp_floor_oracle
    want, _ = gptoss_quantized(tensors, config, oracle)
    for proj in ("gate_up_proj", "down_proj"):
        for suffix in ("_blocks", "_scales"):
            assert np.array_equal(ckpt.tensor(f"{M}.{proj}{suffix}"), want[f"{M}.{proj}{suffix}"][1])
    assert fp8ref.checkpoint.base.recorded_recipes(ckpt.store) == {f"{M}.down_proj": recipe,
                                                                   f"{M}.gate_up_proj": recipe}


# --- verify names the recipe of a hand-made checkpoint ------------------------------------------------
@pytest.mark.parametrize("oracle, recipe", [(round_up_oracle, "gpt-oss-mxfp4"), (ocp_floor_oracle, "fp8ref")])
def test_verify_names_the_recipe_of_a_hand_made_checkpoint(tmp_path, capsys, oracle, recipe):
    orig, tensors, config = _original(tmp_path, seed=3)
    q = write(tmp_path / "q", *gptoss_quantized(tensors, config, oracle))
    r = verify(fp8ref.load_checkpoint(q), fp8ref.load_checkpoint(orig))
    assert r["ok"] and (r["recipe"], r["recipe_source"]) == (recipe, "discovered")
    assert sum(x["codes"] for x in r["layers"]) == 4 * (64 * 64 + 32 * 64)
    assert run_cli("verify", q, "--original", orig) == 0
    assert f"with recipe {recipe!r} (found among the format's known recipes)" in capsys.readouterr().out
    other = "fp8ref" if recipe == "gpt-oss-mxfp4" else "gpt-oss-mxfp4"
    assert run_cli("verify", q, "--original", orig, "--recipe", other) == 1  # the rules differ on these weights


def test_verify_names_the_closest_recipe_when_none_reproduces(tmp_path, capsys):
    orig, tensors, config = _original(tmp_path, seed=4)
    qt, qconfig = gptoss_quantized(tensors, config, round_up_oracle)
    qt[f"{M}.down_proj_blocks"][1][0, 0, 0, 0] ^= 0x11  # two codes of expert 0 changed
    q = write(tmp_path / "q", qt, qconfig)
    assert run_cli("verify", q, "--original", orig, "--json", "-") == 1
    r = json.loads(capsys.readouterr().out)
    down = next(x for x in r["layers"] if x["name"].endswith("down_proj"))
    assert (down["recipe"], down["recipe_source"], down["code_mismatches"]) == ("gpt-oss-mxfp4", "closest", 2)
    assert down["first_code_mismatch"] == [0, 0]
    assert run_cli("verify", q, "--original", orig) == 1
    assert "no known recipe reproduces the bytes, 'gpt-oss-mxfp4' comes closest (2 mismatches)" in \
        capsys.readouterr().out


# --- bad input: one line naming the tensor, nothing written ----------------------------------------
def _broken(tmp_path, edit):
    orig, tensors, config = _original(tmp_path)
    qt, qconfig = gptoss_quantized(tensors, config, round_up_oracle)
    edit(qt, qconfig)
    return write(tmp_path / "bad", qt, qconfig)


def _drop(name):
    return lambda t, c: t.pop(name)


def _set_scale_ff(t, c):
    t[f"{M}.gate_up_proj_scales"][1][1, 2, 1] = 0xFF


def _short_scales(t, c):
    t[f"{M}.down_proj_scales"] = ("U8", t[f"{M}.down_proj_scales"][1][:, :-1])


def _wrong_down(t, c):
    b = t[f"{M}.down_proj_blocks"][1]
    t[f"{M}.down_proj_blocks"] = ("U8", b[:, :32])
    t[f"{M}.down_proj_scales"] = ("U8", t[f"{M}.down_proj_scales"][1][:, :32])
    t[f"{M}.down_proj_bias"] = ("BF16", t[f"{M}.down_proj_bias"][1][:, :32])


def _listed(t, c):
    c["quantization_config"]["modules_to_not_convert"].append("model.layers.*.mlp.experts")


@pytest.mark.parametrize("edit, message", [
    (_drop(f"{M}.gate_up_proj_scales"), f"{M}.gate_up_proj_blocks': MXFP4 blocks without {M}.gate_up_proj_scales"),
    (_drop(f"{M}.down_proj_blocks"), f"{M}.down_proj_scales': MXFP4 scales without {M}.down_proj_blocks"),
    (_drop(f"{M}.down_proj_bias"), f"{M}.down_proj_blocks': no {M}.down_proj_bias"),
    (_set_scale_ff, f"{M}.gate_up_proj_scales': 1 of 512 scale values are not positive finite numbers; "
                    "first at index [1, 2, 1]: nan (NaN)"),
    (_short_scales, f"{M}.down_proj_scales': U8 [4, 63, 1], expected U8 [4, 64, 1]"),
    (_wrong_down, f"{M}.down_proj_blocks': [experts, out, in] = [4, 32, 32] does not fit"),
    (_listed, "modules_to_not_convert lists 'model.layers.*.mlp.experts', which matches 'model.layers.0.mlp.experts'"),
])
def test_bad_checkpoints_fail_with_one_line(tmp_path, capsys, edit, message):
    bad = _broken(tmp_path, edit)
    with pytest.raises(CheckpointError, match=None) as info:
        fp8ref.load_checkpoint(bad)
    assert message in str(info.value) and "\n" not in str(info.value)
    before = snapshot(tmp_path)
    assert run_cli("inspect", bad) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("fp8ref: error: ") and message in err and "\n" not in err
    assert snapshot(tmp_path) == before and not (tmp_path / "out").exists()


def test_export_refuses_activation_quantization_and_writes_nothing(tmp_path, capsys):
    orig, _, _ = _original(tmp_path)
    before = snapshot(tmp_path)
    spec = tmp_path.parent / f"{tmp_path.name}-w4a4.yaml"
    spec.write_text("scheme: MXFP4\n")
    assert run_cli("quantize", orig, tmp_path / "out", "--spec", spec, "--format", "gpt-oss") == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("fp8ref: error: ") and "gpt-oss stores weight-only MXFP4 experts" in err
    assert snapshot(tmp_path) == before


def test_export_of_non_finite_experts_names_the_tensor(tmp_path, capsys):
    tensors, config = build_gptoss_original(0)
    tensors[f"{M}.down_proj"][1][1, 5, 7] = np.inf
    orig = write(tmp_path / "orig", tensors, config)
    spec = tmp_path.parent / f"{tmp_path.name}-mx.yaml"
    spec.write_text("scheme: {bits: 4, group_size: 32, data_type: mx_fp, act_bits: 16, recipe: gpt-oss-mxfp4}\n")
    assert run_cli("quantize", orig, tmp_path / "out", "--spec", spec, "--format", "gpt-oss") == 1
    err = capsys.readouterr().err.strip()
    assert f"tensor '{M}.down_proj': cannot quantize: x: recipe 'gpt-oss-mxfp4' needs finite values" in err
    assert "\n" not in err and not (tmp_path / "out").exists()


def test_fused_experts_are_not_converted_to_a_linear_format(tmp_path, capsys):
    orig, tensors, config = _original(tmp_path)
    q = write(tmp_path / "q", *gptoss_quantized(tensors, config, round_up_oracle))
    for cmd in (("convert", q, tmp_path / "ct", "--format", "compressed-tensors"),):
        assert run_cli(*cmd) == 1
        err = capsys.readouterr().err.strip()
        assert f"layer '{M}.down_proj': 4 fused experts; the compressed-tensors format stores per-expert" in err
    with pytest.raises(CheckpointError, match="fp8ref does not split fused experts"):
        write_checkpoint(fp8ref.load_checkpoint(q), tmp_path / "ct2", format="compressed-tensors")
    assert not (tmp_path / "ct").exists() and not (tmp_path / "ct2").exists()


def test_convert_rewrites_a_gpt_oss_checkpoint_byte_for_byte(tmp_path, capsys):
    """``fp8ref convert Q OUT --format gpt-oss`` (what the fused-experts error suggests) writes the hand-made
    ROUND_UP checkpoint again: every tensor's bytes and the config as they were, each layer reported
    exact, the dequantized experts unchanged; converting the output again gives the same file; the
    Python write_checkpoint writes the very same bytes."""
    from fp8ref.io.safetensors import open_store

    orig, tensors, config = _original(tmp_path)
    q = write(tmp_path / "q", *gptoss_quantized(tensors, config, round_up_oracle))
    assert run_cli("convert", q, tmp_path / "out", "--format", "gpt-oss", "--exact-only") == 0
    out = capsys.readouterr().out
    assert f"  {M}.down_proj: exact" in out and "result: exact; 2 layers" in out
    src, dst = open_store(q), open_store(tmp_path / "out")
    assert sorted(src) == sorted(dst)
    for n in src:
        assert (src.info(n).dtype, src.info(n).shape) == (dst.info(n).dtype, dst.info(n).shape), n
        assert np.asarray(src.get(n, bf16_bits=True)).tobytes() == np.asarray(dst.get(n, bf16_bits=True)).tobytes(), n
    assert json.loads((tmp_path / "out" / "config.json").read_text()) == json.loads((q / "config.json").read_text())
    a, b = fp8ref.load_checkpoint(q), fp8ref.load_checkpoint(tmp_path / "out")
    for n in a:
        assert np.array_equal(np.asarray(a[n].experts_weight("float32")), np.asarray(b[n].experts_weight("float32")))
    assert run_cli("convert", tmp_path / "out", tmp_path / "again", "--format", "gpt-oss") == 0
    write_checkpoint(a, tmp_path / "api")
    body = (tmp_path / "out" / "model.safetensors").read_bytes()
    assert (tmp_path / "again" / "model.safetensors").read_bytes() == body
    assert (tmp_path / "api" / "model.safetensors").read_bytes() == body
    assert run_cli("verify", tmp_path / "out", "--original", orig, "--recipe", "gpt-oss-mxfp4") == 0


def test_convert_to_gpt_oss_from_per_expert_linears_is_refused(tmp_path, capsys):
    ckpt = FIXTURES_CKPTS / "llmc_mxfp4"
    assert run_cli("convert", ckpt, tmp_path / "out", "--format", "gpt-oss") == 1
    err = capsys.readouterr().err.strip()
    assert err == (f"fp8ref: error: {ckpt}: a compressed-tensors checkpoint; the gpt-oss format holds fused experts, "
                   f"so convert --format gpt-oss rewrites gpt-oss checkpoints only (from the original weights: fp8ref "
                   f"quantize --format gpt-oss)")
    assert not (tmp_path / "out").exists()


def test_verify_finds_a_recipe_per_layer(tmp_path, capsys):
    """gate_up_proj by ROUND_UP, down_proj by the OCP floor rule: each layer gets the recipe that made it."""
    orig, tensors, config = _original(tmp_path, seed=5)
    up, _ = gptoss_quantized(tensors, config, round_up_oracle)
    mixed, qconfig = gptoss_quantized(tensors, config, ocp_floor_oracle)
    for suffix in ("_blocks", "_scales"):
        mixed[f"{M}.gate_up_proj{suffix}"] = up[f"{M}.gate_up_proj{suffix}"]
    q = write(tmp_path / "q", mixed, qconfig)
    r = verify(fp8ref.load_checkpoint(q), fp8ref.load_checkpoint(orig))
    assert r["ok"] and r["recipe"] is None and r["recipe_source"] == "discovered"
    assert {x["name"].rpartition(".")[2]: x["recipe"] for x in r["layers"]} == {"down_proj": "fp8ref",
                                                                               "gate_up_proj": "gpt-oss-mxfp4"}
    assert run_cli("verify", q, "--original", orig) == 0
    assert ("recipe 'fp8ref' for 1 layer (found among the format's known recipes); recipe 'gpt-oss-mxfp4' for 1 "
            "layer (found among the format's known recipes)") in capsys.readouterr().out
