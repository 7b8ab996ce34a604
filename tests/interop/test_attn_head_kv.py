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


@pytest.mark.interop
def test_compressed_tensors_reads_fp8refs_per_head_export(tmp_path):
    """fp8ref's export with one KV amax per head: compressed-tensors validates the kv_cache_scheme,
    computes the same [2, 1, 1] scales from the same per-head amax (calculate_qparams), and
    transformers + compressed-tensors load them without missing or unexpected keys."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.quantization import QuantizationConfig
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    from fp8ref.checkpoint import export_checkpoint

    amax = {f"model.layers.{i}.self_attn.{w}_scale": [[0.0, 1.3984375], [3.75, 448.0]][i] for i in range(2)
            for w in "kv"}
    original = FIXTURE.parent / "original_bf16"
    export_checkpoint(original, tmp_path / "out", {"scheme": "FP8_DYNAMIC", "ignore": ["lm_head"]},
                      calibration=amax, config_version="0.19")
    qc = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    args = QuantizationConfig.model_validate(qc).kv_cache_scheme
    assert args.strategy == "attn_head"
    ckpt = fp8ref.load_checkpoint(tmp_path / "out")
    for name, a in amax.items():
        hi = torch.tensor(a, dtype=torch.bfloat16).reshape(2, 1, 1)
        theirs, _ = calculate_qparams(-hi, hi, args)
        mine = torch.from_numpy(ckpt.tensor(name).view(np.int16).copy())
        assert theirs.dtype == torch.bfloat16 and torch.equal(theirs.view(torch.int16).reshape(-1), mine.reshape(-1))
    model, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.bfloat16,
                                                                    output_loading_info=True)
    assert not [k for k in {*info["missing_keys"], *info["unexpected_keys"]} if k.endswith(("k_scale", "v_scale"))]
    params = dict(model.named_parameters())
    for name in amax:
        assert params[name].shape == (2, 1, 1)
        assert torch.equal(params[name].detach().view(torch.int16).reshape(-1),
                           torch.from_numpy(ckpt.tensor(name).view(np.int16).copy()).reshape(-1))


@pytest.mark.interop
def test_producer_mode_quantizes_q_per_head_as_compressed_tensors_reload_does(tmp_path):
    """The fixture with a per-head q_scale [4, 1, 1] added under a weightless attention group (what
    llm-compressor would write if its q observer ran): transformers + compressed-tensors' reload
    quantizes Q with it (QuantizedAttentionImpl), and producer mode does the same, bit for bit."""
    pytest.importorskip("compressed_tensors")
    import shutil

    from safetensors.torch import load_file, save_file

    from fp8ref.nn import build_model

    out = tmp_path / "q"
    shutil.copytree(FIXTURE, out)
    tensors = load_file(str(out / "model.safetensors"))
    for i in range(2):
        tensors[f"model.layers.{i}.self_attn.q_scale"] = torch.tensor([0.004, 0.02, 0.0009765625, 0.125],
                                                                      dtype=torch.bfloat16).reshape(4, 1, 1)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    qc = cfg["quantization_config"]
    qc["config_groups"] = {"group_0": {"format": "dense", "input_activations": dict(qc["kv_cache_scheme"]),
                                       "output_activations": None, "targets": ["LlamaAttention"], "weights": None}}
    (out / "config.json").write_text(json.dumps(cfg))
    ys = _stored()
    hidden, pos = ys["attn.hidden"], ys["attn.position_ids"]
    tool = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.bfloat16).eval()
    with torch.no_grad():
        tool(torch.tensor([[1, 2, 3]]))
    assert hasattr(tool.model.layers[0].self_attn, "q_scale")
    want = _attention_out(tool, hidden, pos)
    assert not torch.equal(want, ys["attn.out"])  # Q quantization changes the output
    got = _attention_out(build_model(out, mode="producer"), hidden, pos)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


@pytest.mark.interop
def test_compressed_tensors_reloads_fp8refs_per_head_query_export(tmp_path):
    """fp8ref's export with per-head Q, K and V amax from a calibration file: compressed-tensors 0.19
    validates the config and computes the same q/k/v scales per head (calculate_qparams);
    transformers + compressed-tensors load every scale (no missing or unexpected key) as stored,
    quantize Q with it, and fp8ref's producer mode gives the same attention output bit for bit."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.quantization import QuantizationConfig
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    from fp8ref.checkpoint import export_checkpoint
    from fp8ref.checkpoint.calibration_file import write_calibration
    from fp8ref.nn import build_model

    amax = {f"model.layers.{i}.self_attn.{w}_scale": ([0.0, 1.3984375] if w != "q" else [0.5, 3.0, 7.5, 448.0])
            for i in range(2) for w in "qkv"}
    cal = write_calibration(tmp_path / "cal.json", {}, kv_amax=amax)
    out = tmp_path / "out"
    export_checkpoint(FIXTURE.parent / "original_bf16", out, {"scheme": "FP8_DYNAMIC", "ignore": ["lm_head"]},
                      calibration=cal, config_version="0.19")
    qc = QuantizationConfig.model_validate(json.loads((out / "config.json").read_text())["quantization_config"])
    attention = qc.config_groups["group_0"]
    assert attention.weights is None and attention.input_activations.strategy == "attn_head"
    ckpt = fp8ref.load_checkpoint(out)
    for name, a in amax.items():
        hi = torch.tensor(a, dtype=torch.bfloat16).reshape(-1, 1, 1)
        theirs, _ = calculate_qparams(-hi, hi, attention.input_activations)
        mine = torch.from_numpy(ckpt.tensor(name).view(np.int16).copy())
        assert torch.equal(theirs.view(torch.int16).reshape(-1), mine.reshape(-1)), name
    tool, info = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.bfloat16,
                                                                   output_loading_info=True)
    assert not [k for k in {*info["missing_keys"], *info["unexpected_keys"]} if k.endswith("_scale")], info
    params = dict(tool.named_parameters())
    for name in amax:
        assert torch.equal(params[name].detach().view(torch.int16).reshape(-1),
                           torch.from_numpy(ckpt.tensor(name).view(np.int16).copy()).reshape(-1)), name
    tool.eval()
    with torch.no_grad():
        tool(torch.tensor([[1, 2, 3]]))  # compressed-tensors' decompress hook
    ys = _stored()
    hidden, pos = ys["attn.hidden"], ys["attn.position_ids"]
    want = _attention_out(tool, hidden, pos)
    got = _attention_out(build_model(out, mode="producer"), hidden, pos)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    plain = _attention_out(build_model(out, mode="producer", kv_cache=False), hidden, pos)
    assert not torch.equal(plain, want)  # Q, K and V quantization changed the output: the check can fail
