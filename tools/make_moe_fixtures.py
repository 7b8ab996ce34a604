"""Write tiny MoE checkpoints quantized by the REAL tools (tests/fixtures/interop/checkpoints/).

Runs only inside the interop venv (see tools/README.md); it installs nothing. Every weight comes
from fixed seeds. For each architecture (Qwen3-MoE, Mixtral) the unquantized model is written as
``moe_<arch>_bf16`` (transformers' save_pretrained: the original for ``verify --original`` and
``compare --modes original``) and quantized by llm-compressor's oneshot with the FP8_DYNAMIC and
FP8_BLOCK schemes into ``llmc_<arch>_fp8_dynamic`` / ``llmc_<arch>_fp8_block``. The DeepSeek-V3
(MLA + MoE) original ``moe_deepseek_v3_bf16`` is written too; its hf-fp8 block checkpoint is made
by fp8ref itself in the tests (``fp8ref quantize --format hf-fp8``).

Shapes: hidden 128 (compressed-tensors' block forward refuses K = 64 layers), 4 experts of
intermediate 64, top-2, 2 layers, vocabulary 128: each folder well under 1 MB.

Usage: /work/venvs/interop/bin/python tools/make_moe_fixtures.py [--out DIR]
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

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_interop_fixtures import versions  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "tests" / "fixtures" / "interop" / "checkpoints"
COMMON = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
              max_position_embeddings=64, tie_word_embeddings=False)
CONFIGS = {
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(COMMON, head_dim=32, intermediate_size=128, moe_intermediate_size=64, num_experts=4,
                       num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(COMMON, head_dim=32, intermediate_size=64, num_local_experts=4, num_experts_per_tok=2)),
    # MLA: every head has its K and V (num_key_value_heads = heads); kv_a_proj_with_mqa is [160, 128]
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                    dict(COMMON, num_key_value_heads=4, intermediate_size=128, moe_intermediate_size=64,
                         n_routed_experts=4, n_shared_experts=2, num_experts_per_tok=2, n_group=2, topk_group=1,
                         first_k_dense_replace=1,
                         q_lora_rank=128, kv_lora_rank=128, qk_rope_head_dim=32, qk_nope_head_dim=32, v_head_dim=32,
                         routed_scaling_factor=2.5, norm_topk_prob=True, rope_interleave=True)),
}
SEED, EDIT_SEED = 1234, 4321


def tiny(arch: str):
    """The tiny model of ``arch`` with seeded random weights (heavier tails than the default init,
    e_score_correction_bias made non-zero so the routing correction is exercised, kept float32)."""
    import transformers

    cfg_name, cls_name, kwargs = CONFIGS[arch]
    torch.manual_seed(SEED)
    cfg = getattr(transformers, cfg_name)(**kwargs, dtype="bfloat16")
    model = getattr(transformers, cls_name)(cfg).to(torch.bfloat16).eval()
    g = torch.Generator().manual_seed(EDIT_SEED)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim >= 2 and "embed" not in name:
                std = 0.08 if p.ndim == 3 else 0.05
                p.copy_(torch.randn(p.shape, generator=g) * std * torch.exp(0.5 * torch.randn(p.shape, generator=g)))
        for module in model.modules():
            if hasattr(module, "e_score_correction_bias"):  # float32, as transformers keeps it (and DeepSeek ships it)
                module.e_score_correction_bias = (torch.randn(module.e_score_correction_bias.shape, generator=g)
                                                  * 0.1).float()
    return model


def save_original(arch: str, dest: Path, vers: dict) -> None:
    with tempfile.TemporaryDirectory() as work:
        tiny(arch).save_pretrained(work)
        dest.mkdir(parents=True)
        for f in ("config.json", "model.safetensors"):
            shutil.copy2(Path(work) / f, dest / f)
    meta = {"tool": "transformers", "function": f"tiny({arch!r}).save_pretrained(folder)", "versions": vers,
            "model": {"class": CONFIGS[arch][1], "config": CONFIGS[arch][2], "dtype": "bfloat16", "seed": SEED,
                      "weight_edit_seed": EDIT_SEED}}
    (dest / "fixture.json").write_text(json.dumps(meta, indent=1, sort_keys=True) + "\n")


def llmc_export(original: Path, scheme: str, dest: Path, vers: dict) -> None:
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(original), dtype=torch.bfloat16).eval()
    ignore = ["lm_head", "re:.*mlp.gate$"]
    recipe = QuantizationModifier(targets="Linear", scheme=scheme, ignore=ignore)
    with tempfile.TemporaryDirectory() as work:
        oneshot(model=model, recipe=recipe)
        model.save_pretrained(work, save_compressed=True)
        dest.mkdir(parents=True)
        written = sorted(p.name for p in Path(work).iterdir())
        for f in ("config.json", "model.safetensors"):
            shutil.copy2(Path(work) / f, dest / f)
    meta = {"tool": "llmcompressor", "function": "llmcompressor.oneshot + model.save_pretrained(save_compressed=True)",
            "arguments": {"recipe": f"QuantizationModifier(targets='Linear', scheme='{scheme}', ignore={ignore})",
                          "model": f"AutoModelForCausalLM.from_pretrained({original.name}, dtype=bfloat16)"},
            "files_written_by_tool": written, "versions": vers, "original": original.name}
    (dest / "fixture.json").write_text(json.dumps(meta, indent=1, sort_keys=True) + "\n")


def size(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.iterdir())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--only", nargs="*", choices=tuple(CONFIGS))
    a = p.parse_args(argv)
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    vers = versions()
    for arch in a.only or CONFIGS:
        orig = a.out / f"moe_{arch}_bf16"
        shutil.rmtree(orig, ignore_errors=True)
        save_original(arch, orig, vers)
        print(f"wrote {orig.name} ({size(orig)} bytes)")
        for scheme in ("FP8_BLOCK",) if arch == "deepseek_v3" else ("FP8_DYNAMIC", "FP8_BLOCK"):
            dest = a.out / f"llmc_{arch}_{scheme.lower().removeprefix('fp8_')}"
            dest = dest.with_name(dest.name.replace(f"llmc_{arch}_", f"llmc_{arch}_fp8_"))
            shutil.rmtree(dest, ignore_errors=True)
            llmc_export(orig, scheme, dest, vers)
            print(f"wrote {dest.name} ({size(dest)} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
