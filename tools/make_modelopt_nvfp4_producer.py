"""What NVIDIA ModelOpt 0.47.0 computes on CPU for the committed modelopt_nvfp4 export: its own
``NVFP4QTensor`` (modelopt/torch/quantization/qtensor/nvfp4_tensor.py) dequantizing the stored weights
and quantizing + dequantizing layer inputs under the stored ``input_scale``, then the bf16 linear.

ModelOpt's in-memory NVFP4 fake quantization refuses CPU tensors (a CUDA kernel), but these QTensor
functions run on CPU; they are what fp8ref's ``mode="producer"`` for ModelOpt NVFP4 reproduces. Writes
tests/fixtures/interop/modelopt_nvfp4_producer.safetensors: per probe layer L (q_proj, k_proj, down_proj)
``L.w`` (the dequantized weight, bf16), and per input kind K (``probe``: the llmc fixtures' probe input;
``hard``: zeros, -0.0, tiny negatives, a zero block, outliers) ``L.K.x``, ``L.K.x_qdq``, ``L.K.y``.

Usage: /work/venvs/ct020/bin/python tools/make_modelopt_nvfp4_producer.py  (nvidia-modelopt 0.47.0,
transformers < 5.15: tools/requirements-modelopt.txt)
"""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

ROOT = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "interop"
FIXTURE = ROOT / "checkpoints" / "modelopt_nvfp4"
OUT = ROOT / "modelopt_nvfp4_producer.safetensors"
PROBES = ("model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj", "model.layers.0.mlp.down_proj")


def hard_input(k: int) -> torch.Tensor:
    """Two tokens: signed zeros, tiny negatives that round to zero, one all-zero block of 16, outliers."""
    g = torch.Generator().manual_seed(2026)
    x = torch.randn(2, k, generator=g) * torch.exp(2 * torch.randn(2, k, generator=g))
    x[0, :16] = 0.0  # a zero block
    x[0, 16:20] = -0.0
    x[1, :8] = -1e-6  # tiny negatives in a block with a large amax: E2M1 code 0x8
    x[1, 8] = 500.0
    x[1, 32:48] = torch.linspace(-3, 3, 16) * 1e-30  # a block of values far below the input scale
    return x.to(torch.bfloat16)


def main() -> int:
    from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor

    stored = load_file(str(FIXTURE / "model.safetensors"))
    probes = load_file(str(ROOT / "checkpoints" / "llmc_nvfp4" / "reference_outputs.safetensors"))
    out = {}
    for layer in PROBES:
        packed, ws, ws2 = stored[f"{layer}.weight"], stored[f"{layer}.weight_scale"], stored[f"{layer}.weight_scale_2"]
        m_in = stored[f"{layer}.input_scale"]
        shape = (packed.shape[0], 2 * packed.shape[1])
        w = NVFP4QTensor(torch.Size(shape), torch.bfloat16, packed).dequantize(
            dtype=torch.bfloat16, scale=ws, double_scale=ws2, block_sizes={-1: 16})
        out[f"{layer}.w"] = w
        for kind, x in (("probe", probes[f"{layer}.x"]), ("hard", hard_input(shape[1]))):
            qx, sx, _ = NVFP4QTensor.quantize(x, 16, weights_scaling_factor_2=m_in)
            x_qdq = qx.dequantize(dtype=torch.bfloat16, scale=sx, double_scale=m_in, block_sizes={-1: 16})
            with torch.no_grad():
                y = torch.nn.functional.linear(x_qdq, w)
            out.update({f"{layer}.{kind}.x": x, f"{layer}.{kind}.x_qdq": x_qdq, f"{layer}.{kind}.y": y})
    meta = {"tool": "nvidia-modelopt", "version": md.version("nvidia-modelopt"), "torch": torch.__version__,
            "function": "NVFP4QTensor(shape, bf16, weight).dequantize(bf16, scale=weight_scale, double_scale="
                        "weight_scale_2, block_sizes={-1: 16}); NVFP4QTensor.quantize(x, 16, "
                        "weights_scaling_factor_2=input_scale) then .dequantize(bf16, scale=..., double_scale="
                        "input_scale); torch.nn.functional.linear(x_qdq, w)",
            "writer": "tools/make_modelopt_nvfp4_producer.py"}
    save_file({k: v.contiguous() for k, v in sorted(out.items())}, str(OUT), metadata={"fixture": json.dumps(meta)})
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
