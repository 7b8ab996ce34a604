"""``fp8ref verify --original`` accounts for every original tensor: one the checkpoint holds neither
quantized nor unquantized (a dropped layer, a block's experts, a norm) fails the run with a line per
module and the lists in --json; names a producer maps (Mixtral w1/w3/w2, gpt-oss fused experts) are
not missing; unquantized tensors, quantized layers' biases included, are compared byte for byte, or
by the cast rule where the checkpoint holds them in another float dtype (the cast computed here by
torch, independently of fp8ref's numpy path)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from fp8ref.io.safetensors import SafetensorsFile, write_safetensors
from tests.support.cli import run_cli

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"
CKPTS = FIXTURES / "interop" / "checkpoints"
DENSE, ORIGINAL = CKPTS / "llmc_fp8_dynamic", CKPTS / "original_bf16"


def edited(src: Path, dst: Path, edit, config_edit=None) -> Path:
    """A copy of checkpoint folder ``src`` whose tensors ``edit`` changed (name -> (dtype, array))."""
    f = SafetensorsFile(src / "model.safetensors")
    tensors = {n: (f.info(n).dtype, np.array(f.get(n))) for n in f.tensors}
    edit(tensors)
    dst.mkdir()
    write_safetensors(dst / "model.safetensors", tensors, f.metadata)
    for extra in src.glob("*.json"):
        shutil.copy(extra, dst / extra.name)
    if config_edit is not None:
        cfg = json.loads((dst / "config.json").read_text())
        config_edit(cfg)
        (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def drop(*prefixes):
    def edit(t):
        for n in [n for n in t if n.startswith(prefixes)]:
            del t[n]
    return edit


def report(ckpt, original, capsys) -> tuple[int, list[str], dict]:
    rc = run_cli("verify", ckpt, "--original", original)
    lines = capsys.readouterr().out.splitlines()
    assert run_cli("verify", ckpt, "--original", original, "--json", "-") == rc
    return rc, lines, json.loads(capsys.readouterr().out)


def test_a_dropped_layer_is_reported_missing(tmp_path, capsys):
    ckpt = edited(DENSE, tmp_path / "ckpt", drop("model.layers.1.mlp.up_proj."))
    rc, lines, res = report(ckpt, ORIGINAL, capsys)
    assert rc == 1 and not res["ok"] and len(res["layers"]) == 13 and not res["mismatched_layers"]
    assert res["missing"] == ["model.layers.1.mlp.up_proj.weight"]
    assert res["missing_layers"] == {"model.layers.1.mlp.up_proj": ["weight"]}
    assert lines[0] == ("model.layers.1.mlp.up_proj: the original's weight is not in the checkpoint, neither "
                        "quantized nor unquantized")
    assert lines[-1].endswith("13 layers re-derived with recipe 'compressed-tensors' (found among the format's "
                              "known recipes), 7 unquantized tensors compared: MISMATCH 1 original module missing "
                              "from the checkpoint")


def test_a_dropped_norm_and_embedding_are_reported_missing(tmp_path, capsys):
    ckpt = edited(DENSE, tmp_path / "ckpt", drop("model.layers.0.input_layernorm.", "model.embed_tokens."))
    rc, lines, res = report(ckpt, ORIGINAL, capsys)
    assert rc == 1 and res["missing"] == ["model.embed_tokens.weight", "model.layers.0.input_layernorm.weight"]
    assert "5 unquantized tensors compared: MISMATCH 2 original modules missing from the checkpoint" in lines[-1]


def test_a_moe_block_without_its_experts_is_reported_missing(tmp_path, capsys):
    ckpt = edited(CKPTS / "llmc_qwen3_moe_fp8_dynamic", tmp_path / "ckpt", drop("model.layers.1.mlp.experts."))
    original = SafetensorsFile(CKPTS / "moe_qwen3_moe_bf16" / "model.safetensors")
    expected = sorted(n for n in original.tensors if n.startswith("model.layers.1.mlp.experts."))
    rc, lines, res = report(ckpt, CKPTS / "moe_qwen3_moe_bf16", capsys)
    assert rc == 1 and res["missing"] == expected and len(expected) == len(res["missing_layers"]) > 3
    assert f"MISMATCH {len(expected)} original modules missing from the checkpoint" in lines[-1]


@pytest.mark.parametrize("ckpt, original", [
    (CKPTS / "llmc_mixtral_fp8_dynamic", CKPTS / "moe_mixtral_bf16"),  # w1/w3/w2 -> gate/up/down_proj
    (CKPTS / "llmc_deepseek_v3_fp8_block", CKPTS / "moe_deepseek_v3_bf16"),
    (FIXTURES / "gptoss" / "mxfp4", FIXTURES / "gptoss" / "original_bf16"),  # fused experts, biases
])
def test_mapped_names_are_not_missing(ckpt, original, capsys):
    rc, _, res = report(ckpt, original, capsys)
    names = set(SafetensorsFile(original / "model.safetensors").tensors)
    assert rc == 0 and res["missing"] == [] and res["unquantized"]["mismatched"] == []
    # every original tensor is accounted for: the quantized layers' plus the compared unquantized ones
    assert len(res["layers"]) + res["unquantized"]["checked"] == len(names)


def test_a_quantized_layers_bias_is_compared(tmp_path, capsys):
    bias = "model.layers.1.mlp.experts.down_proj_bias"

    def edit(t):
        t[bias][1].view(np.uint16)[0, 0] ^= 1
    ckpt = edited(FIXTURES / "gptoss" / "mxfp4", tmp_path / "ckpt", edit)
    rc, lines, res = report(ckpt, FIXTURES / "gptoss" / "original_bf16", capsys)
    assert rc == 1 and res["unquantized"]["mismatched"] == [bias] and not res["mismatched_layers"]
    assert f"{bias}: unquantized tensor differs from the original: bytes differ" in lines


def test_a_tied_lm_head_is_not_missing(tmp_path, capsys):
    def tie(cfg):
        cfg["tie_word_embeddings"] = True
    untied = edited(DENSE, tmp_path / "untied", drop("lm_head."))
    assert report(untied, ORIGINAL, capsys)[2]["missing"] == ["lm_head.weight"]
    tied = edited(DENSE, tmp_path / "tied", drop("lm_head."), tie)
    assert report(tied, ORIGINAL, capsys)[0] == 0


def _bf16_bits(x: torch.Tensor) -> np.ndarray:
    return x.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


def test_unquantized_tensors_cast_by_the_producer(tmp_path, capsys):
    """A BF16 norm written as F32 (llama.cpp's converter does so) is the original widened; an F32
    original's norm written as BF16 must be its round-to-nearest-even cast (torch's ``.to``), and a
    truncation instead is reported."""
    norm = "model.norm.weight"
    orig = SafetensorsFile(ORIGINAL / "model.safetensors")
    bf16 = torch.from_numpy(np.array(orig.get(norm, bf16_bits=True)).view(np.int16)).view(torch.bfloat16)

    def widen(t):
        t[norm] = ("F32", bf16.float().numpy())
    rc, lines, res = report(edited(DENSE, tmp_path / "widened", widen), ORIGINAL, capsys)
    assert rc == 0 and res["unquantized"]["cast"] == {norm: "cast BF16 to F32"}
    assert "1 unquantized tensor compared as the producer's cast BF16 to F32" in lines[-1]

    # an F32 original whose norm has bits below bfloat16's, some at a tie
    f32 = bf16.float().numpy().copy()
    f32.view(np.uint32)[:] |= np.uint32(0x8000) * (np.arange(f32.size) % 2).astype(np.uint32)
    f32.view(np.uint32)[::3] += np.uint32(0x1234)

    def f32_original(t):
        t[norm] = ("F32", f32)
    original = edited(ORIGINAL, tmp_path / "orig-f32", f32_original)
    rne = _bf16_bits(torch.from_numpy(f32))
    truncated = (f32.view(np.uint32) >> 16).astype(np.uint16)
    assert not np.array_equal(rne, truncated)
    for bits, ok in ((rne, True), (truncated, False)):
        def narrow(t, bits=bits):
            t[norm] = ("BF16", bits)
        rc, lines, res = report(edited(DENSE, tmp_path / f"narrow-{ok}", narrow), original, capsys)
        assert (rc == 0) == ok and res["unquantized"]["cast"] == ({norm: "cast F32 to BF16"} if ok else {})
        if not ok:
            assert f"{norm}: unquantized tensor differs from the original: BF16, not the original's F32 cast to it" \
                in lines
