"""Write torchao 0.18.0 Float8 checkpoints on CPU: tests/fixtures/torchao/float8_{row,tensor}/.

Run with a venv holding torchao 0.18.0 (python -m venv --system-site-packages V; V/bin/pip install -c
constraints.txt torchao==0.18.0): V/bin/python tools/make_torchao_fixtures.py

transformers' TorchAoConfig(Float8DynamicActivationFloat8WeightConfig) asserts an sm89+ GPU before it
quantizes, so the weights are made here by what that config calls on CPU, ``Float8Tensor.from_hp``
(torch's quantize path: scale = bf16(amax / 448) stored fp32, codes e4m3(fp32(W) / scale)), with
the activation kwargs the config sets, and saved by torchao's own ``flatten_tensor_state_dict``
with the config transformers writes (``TorchAoConfig.to_dict()``). original/ holds the bf16 weights.
Row 0 of layer 0 is all zero: torchao stores scale 0 and NaN codes there (pytorch/ao #4713), so
that layer is kept in the separate folder float8_row_zero/.
"""

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from torchao.prototype.safetensors.safetensors_support import flatten_tensor_state_dict
from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, PerTensor
from torchao.quantization.quantize_.common import KernelPreference
from torchao.quantization.quantize_.workflows.float8.float8_tensor import Float8Tensor, QuantizeTensorToFloat8Kwargs
from transformers import TorchAoConfig

OUT = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "torchao"


def original() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    w = {f"model.layers.{i}.mlp.{p}.weight": (torch.randn(32, 64, generator=g) * 0.05).to(torch.bfloat16)
         for i in range(2) for p in ("up_proj", "down_proj")}
    w["model.layers.0.mlp.up_proj.weight"][3, :] *= 40  # a large row
    w["model.norm.weight"] = torch.ones(64, dtype=torch.bfloat16)
    return w


def write(folder: Path, weights: dict, granularity) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    act = QuantizeTensorToFloat8Kwargs(torch.float8_e4m3fn, granularity, kernel_preference=KernelPreference.AUTO)
    tensors = {}
    for name, w in weights.items():
        if w.ndim == 2:
            tensors[name] = Float8Tensor.from_hp(w, float8_dtype=torch.float8_e4m3fn, granularity=granularity,
                                                 act_quant_kwargs=act)
        else:
            tensors[name] = w
    data, metadata = flatten_tensor_state_dict(tensors)
    save_file(data, folder / "model.safetensors", metadata=metadata)
    qc = TorchAoConfig(Float8DynamicActivationFloat8WeightConfig(granularity=granularity)).to_dict()
    config = {"architectures": ["LlamaForCausalLM"], "torch_dtype": "bfloat16", "quantization_config": qc}
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")


if __name__ == "__main__":
    w = original()
    (OUT / "original").mkdir(parents=True, exist_ok=True)
    save_file(w, OUT / "original" / "model.safetensors")
    (OUT / "original" / "config.json").write_text(json.dumps({"torch_dtype": "bfloat16"}) + "\n")
    write(OUT / "float8_row", w, PerRow())
    write(OUT / "float8_tensor", w, PerTensor())
    zero = {"model.layers.0.mlp.up_proj.weight": w["model.layers.0.mlp.up_proj.weight"].clone()}
    zero["model.layers.0.mlp.up_proj.weight"][0, :] = 0
    write(OUT / "float8_row_zero", zero, PerRow())
    for p in sorted(OUT.rglob("*.safetensors")):
        print(p.relative_to(OUT), p.stat().st_size)
