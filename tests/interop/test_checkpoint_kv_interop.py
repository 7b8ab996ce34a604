"""fp8ref's compressed-tensors KV-cache scales read by the real tools (interop env only):
compressed-tensors parses the kv_cache_scheme, computes the same scale from the same amax, and
transformers + compressed-tensors load ``self_attn.{k,v}_scale`` into the model bit for bit.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from fp8ref.checkpoint import export_checkpoint, load_checkpoint

pytestmark = pytest.mark.interop

# exact in bfloat16 (the observer works on bf16 key/value states), 0 included (eps rule)
AMAX = [0.0, 2.0 ** -130, 0.0078125, 1.0, 1.3984375, 3.75, 448.0, 9984.0]


def _tiny_llama(folder, layers: int = 2):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                   max_position_embeddings=64, tie_word_embeddings=False)
    transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(folder)


def test_compressed_tensors_computes_the_same_kv_scale(tmp_path):
    torch = pytest.importorskip("torch")
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.quantization import QuantizationConfig
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    _tiny_llama(tmp_path / "src", layers=len(AMAX) // 2)
    cal = {}
    for i, a in enumerate(AMAX):
        cal[f"model.layers.{i // 2}.self_attn.{'kv'[i % 2]}_scale"] = a
    import importlib.metadata as md

    installed = ".".join(md.version("compressed-tensors").split(".")[:2])  # write as the installed version does
    export_checkpoint(tmp_path / "src", tmp_path / "out", {"scheme": "FP8_DYNAMIC", "ignore": ["lm_head"]},
                      calibration=cal, config_version=installed)
    qc = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    args = QuantizationConfig.model_validate(qc).kv_cache_scheme
    assert args is not None and args.model_dump(mode="json") == qc["kv_cache_scheme"]
    ckpt = load_checkpoint(tmp_path / "out")
    for name, a in cal.items():
        amax = torch.tensor([a], dtype=torch.bfloat16)
        theirs, _ = calculate_qparams(-amax, amax, args)
        mine = torch.from_numpy(ckpt.tensor(name).view(np.int16).copy())
        assert theirs.dtype == torch.bfloat16 and torch.equal(theirs.view(torch.int16), mine), (name, a)


def test_transformers_loads_fp8ref_kv_scales(tmp_path, monkeypatch):
    torch = pytest.importorskip("torch")
    pytest.importorskip("compressed_tensors")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM

    _tiny_llama(tmp_path / "src")
    cal = {"model.layers.0.self_attn.k_scale": 1.3984375, "model.layers.0.self_attn.v_scale": 3.75,
           "model.layers.1.self_attn.k_proj.output_amax": 0.0, "model.layers.1.self_attn.v_proj.output_amax": 448.0}
    export_checkpoint(tmp_path / "src", tmp_path / "out", {"scheme": "FP8_DYNAMIC", "ignore": ["lm_head"]},
                      calibration=cal)
    ckpt = load_checkpoint(tmp_path / "out")
    assert ckpt.warnings == [] and len(ckpt.kv_scales) == 4
    model, info = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.bfloat16,
                                                       output_loading_info=True)
    assert not [k for k in info["missing_keys"] if k.endswith(("k_scale", "v_scale"))], info
    assert not [k for k in info["unexpected_keys"] if k.endswith(("k_scale", "v_scale"))], info
    params = dict(model.named_parameters())
    for name in ckpt.kv_scales:
        theirs = params[name]
        mine = torch.from_numpy(ckpt.tensor(name).view(np.int16).copy())
        assert theirs.dtype == torch.bfloat16 and list(theirs.shape) == [1], name
        assert torch.equal(theirs.detach().view(torch.int16), mine), name
