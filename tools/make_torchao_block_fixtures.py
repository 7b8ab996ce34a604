"""Write torchao 0.18.0 MXTensor and NVFP4Tensor checkpoints on CPU: tests/fixtures/torchao/{mx_*,nvfp4_*}/.

Run with a venv holding torchao 0.18.0 (see tools/make_torchao_fixtures.py):
V/bin/python tools/make_torchao_block_fixtures.py

MX: each weight goes through ``_mx_inference_linear_transform``, the handler that
``quantize_(model, MXDynamicActivationMXWeightConfig(...))`` (transformers' TorchAoConfig) calls; it
runs on CPU as is (MXTensor.to_mx's torch path, swizzled E8M0 scales). NVFP4: the handler of
``NVFP4DynamicActivationNVFP4WeightConfig`` asserts an sm100 GPU before quantizing, so its body is
repeated here line for line (per_tensor_amax_to_scale, NVFP4Tensor.to_nvfp4 with swizzled scales).
Saved by torchao's own ``flatten_tensor_state_dict`` with the config ``TorchAoConfig.to_dict()`` writes.
original_blocks/ holds the bf16 weights: one [160, 128] weight (two 128-row scale tiles, a large
row, an all-zero block, a block of bf16 subnormals) and one [32, 64] (zero-padded tiles).
dequantized.json: sha256 of torchao's own MXTensor/NVFP4Tensor.dequantize(bfloat16) of each weight.
"""

import hashlib
import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from torchao.prototype.mx_formats.inference_workflow import (
    MXDynamicActivationMXWeightConfig,
    NVFP4DynamicActivationNVFP4WeightConfig,
    _mx_inference_linear_transform,
)
from torchao.prototype.mx_formats.mx_tensor import ScaleCalculationMode
from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor, QuantizeTensorToNVFP4Kwargs, per_tensor_amax_to_scale
from torchao.prototype.safetensors.safetensors_support import flatten_tensor_state_dict
from transformers import TorchAoConfig

OUT = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "torchao"
MODES = ("FLOOR", "CEIL", "RCEIL", "EVEN")
ELEMS = {"mxfp8": torch.float8_e4m3fn, "mxfp4": torch.float4_e2m1fn_x2, "mxfp8e5m2": torch.float8_e5m2,
         "mxfp6e2m3": "fp6_e2m3", "mxfp6e3m2": "fp6_e3m2"}


def original() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    up = (torch.randn(160, 128, generator=g) * 0.05).to(torch.bfloat16)
    up[3, :] *= 40  # a large row
    up[5, 0:32] = 0  # an all-zero MX block (and two NVFP4 blocks)
    up[7, 32:64] = (torch.randn(32, generator=g) * 2.0 ** -128).to(torch.bfloat16)  # bf16 subnormals
    down = (torch.randn(32, 64, generator=g) * 0.02).to(torch.bfloat16)
    return {"model.layers.0.mlp.up_proj.weight": up, "model.layers.0.mlp.down_proj.weight": down,
            "model.norm.weight": torch.ones(64, dtype=torch.bfloat16)}


def linear(w: torch.Tensor) -> torch.nn.Linear:
    lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, dtype=w.dtype)
    lin.weight = torch.nn.Parameter(w.clone(), requires_grad=False)
    return lin


def nvfp4_transform(module: torch.nn.Linear, config: NVFP4DynamicActivationNVFP4WeightConfig) -> None:
    """_nvfp4_inference_linear_transform's step-None branch, without its sm100 assert."""
    weight = module.weight
    per_tensor_scale = None
    if config.use_dynamic_per_tensor_scale:
        per_tensor_scale = per_tensor_amax_to_scale(torch.max(torch.abs(weight)))
    act_quant_kwargs = QuantizeTensorToNVFP4Kwargs(
        use_dynamic_per_tensor_scale=config.use_dynamic_per_tensor_scale,
        use_triton_kernel=config.use_triton_kernel, is_swizzled_scales=True)
    q = NVFP4Tensor.to_nvfp4(weight, per_tensor_scale=per_tensor_scale, is_swizzled_scales=True,
                             use_triton_kernel=False, act_quant_kwargs=act_quant_kwargs)
    q.use_triton_kernel = config.use_triton_kernel
    module.weight = torch.nn.Parameter(q, requires_grad=False)


def write(folder: Path, weights: dict, config, transform) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, w in weights.items():
        if w.ndim == 2:
            lin = linear(w)
            transform(lin, config)
            tensors[name] = lin.weight
        else:
            tensors[name] = w
    data, metadata = flatten_tensor_state_dict(tensors)
    save_file(data, folder / "model.safetensors", metadata=metadata)
    qc = TorchAoConfig(config).to_dict()
    cfg = {"architectures": ["LlamaForCausalLM"], "torch_dtype": "bfloat16", "quantization_config": qc}
    (folder / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    evidence(folder, tensors)


def evidence(folder: Path, tensors: dict) -> None:
    """torchao's own ``dequantize()`` of each weight as sha256 of its bf16 bytes (dequantized.json), and
    where torchao's own CPU forward stops (it does for every MX and NVFP4 config: FORWARD in docs)."""
    g = torch.Generator().manual_seed(3)
    digests = {}
    for name, w in tensors.items():
        if hasattr(w, "qdata"):
            d = w.dequantize(torch.bfloat16).contiguous()
            digests[name] = hashlib.sha256(d.view(torch.uint16).numpy().tobytes()).hexdigest()
            x = torch.randn(4, w.shape[1], generator=g).to(torch.bfloat16)
            try:
                torch.nn.functional.linear(x, w)
                print(f"{folder.name}: {name}: torchao's CPU forward runs")
            except Exception as exc:
                print(f"{folder.name}: {name}: torchao's CPU forward stops: {type(exc).__name__}: "
                      f"{str(exc).splitlines()[0][:100] if str(exc) else ''}")
    (folder / "dequantized.json").write_text(json.dumps(digests, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    w = original()
    (OUT / "original_blocks").mkdir(parents=True, exist_ok=True)
    save_file(w, OUT / "original_blocks" / "model.safetensors")
    (OUT / "original_blocks" / "config.json").write_text(json.dumps({"torch_dtype": "bfloat16"}) + "\n")
    for elem in ("mxfp8", "mxfp4"):
        for mode in MODES:
            cfg = MXDynamicActivationMXWeightConfig(activation_dtype=ELEMS[elem], weight_dtype=ELEMS[elem],
                                                    scaling_mode=ScaleCalculationMode[mode])
            write(OUT / f"{elem}_{mode.lower()}", w, cfg, _mx_inference_linear_transform)
    for elem in ("mxfp8e5m2", "mxfp6e2m3", "mxfp6e3m2"):
        cfg = MXDynamicActivationMXWeightConfig(activation_dtype=ELEMS[elem], weight_dtype=ELEMS[elem],
                                                scaling_mode=ScaleCalculationMode.RCEIL)
        write(OUT / f"{elem}_rceil", w, cfg, _mx_inference_linear_transform)
    write(OUT / "nvfp4", w, NVFP4DynamicActivationNVFP4WeightConfig(), nvfp4_transform)
    write(OUT / "nvfp4_no_tensor_scale", w, NVFP4DynamicActivationNVFP4WeightConfig(use_dynamic_per_tensor_scale=False),
          nvfp4_transform)
    for p in sorted(OUT.rglob("*.safetensors")):
        print(p.relative_to(OUT), p.stat().st_size)
