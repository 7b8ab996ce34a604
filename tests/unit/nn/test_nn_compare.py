"""The compare / eval / verify engines and their commands in the default suite (no transformers:
the hand-written tiny Llama of tests/support carries the checkpoint's layers)."""

from __future__ import annotations

import json
import math
import shutil
import struct
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch

import fp8ref
from fp8ref.cli import main
from fp8ref.errors import ModelError
from fp8ref.nn import load_unquantized, swap_linears
from fp8ref.nn.compare import compare, evaluate
from fp8ref.nn.metrics import layer_metrics, logit_metrics, perplexity, ulp
from fp8ref.nn.tokens import random_tokens, read_tokens, text_tokens
from tests.support.tiny_llama import TinyLlama

CKPTS = Path(__file__).resolve().parents[2] / "fixtures" / "interop" / "checkpoints"
IDS = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(3))


class PlantedBackend:
    """fp8ref's exact scaled_mm (so bit-identical to mode reference) except out[0, 0] of every GEMM
    with K=128, N=64 (the down_proj layers), whose top bf16 fraction bit is flipped: 64 ulps."""

    name = "planted"

    def implements(self, op, params):
        return None if op == "scaled_mm" and params["accumulate"] == "exact" else "exact scaled_mm only"

    def scaled_mm(self, a, b, scale_a, scale_b, *, bias, fmt, out_dtype, accumulate, scale_order):
        out = np.array(fp8ref.scaled_mm(a, b, scale_a, scale_b, bias=bias, out_dtype=out_dtype, fmt_a=fmt, fmt_b=fmt))
        if b.shape == (128, 64):
            out.view(np.uint16)[0, 0] ^= 0x40
        return out


def _model(fixture="llmc_fp8", **kw):
    ckpt = fp8ref.load_checkpoint(CKPTS / fixture)
    m = TinyLlama(torch.bfloat16)
    swap_linears(m, ckpt, **kw)
    load_unquantized(m, ckpt)
    return m


def test_compare_finds_the_planted_divergence():
    r = compare(_model(backend=PlantedBackend()), IDS, ["reference", "backend:planted"])
    order = [x["name"] for x in r["layers"]]
    assert order[:7] == [f"model.layers.0.{n}" for n in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                                          "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj",
                                                          "mlp.down_proj")]
    assert r["first_divergent"]["backend:planted"] == {"teacher_forced": "model.layers.0.mlp.down_proj",
                                                       "free_running": "model.layers.0.mlp.down_proj"}
    for x in r["layers"]:
        tf, fr = x["teacher_forced"]["backend:planted"], x["free_running"]["backend:planted"]
        if x["name"].endswith("down_proj"):  # exactly one element, 64 ulps
            assert tf["max_ulp"] == 64.0 and tf["differ"] == 1 / (2 * 9 * 64) and 10 < tf["snr_db"] < 100
        else:
            assert tf["max_ulp"] == 0 and tf["rel_rms"] == 0 and tf["snr_db"] == math.inf
        if x["name"].startswith("model.layers.0.") and not x["name"].endswith("down_proj"):
            assert fr["differ"] == 0 and fr["code_differ"] == 0  # before the divergence
    assert r["layers"][0]["teacher_forced"]["backend:planted"]["scaled_mm"] == {
        "format": "float8_e4m3fn", "scales": "tensor", "out_dtype": "bfloat16", "bias": False, "accumulate": "exact",
        "scale_order": "epilogue"}
    later = r["layers"][7]["free_running"]["backend:planted"]  # layers.1's q_proj: other activation codes
    assert later["code_differ"] > 0 and later["differ"] > 0
    e = r["end_to_end"]["backend:planted"]
    assert e["max_abs_diff"] > 0 and 0 < e["kl"] < 1e-3


def test_compare_identical_modes_agree_exactly():
    r = compare(_model(backend=PlantedBackend()), IDS[:, :4], ["reference", "reference:fp32"], with_perplexity=True)
    assert set(r["end_to_end"]) == {"reference", "reference:fp32"}
    base = r["end_to_end"]["reference"]["perplexity"]
    assert r["tokens"] == {"batch": 2, "length": 4}
    # independently: torch's cross entropy on the reference-mode logits (a model swapped in mode reference)
    ids = IDS[:, :4]
    with torch.no_grad():
        logits = _model(mode="reference")(ids).double()
    nll = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    assert base == pytest.approx(math.exp(float(nll)), rel=1e-12)
    # evaluate() gives the baseline's perplexity from its own pass
    assert evaluate(_model(), IDS[:, :4], "reference")["perplexity"] == pytest.approx(base, rel=1e-12)


