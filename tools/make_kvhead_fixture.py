"""Write the per-head attention/KV-scale fixture with the REAL llm-compressor, on CPU.

llm-compressor 0.14's ``attn_head`` strategy on the attention modules: ``self_attn.q_scale``
[n_heads, 1, 1] and ``self_attn.k_scale`` / ``v_scale`` [n_kv_heads, 1, 1], static, calibrated
on random token batches (no download). The Linear weights stay bf16 (only attention is quantized),
so the fixture is the tiny Llama of make_interop_fixtures plus six small scale tensors.

Writes tests/fixtures/interop/checkpoints/llmc_fp8_attn_head/: the tool's config.json and
model.safetensors, fixture.json (how, versions) and reference_outputs.safetensors: for layer 0's
attention, ``attn.hidden`` (the bf16 input), ``attn.position_ids`` and ``attn.out`` — the
attention output of transformers + compressed-tensors' own reload (its forward_quantize of q, k, v
with the stored per-head scales, then transformers' eager attention).

Q is not quantized: with an attn_head input-activation group on LlamaAttention, llm-compressor
0.14.0.1 (transformers 5.17, CPU) never calls the q observer (the attention modules' config says
'eager' during calibration, so compressed-tensors' hooked attention holding the query hook is
bypassed) and saves q_scale from torch.empty, i.e. uninitialised memory.

Also writes tests/fixtures/interop/checkpoints/llmc_fp8_attn_head_q/: what llm-compressor writes for
Q (the layout fp8ref's per-head Q export follows): FP8_DYNAMIC Linear layers plus an attn_head group on
LlamaAttention. Only config.json and fixture.json (with every scale tensor's name, dtype and shape) are
kept: the q_scale values are uninitialised memory, as above.

Usage: /work/venvs/interop/bin/python tools/make_kvhead_fixture.py [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

sys.path.insert(0, str(Path(__file__).resolve().parent))

import make_interop_fixtures as mif  # noqa: E402
import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "tests" / "fixtures" / "interop" / "checkpoints"
NAME = "llmc_fp8_attn_head"
ATTN_HEAD = {"num_bits": 8, "type": "float", "strategy": "attn_head", "symmetric": True, "dynamic": False}


def export(folder: Path) -> dict:
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier

    model = mif.saved_tiny_llama(folder.parent / "base")
    recipe = QuantizationModifier(kv_cache_scheme=ATTN_HEAD)
    ids = [b[0].tolist() for b in mif.calib_batches()]
    oneshot(model=model, recipe=recipe,
            dataset=Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * len(r) for r in ids]}),
            num_calibration_samples=len(ids), max_seq_length=len(ids[0]), processor=mif.tiny_tokenizer())
    model.save_pretrained(str(folder), save_compressed=True)
    return {"tool": "llmcompressor", "function": "llmcompressor.oneshot + model.save_pretrained(save_compressed=True)",
            "arguments": {"recipe": f"QuantizationModifier(kv_cache_scheme={ATTN_HEAD})",
                          "calibration": "4 random token batches of 16 tokens (seed 77), datasets.Dataset.from_dict"}}


def export_with_query(folder: Path) -> dict:
    """FP8_DYNAMIC Linear layers and an attn_head group on LlamaAttention (q, k and v scales per head)."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme, preset_name_to_scheme
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from safetensors import safe_open

    model = mif.saved_tiny_llama(folder.parent / "base_q")
    attention = QuantizationScheme(targets=["LlamaAttention"], input_activations=QuantizationArgs(**ATTN_HEAD))
    groups = {"linear": preset_name_to_scheme("FP8_DYNAMIC", ["Linear"]), "attention": attention}
    ids = [b[0].tolist() for b in mif.calib_batches()]
    oneshot(model=model, recipe=QuantizationModifier(ignore=["lm_head"], config_groups=groups),
            dataset=Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * len(r) for r in ids]}),
            num_calibration_samples=len(ids), max_seq_length=len(ids[0]), processor=mif.tiny_tokenizer())
    model.save_pretrained(str(folder), save_compressed=True)
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        scales = mif.describe({k: f.get_tensor(k) for k in f.keys() if k.endswith("_scale")})
    return {"tool": "llmcompressor", "function": "llmcompressor.oneshot + model.save_pretrained(save_compressed=True)",
            "arguments": {"recipe": "QuantizationModifier(ignore=['lm_head'], config_groups={'linear': "
                                    "preset_name_to_scheme('FP8_DYNAMIC', ['Linear']), 'attention': QuantizationScheme("
                                    f"targets=['LlamaAttention'], input_activations={ATTN_HEAD})}})",
                          "calibration": "4 random token batches of 16 tokens (seed 77), datasets.Dataset.from_dict"},
            "kept": "config.json only: the q_scale values are torch.empty memory (the q observer never runs)",
            "scale_tensors": scales}


