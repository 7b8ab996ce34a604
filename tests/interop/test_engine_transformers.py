"""``fp8ref explain CKPT --engine transformers``: each step's statement (specs/engines/transformers.yaml,
read in transformers 5.17's source) checked against a real ``AutoModelForCausalLM.from_pretrained`` of
the checkpoint on this machine's CPU, and each count against an independent one (torch's own float8
cast, float64 products)."""

from __future__ import annotations

import numpy as np
import pytest

import fp8ref
from fp8ref.checkpoint.engine import explain
from tests.support.cli import run_cli
from tests.support.moe_checkpoints import CKPTS

pytestmark = pytest.mark.interop
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")


def _reload(folder, **kw):
    return transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.bfloat16, **kw)


def _torch_values(layer, scale_rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32(q) * fp32(s) by torch's own float8 cast, the exact float64 q * s), s expanded per block."""
    q = torch.from_numpy(np.ascontiguousarray(layer.weight_codes)).view(torch.float8_e4m3fn)
    s = torch.from_numpy(np.asarray(layer.weight_scale).astype(np.float32))
    rows, cols = layer.shape
    if s.ndim == 2 and s.shape != (rows, 1):  # blocks: rows per scale row as given (default the format's 128)
        r = scale_rows or 128
        s = s.repeat_interleave(r, 0)[:rows].repeat_interleave(128, 1)[:, :cols]
    return q.float() * s, q.double() * s.double()


def test_mixtral_experts_under_other_names_are_unexpected_and_random():
    folder = CKPTS / "llmc_mixtral_fp8_dynamic"
    meta, steps, effects = explain(fp8ref.load_checkpoint(folder), "transformers")
    assert meta["target"] == "cpu" and steps[0].name == "expert-names-not-read"
    rows = [e for e in effects if e.step == "expert-names-not-read"]
    assert [e.layer for e in rows] == [f"model.layers.{i}.block_sparse_moe.experts" for i in range(2)]
    model, info = _reload(folder, output_loading_info=True)
    unexpected = sorted(info["unexpected_keys"])
    assert sum(e.codes_changed for e in rows) == len(unexpected) == 48
    assert all(".experts." in k and any(f".{p}." in k for p in ("gate_proj", "up_proj", "down_proj"))
               for k in unexpected)
    ckpt = fp8ref.load_checkpoint(folder)
    stored = torch.from_numpy(ckpt["model.layers.0.block_sparse_moe.experts.0.gate_proj"].dequantize("float32"))
    held = model.model.layers[0].mlp.experts.gate_up_proj[0, :stored.shape[0]].float()
    assert (held - stored).abs().max() > stored.abs().max() / 4  # not the checkpoint's expert


def test_experts_run_w8a16_dequantized_to_bf16_while_attention_stays_quantized():
    folder = CKPTS / "llmc_qwen3_moe_fp8_dynamic"
    ckpt = fp8ref.load_checkpoint(folder)
    _, _, effects = explain(ckpt, "transformers")
    assert {e.step for e in effects} == {"experts-dequantized-w8a16"}  # names read, one block per expert
    rows = {e.layer: e for e in effects}
    assert sorted(rows) == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    model = _reload(folder)
    for i in range(2):
        experts = model.model.layers[i].mlp.experts
        changed = elements = 0
        for e in range(4):
            parts = []
            for proj in ("gate_proj", "up_proj", "down_proj"):
                f32, exact = _torch_values(ckpt[f"model.layers.{i}.mlp.experts.{e}.{proj}"])
                parts.append(f32.to(torch.bfloat16))
                changed += int((f32.to(torch.bfloat16).double() != exact).sum())
                elements += exact.numel()
            assert torch.equal(experts.gate_up_proj[e], torch.cat(parts[:2]))  # bf16(fp32(q) * fp32(s))
            assert torch.equal(experts.down_proj[e], parts[2])
        assert (rows[experts_name := f"model.layers.{i}.mlp.experts"].values_changed, rows[experts_name].elements) == \
            (changed, elements)
        # no quantization wraps the fused experts; compressed-tensors wraps attention (W8A8)
        assert getattr(experts, "quantization_scheme", None) is None
        assert getattr(model.model.layers[i].self_attn.q_proj, "quantization_scheme", None) is not None
    assert not [e for e in explain(fp8ref.load_checkpoint(CKPTS / "llmc_qwen3_moe_fp8_block"), "transformers")[2]
                if e.step == "decompress-experts-broadcast"]  # single-block experts broadcast: the reload runs
    _reload(CKPTS / "llmc_qwen3_moe_fp8_block")


def test_hf_fp8_80_row_blocks(tmp_path):
    pytest.importorskip("accelerate")  # transformers' fp8 quantizer requires it
    out = tmp_path / "hf"
    fp8ref.export_checkpoint(CKPTS / "moe_deepseek_v3_bf16", out,
                             {"scheme": {"scheme": "FP8_BLOCK"}, "ignore": ["lm_head", "re:.*mlp\\.gate$"]},
                             format="hf-fp8")
    ckpt = fp8ref.load_checkpoint(out)
    rows = {e.layer: e for e in explain(ckpt, "transformers")[2] if e.step == "fine-grained-fp8-block-geometry"}
    assert sorted(rows) == [f"model.layers.{i}.self_attn.kv_a_proj_with_mqa" for i in range(2)]
    model = _reload(out)
    for i in range(2):
        layer = ckpt[f"model.layers.{i}.self_attn.kv_a_proj_with_mqa"]
        f32_80, exact_80 = _torch_values(layer, scale_rows=80)
        _, exact_128 = _torch_values(layer)
        held = model.model.layers[i].self_attn.kv_a_proj_with_mqa.weight
        assert torch.equal(held, f32_80.to(torch.bfloat16))  # transformers' 80-row blocks, bit for bit
        e = rows[layer.name]
        assert e.note.startswith("80x128 blocks") and e.values_changed == int((exact_80 != exact_128).sum()) > 0


def test_cli_text_and_json(capsys, tmp_path):
    import json

    folder = CKPTS / "llmc_mixtral_fp8_dynamic"
    assert run_cli("explain", folder, "--engine", "transformers") == 0
    text = capsys.readouterr().out
    assert "transformers on cpu" in text and "max |change| n/a" in text and "UNEXPECTED" in text
    out = tmp_path / "e.json"
    assert run_cli("explain", folder, "--engine", "transformers", "--json", out) == 0
    data = json.loads(out.read_text())
    assert data["target"] == "cpu" and data["engine"] == "transformers"
    assert {e["step"] for e in data["effects"]} == {"expert-names-not-read", "experts-dequantized-w8a16"}