def test_metrics_on_known_values():
    b = torch.tensor([1.0, 2.0, -3.0, 0.0], dtype=torch.bfloat16)
    a = torch.tensor([1.0078125, 2.0, -3.0, 2.0 ** -133], dtype=torch.bfloat16)  # +1 ulp at 1, subnormal 1 ulp
    assert ulp(np.array([1.0, 3.0, 0.0, 2.0 ** -140]), torch.bfloat16).tolist() == [2 ** -7, 2 ** -6, 2 ** -133,
                                                                                    2 ** -133]
    m = layer_metrics(a, b)
    assert m["max_ulp"] == 1.0 and m["differ"] == 0.5 and m["nan"] == 0
    assert m["rel_rms"] == pytest.approx(math.sqrt((2 ** -7) ** 2 + 2 ** -266) / math.sqrt(14))
    z = torch.zeros(2, 3, 5)
    assert perplexity(z, torch.zeros(2, 3, dtype=torch.long)) == pytest.approx(5.0)
    e = logit_metrics(z, z)
    assert e == {"kl": 0.0, "top1_agree": 1.0, "max_abs_diff": 0.0}


def test_tokens(tmp_path):
    (tmp_path / "t.txt").write_bytes(bytes(range(256)) * 2)
    ids = text_tokens(tmp_path / "t.txt", 100, seq_len=128)
    assert ids.shape == (4, 128) and ids[1, 0].item() == 128 % 100 and ids.max().item() == 99
    (tmp_path / "ids.txt").write_text("1 2 3\n4 5 6\n")
    assert read_tokens(tmp_path / "ids.txt", 10).tolist() == [[1, 2, 3], [4, 5, 6]]
    (tmp_path / "bad.txt").write_text("1 2 3\n4 50 6\n")
    with pytest.raises(ModelError, match=r"bad.txt:2: token id 50 outside \[0, 10\)"):
        read_tokens(tmp_path / "bad.txt", 10)
    assert torch.equal(random_tokens("2x5", 7), random_tokens("2x5", 7)) and random_tokens("2x5", 7).shape == (2, 5)
    with pytest.raises(ModelError, match="expected BxT"):
        random_tokens("2*5", 7)


# --- verify --------------------------------------------------------------------------------------

def _edit(path: Path, tensor: str, index: int, change) -> None:
    """Change one element of ``tensor`` in a safetensors file in place (raw bytes: the header
    gives its offsets)."""
    raw = bytearray(path.read_bytes())
    n = struct.unpack("<Q", raw[:8])[0]
    info = json.loads(raw[8:8 + n])[tensor]
    width = {"F8_E4M3": 1, "BF16": 2, "F32": 4}[info["dtype"]]
    at = 8 + n + info["data_offsets"][0] + index * width
    raw[at:at + width] = change(bytes(raw[at:at + width]))
    path.write_bytes(bytes(raw))


@pytest.fixture
def edited(tmp_path):
    """llm-compressor's FP8 tiny Llama with one weight code flipped (+1 on an ordinary code) and one
    weight scale changed by one bf16 ulp."""
    out = tmp_path / "llmc_fp8"
    shutil.copytree(CKPTS / "llmc_fp8", out)
    f = out / "model.safetensors"
    _edit(f, "model.layers.1.mlp.up_proj.weight", 5 * 64 + 7, lambda b: bytes([b[0] ^ 0x01]))
    _edit(f, "model.layers.0.self_attn.o_proj.weight_scale", 0,
          lambda b: struct.pack("<H", struct.unpack("<H", b)[0] + 1))
    return out


def test_verify_real_tool_checkpoints_pass():
    orig = fp8ref.load_checkpoint(CKPTS / "original_bf16")
    for fixture, recipe in (("llmc_fp8", None), ("llmc_fp8_dynamic", None), ("llmc_fp8_block", None),
                            ("autoround_fp8_static", None), ("autoround_fp8_static_llmc", "auto-round")):
        from fp8ref.nn.verify import verify

        r = verify(fp8ref.load_checkpoint(CKPTS / fixture), orig, recipe=recipe)
        assert r["ok"] and len(r["layers"]) == 14 and r["unquantized"]["checked"] == 7, fixture
        assert sum(x["codes"] for x in r["layers"]) == 2 * (2 * 64 * 64 + 2 * 32 * 64 + 3 * 64 * 128)


def test_verify_finds_one_flipped_code_and_one_changed_scale(edited, capsys):
    rc = main(["verify", str(edited), "--original", str(CKPTS / "original_bf16"), "--json", "-"])
    r = json.loads(capsys.readouterr().out)
    assert rc == 1 and not r["ok"]
    bad = {x["name"]: x for x in r["layers"] if x["code_mismatches"] or x["scale_mismatches"]}
    assert sorted(bad) == ["model.layers.0.self_attn.o_proj", "model.layers.1.mlp.up_proj"]
    up, o = bad["model.layers.1.mlp.up_proj"], bad["model.layers.0.self_attn.o_proj"]
    assert (up["code_mismatches"], up["first_code_mismatch"], up["scale_mismatches"]) == (1, [5, 7], 0)
    # the changed scale: every code of o_proj re-derived with the true scale still matches
    assert (o["code_mismatches"], o["scale_mismatches"], o["first_scale_mismatch"]) == (0, 1, [0])