def reload_attention(folder: Path) -> tuple[dict[str, torch.Tensor], dict]:
    """Layer 0's attention output in transformers + compressed-tensors' own reload (eager attention)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.bfloat16).eval()
    g = torch.Generator().manual_seed(99)
    hidden = (torch.randn(1, 6, mif.LLAMA["hidden_size"], generator=g)
              * torch.exp(torch.randn(1, 6, mif.LLAMA["hidden_size"], generator=g))).to(torch.bfloat16)
    pos = torch.arange(6)[None]
    captured = {}
    attn = model.model.layers[0].self_attn

    def hook(mod, args, kwargs, out):
        captured["out"] = out[0]

    with torch.no_grad():
        model(torch.tensor([[1, 2, 3]]))  # compressed-tensors' decompress hook
        h = attn.register_forward_hook(hook, with_kwargs=True)
        emb = model.model.rotary_emb(hidden, pos)
        from transformers.masking_utils import create_causal_mask
        mask = create_causal_mask(config=model.config, inputs_embeds=hidden, attention_mask=None,
                                  past_key_values=None, position_ids=pos)
        attn(hidden_states=hidden, position_embeddings=emb, attention_mask=mask)
        h.remove()
    desc = {"module_class": f"{type(attn).__module__}.{type(attn).__name__}",
            "parameters": sorted(n for n, _ in attn.named_parameters(recurse=False)),
            "attn_implementation": model.config._attn_implementation,
            "mask": "transformers.masking_utils.create_causal_mask (eager: additive 0 / dtype min)"}
    return {"attn.hidden": hidden, "attn.position_ids": pos, "attn.out": captured["out"].contiguous()}, desc


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    a = p.parse_args(argv)
    dest = a.out / NAME
    with tempfile.TemporaryDirectory() as work:
        tmp = Path(work) / "export"
        meta = export(tmp)
        shutil.rmtree(dest, ignore_errors=True)
        dest.mkdir(parents=True)
        for f in ("config.json", "model.safetensors"):
            shutil.copy2(tmp / f, dest / f)
        meta["files_written_by_tool"] = sorted(x.name for x in tmp.iterdir())
    ys, desc = reload_attention(dest)
    save_file(ys, str(dest / "reference_outputs.safetensors"))
    meta["reference_outputs"] = {"loader": "transformers.AutoModelForCausalLM.from_pretrained(folder, "
                                           "dtype=torch.bfloat16, attn_implementation='eager')",
                                 "layer": "model.layers.0.self_attn", **desc,
                                 "hidden": "bf16 [1, 6, 64], seed 99, log-normal magnitudes",
                                 "tensors": mif.describe(ys)}
    meta["versions"] = mif.versions()
    meta["model"] = {"class": "LlamaForCausalLM", "config": mif.LLAMA, "dtype": "bfloat16", "seed": 1234,
                     "weight_edit_seed": 4321}
    (dest / "fixture.json").write_text(json.dumps(meta, indent=1, sort_keys=True) + "\n")
    print(f"wrote {dest}: {sorted(x.name for x in dest.iterdir())}")
    dest_q = a.out / (NAME + "_q")
    with tempfile.TemporaryDirectory() as work:
        meta = export_with_query(Path(work) / "export")
        shutil.rmtree(dest_q, ignore_errors=True)
        dest_q.mkdir(parents=True)
        shutil.copy2(Path(work) / "export" / "config.json", dest_q / "config.json")
    meta["versions"] = mif.versions()
    (dest_q / "fixture.json").write_text(json.dumps(meta, indent=1, sort_keys=True) + "\n")
    print(f"wrote {dest_q}: {sorted(x.name for x in dest_q.iterdir())}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
