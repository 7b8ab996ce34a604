"""Write tests/fixtures/interop/checkpoints/hf_fp8_ue8m0: a DeepSeek-V3-style ``quant_method: fp8``
checkpoint with ``scale_fmt: ue8m0`` made by transformers' own Fp8Quantize (the conversion op its
FineGrainedFP8 integration runs), in the interop venv (transformers 5.17.0, CPU).

Two linears, blocks 128x128: ``q_proj`` [128, 256] (an all-zero block, a 16x outlier, tiny
values, a -0.0) and ``o_proj`` [256, 128]. ``weight_scale_inv`` is
float8_e8m0fnu (safetensors F8_E8M0). reference_outputs.safetensors holds the original bf16
weights (``original.<name>``) and transformers' Fp8Dequantize of the written tensors
of q_proj (``<name>.dequantized``, bf16).

Usage: /work/venvs/interop/bin/python tools/make_fixture_ue8m0.py [--out DIR]
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import FineGrainedFP8Config
from transformers.integrations.finegrained_fp8 import Fp8Dequantize, Fp8Quantize

ROOT = Path(__file__).resolve().parents[1]
NAMES = {"model.layers.0.self_attn.q_proj": (128, 256), "model.layers.0.self_attn.o_proj": (256, 128)}


class _Quantizer:  # what Fp8Quantize / Fp8Dequantize read from the HF quantizer: its config
    def __init__(self, config):
        self.quantization_config = config


def original_weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(2026)
    out = {}
    for name, shape in NAMES.items():
        w = torch.randn(shape, generator=g) * 0.02
        if name.endswith("q_proj"):
            w[:, 128:] = 0.0  # one all-zero block: scale 1.0
            w[3, 5] = 16 * w.abs().max()
            w[30:40, :8] *= 1e-6
            w[100, 100] = -0.0
        out[name] = w.to(torch.bfloat16)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=ROOT / "tests/fixtures/interop/checkpoints/hf_fp8_ue8m0")
    a = p.parse_args()
    cfg = FineGrainedFP8Config(weight_block_size=[128, 128], scale_fmt="ue8m0", activation_scheme="dynamic")
    q = _Quantizer(cfg)
    quant, deq = Fp8Quantize(q), Fp8Dequantize(q)
    tensors, refs = {}, {}
    for name, w in original_weights().items():
        out = quant._quantize_one(f"{name}.weight", w)
        tensors.update(out)
        refs[f"original.{name}"] = w
        if not name.endswith("q_proj"):
            continue
        d = deq.convert({"weight$": [out[f"{name}.weight"]], "weight_scale_inv": [out[f"{name}.weight_scale_inv"]]},
                        full_layer_name=f"{name}.weight")
        refs[f"{name}.dequantized"] = next(iter(d.values())).to(torch.bfloat16)
    a.out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(a.out / "model.safetensors"), {"format": "pt"})
    save_file(refs, str(a.out / "reference_outputs.safetensors"))
    for f in ("model.safetensors", "reference_outputs.safetensors"):
        (a.out / f).chmod(0o644)
    qc = {"activation_scheme": "dynamic", "fmt": "e4m3", "modules_to_not_convert": [], "quant_method": "fp8",
          "scale_fmt": "ue8m0", "weight_block_size": [128, 128]}
    (a.out / "config.json").write_text(json.dumps({"dtype": "bfloat16", "quantization_config": qc}, indent=1) + "\n")
    (a.out / "fixture.json").write_text(json.dumps({
        "function": "transformers.integrations.finegrained_fp8.Fp8Quantize._quantize_one (FineGrainedFP8Config "
                    "weight_block_size [128, 128], scale_fmt ue8m0); Fp8Dequantize.convert for the dequantized refs",
        "versions": {k: md.version(k) for k in ("torch", "transformers", "safetensors")},
        "tensors": {k: [str(v.dtype), list(v.shape)] for k, v in tensors.items()}}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