def test_verify_cli_ok_and_recipe(capsys):
    orig = str(CKPTS / "original_bf16")
    assert main(["verify", str(CKPTS / "llmc_fp8_block"), "--original", orig]) == 0
    assert capsys.readouterr().out.strip().endswith(": OK")
    # auto-round wrote this one in compressed-tensors format: its own recipe, not compressed-tensors';
    # the file records none, so verify tries the known recipes and names the one that reproduces it
    assert main(["verify", str(CKPTS / "autoround_fp8_static_llmc"), "--original", orig]) == 0
    assert "with recipe 'auto-round' (found among the format's known recipes)" in capsys.readouterr().out
    assert main(["verify", str(CKPTS / "autoround_fp8_static_llmc"), "--original", orig,
                 "--recipe", "compressed-tensors"]) == 1
    assert "MISMATCH in 14 layers" in capsys.readouterr().out
    assert main(["verify", str(CKPTS / "autoround_fp8_static_llmc"), "--original", orig,
                 "--recipe", "auto-round"]) == 0


def test_compare_cli_without_transformers(monkeypatch, capsys):
    import sys

    monkeypatch.setitem(sys.modules, "transformers", None)
    assert main(["compare", str(CKPTS / "llmc_fp8"), "--random", "1x4"]) == 1
    assert "build_model needs transformers, which is not installed: pip install 'fp8ref[hf]'" in \
        capsys.readouterr().err


