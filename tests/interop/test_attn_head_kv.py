"""llm-compressor 0.14.0.1's ``attn_head`` KV-cache strategy (fixture llmc_fp8_attn_head, made on CPU
by tools/make_kvhead_fixture.py): fp8ref reads the per-head k_scale / v_scale [n_kv_heads, 1, 1],
producer mode is transformers + compressed-tensors' own reload bit for bit (its forward_quantize of
K and V with a per-head scale broadcast, computed here in the interop env and also stored in the
fixture), and reference mode uses the per-head scales."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import fp8ref

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "interop" / "checkpoints" / "llmc_fp8_attn_head"
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def _stored():
    from safetensors.torch import load_file

    return load_file(str(FIXTURE / "reference_outputs.safetensors"))


def _attention_out(model, hidden, pos):
    from transformers.masking_utils import create_causal_mask

    attn = model.model.layers[0].self_attn
    with torch.no_grad():
        emb = model.model.rotary_emb(hidden, pos)
        mask = create_causal_mask(config=model.config, inputs_embeds=hidden, attention_mask=None,
                                  past_key_values=None, position_ids=pos)
        return attn(hidden_states=hidden, position_embeddings=emb, attention_mask=mask)[0]


def test_fp8ref_reads_the_per_head_scales_the_tool_wrote():
    from safetensors.torch import load_file

    from fp8ref.nn.attention import kv_scales

    qc = json.loads((FIXTURE / "config.json").read_text())["quantization_config"]
    assert qc["kv_cache_scheme"]["strategy"] == "attn_head" and qc["config_groups"] == {}
    stored = {k: v for k, v in load_file(str(FIXTURE / "model.safetensors")).items() if k.endswith("_scale")}
    assert sorted(stored) == [f"model.layers.{i}.self_attn.{w}_scale" for i in range(2) for w in "kv"]
    scales = kv_scales(fp8ref.load_checkpoint(FIXTURE))
    for attn, s in scales.items():
        for w in "kv":
            t = stored[f"{attn}.{w}_scale"]
            assert t.shape == (2, 1, 1) and t.dtype == torch.bfloat16
            assert s[w].shape == (2,) and np.array_equal(s[w], t.float().numpy().reshape(-1))
            assert s[w][0] != s[w][1]  # per head, not one scale repeated


def test_producer_mode_equals_the_stored_reload_output_and_reference_differs():
    from fp8ref.nn import build_model

    ys = _stored()
    hidden, pos, want = ys["attn.hidden"], ys["attn.position_ids"], ys["attn.out"]
    producer = build_model(FIXTURE, mode="producer")
    got = _attention_out(producer, hidden, pos)
    assert got.dtype == want.dtype == torch.bfloat16
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    plain = _attention_out(build_model(FIXTURE, mode="producer", kv_cache=False), hidden, pos)
    assert not torch.equal(plain, want)  # the stored output is quantized: the check can fail
    reference = _attention_out(build_model(FIXTURE, mode="reference"), hidden, pos)
    assert not torch.equal(reference, plain)


@pytest.mark.interop
def test_producer_mode_equals_compressed_tensors_reload_here():
    """The same against transformers + compressed-tensors 0.19 run now (interop env)."""
    pytest.importorskip("compressed_tensors")
    from fp8ref.nn import build_model

    ys = _stored()
    hidden, pos = ys["attn.hidden"], ys["attn.position_ids"]
    tool = transformers.AutoModelForCausalLM.from_pretrained(str(FIXTURE), dtype=torch.bfloat16).eval()
    with torch.no_grad():
        tool(torch.tensor([[1, 2, 3]]))  # compressed-tensors' decompress hook
    want = _attention_out(tool, hidden, pos)
    assert torch.equal(want.view(torch.int16), ys["attn.out"].view(torch.int16))
    got = _attention_out(build_model(FIXTURE, mode="producer"), hidden, pos)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
