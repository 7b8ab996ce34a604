"""Write tests/fixtures/gptoss/: a tiny gpt-oss (transformers GptOssForCausalLM: hidden 64, 2 layers,
4 experts, top-2) with seeded random weights, saved by transformers (original_bf16/), and its experts
quantized to MXFP4 by fp8ref's export with recipe gpt-oss-mxfp4 (transformers' Mxfp4Quantize rule,
triton_kernels' ROUND_UP) in gpt-oss's layout (mxfp4/). transformers' own quantizer needs triton's
GPU kernels, so on CPU fp8ref writes the file; transformers reads it back (tests/unit/nn/test_nn_gptoss.py).

    python tools/make_gptoss_fixture.py [--out tests/fixtures/gptoss]

Deterministic: two runs write byte-identical files (torch 2.13.0 CPU, transformers 5.17.0).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = dict(vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
              max_position_embeddings=131072, layer_types=["sliding_attention", "full_attention"], dtype="bfloat16")
SPEC = {"scheme": {"bits": 4, "group_size": 32, "data_type": "mx_fp", "act_bits": 16, "recipe": "gpt-oss-mxfp4"}}


def build_original(out: Path) -> None:
    import torch
    from transformers import GptOssConfig, GptOssForCausalLM

    torch.manual_seed(0)
    model = GptOssForCausalLM(GptOssConfig(**CONFIG)).to(torch.bfloat16).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen))
            else:  # row magnitudes spread over a few binades, so the MX exponent rules matter
                spread = torch.exp2(torch.randn(p.shape[:-1] + (1,), generator=gen)) if p.dim() > 1 else 1
                p.copy_(0.3 * torch.randn(p.shape, generator=gen) * spread)
    model.save_pretrained(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "tests/fixtures/gptoss"))
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.path.insert(0, str(ROOT))
    import fp8ref

    out = Path(args.out)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    build_original(out / "original_bf16")
    fp8ref.export_checkpoint(out / "original_bf16", out / "mxfp4", SPEC, format="gpt-oss")
    for p in sorted(out.rglob("*")):
        if p.is_file():
            print(f"{p.relative_to(ROOT) if p.is_relative_to(ROOT) else p}  {p.stat().st_size} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