def test_compare_and_eval_cli(tmp_path, capsys):
    pytest.importorskip("transformers")
    out = tmp_path / "r.json"
    assert main(["compare", str(CKPTS / "llmc_fp8"), "--original", str(CKPTS / "original_bf16"),
                 "--modes", "reference,producer,original,backend:torch", "--random", "2x8", "--json",
                 str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["modes"] == ["reference", "producer", "original", "backend:torch"] and len(r["layers"]) == 14
    assert "first divergent" in capsys.readouterr().out
    (tmp_path / "t.txt").write_text("hello fp8 " * 30)
    assert main(["eval", str(CKPTS / "llmc_fp8"), "--text", str(tmp_path / "t.txt"), "--byte-tokens",
                 "--json", "-"]) == 0
    assert json.loads(capsys.readouterr().out)["tokens"] == 2 * 127  # 300 bytes: two sequences of 128


def test_bf16_scale_edit_is_one_ulp():  # the fixture edit above changes a value, not a dtype
    s = fp8ref.load_checkpoint(CKPTS / "llmc_fp8")["model.layers.0.self_attn.o_proj"].weight_scale
    assert s.dtype == ml_dtypes.bfloat16 and s.size == 1


def test_html_report_is_self_contained(tmp_path):
    """--html: PNG plots inline, no script, no network resource (a browser check is not part of this suite)."""
    pytest.importorskip("matplotlib")
    import base64
    import re

    from fp8ref.nn.html import render
    from fp8ref.nn.metrics import json_safe

    ckpt = fp8ref.load_checkpoint(CKPTS / "llmc_fp8")
    r = compare(_model(backend=PlantedBackend()), IDS, ["reference", "backend:planted", "reference:fp32"])
    page = render(json_safe({"checkpoint": "c", "format": ckpt.format, "input": "ids", **r}), ckpt)
    assert page.startswith("<!DOCTYPE html>") and "<script" not in page and "http" not in page
    srcs = re.findall(r'<img alt="[^"]+" src="([^"]+)">', page)
    assert len(srcs) == 2 * 2 + 1 == page.count("<img")
    for s in srcs:
        assert s.startswith("data:image/png;base64,")
        assert base64.b64decode(s.split(",", 1)[1])[:8] == b"\x89PNG\r\n\x1a\n"
    assert "model.layers.0.mlp.down_proj" in page and "first divergent (teacher-forced)" in page


def test_verify_a_recipe_that_cannot_have_produced_the_layer(tmp_path, capsys):
    """hf-fp8's recipe needs 128 x 128 blocks to divide the weight: with it, a 64-wide block checkpoint
    is unexplained (every byte counted), not an error; the recipe that made it (FP8_BLOCK's
    compressed-tensors, recorded in the shard's metadata by the export) verifies, with no --recipe."""
    out = tmp_path / "hf"
    orig = CKPTS / "original_bf16"
    fp8ref.export_checkpoint(orig, out, {"scheme": {"scheme": "FP8_BLOCK"}, "ignore": ["lm_head"]}, format="hf-fp8")
    assert main(["verify", str(out), "--original", str(orig), "--recipe", "hf-fp8", "--json", "-"]) == 1
    r = json.loads(capsys.readouterr().out)
    assert all("requires the block (128, 128) to divide the shape" in x["error"] for x in r["layers"])
    assert main(["verify", str(out), "--original", str(orig), "--json", "-"]) == 0
    r = json.loads(capsys.readouterr().out)  # bf16 scales stored widened to F32 by the export
    assert r["ok"] and {x["scale_note"] for x in r["layers"]} == {
        "derived bfloat16, compared widened to the stored float32"}
    assert (r["recipe"], r["recipe_source"]) == ("compressed-tensors", "recorded")


def test_verify_with_calibration_rederives_static_input_scales(tmp_path, capsys):
    """With the activation amax the export was given, every static input scale re-derives; one
    changed amax is one mismatching input scale (and only that)."""
    orig = CKPTS / "original_bf16"
    names = list(fp8ref.load_checkpoint(CKPTS / "llmc_fp8"))
    cal = {n: 0.5 + i / 7 for i, n in enumerate(names)}
    out = tmp_path / "static"
    fp8ref.export_checkpoint(orig, out, {"scheme": "FP8", "ignore": ["lm_head"]}, calibration=cal)
    fp8ref.write_calibration(tmp_path / "cal.json", cal)
    assert main(["verify", str(out), "--original", str(orig), "--calibration", str(tmp_path / "cal.json"),
                 "--json", "-"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert [x["input_scale"] for x in r["layers"]] == ["ok"] * 14
    cal[names[3]] *= 1.5
    fp8ref.write_calibration(tmp_path / "cal.json", cal)
    assert main(["verify", str(out), "--original", str(orig), "--calibration", str(tmp_path / "cal.json"),
                 "--json", "-"]) == 1
    r = json.loads(capsys.readouterr().out)
    assert r["mismatched_layers"] == [names[3]] and r["layers"][3]["input_scale"].startswith("mismatch: stored ")
    assert main(["verify", str(out), "--original", str(orig)]) == 0  # without calibration: not re-derived
    assert "14 static input scales not re-derived (give --calibration)" in capsys.readouterr().out


class LinearBackend:
    """fp8ref's own linear as a backend's (so bit-identical to mode reference); records its calls."""

    name = "mylinear"

    def __init__(self):
        self.calls = []

    def implements(self, op, params):
        return None if op == "linear" and params["accumulate"] == "exact" else "exact linear only"

    def linear(self, x, weight, weight_scale, *, input_scale, dynamic, accumulate):
        self.calls.append((x.dtype.name, weight.shape, dynamic, input_scale is not None, accumulate))
        return fp8ref.linear(x, weight, weight_scale.astype(np.float32), input_scale=input_scale, dynamic=dynamic,
                             accumulate=accumulate)


@pytest.mark.parametrize("fixture, dynamic, scheme", [("llmc_fp8", None, "FP8"),
                                                      ("llmc_fp8_dynamic", "token", "FP8_DYNAMIC"),
                                                      ("autoround_fp8_static", None, "FP8_STATIC")])
def test_backend_mode_runs_the_backends_linear(fixture, dynamic, scheme):
    be = LinearBackend()
    r = compare(_model(fixture, backend=be), IDS, ["reference", "backend:mylinear"])
    assert be.calls and all(c[0] == "bfloat16" and c[2] == dynamic and c[3] == (dynamic is None) for c in be.calls)
    assert r["first_divergent"]["backend:mylinear"] == {"teacher_forced": None, "free_running": None}
    tf = r["layers"][0]["teacher_forced"]["backend:mylinear"]
    assert "scaled_mm" not in tf and tf["linear"]["accumulate"] == "exact"
    assert tf["linear"]["scheme"] == scheme


@pytest.mark.parametrize("T", [2, 16, 17, 40])
def test_perplexity_in_pieces_equals_the_whole_array_log_softmax(T):
    """perplexity() takes its float64 log-softmax 16 positions at a time (bounded memory at a 128k
    vocabulary); the bytes equal the log-softmax of the whole (B, T-1, V) array at once."""
    g = torch.Generator().manual_seed(T)
    logits = (torch.randn(3, T, 300, generator=g) * 6).to(torch.bfloat16)
    ids = torch.randint(0, 300, (3, T), generator=g)
    a = logits.to(torch.float64).numpy()[:, :-1]
    la = a - a.max(-1, keepdims=True)
    la = la - np.log(np.exp(la).sum(-1, keepdims=True))
    whole = float(np.exp((-np.take_along_axis(la, ids[:, 1:].numpy()[..., None], axis=-1)).mean()))
    assert struct.pack("<d", perplexity(logits, ids)) == struct.pack("<d", whole)
