"""auto-round: its FP8 quantize function ``auto_round.data_type.fp8.quant_fp8_sym`` (RTN,
per output channel) followed by its FP8 packing ``export_to_fp8.pack_layer``, which
writes the checkpoint's ``weight`` bytes and ``weight_scale`` (REFERENCE 4.2).

Implemented: recipe ``auto-round``, scheme FP8_STATIC, weights, float8_e4m3fn.
"""

from __future__ import annotations

from ..backend import Backend
from ._common import dist_version, missing
from .compressed_tensors_backend import _numpy
from .torch_backend import TorchBackend


class AutoRoundBackend(Backend):
    name = "auto_round"
    capabilities = {"quantize": {"recipe": ("auto-round",), "scheme": ("FP8_STATIC",), "role": ("weight",),
                                 "dtype": ("bfloat16", "float16", "float32")}}

    def unavailable(self) -> str | None:
        return missing("auto_round", "auto-round")

    def version(self) -> str:
        return dist_version("auto-round")

    def quantize(self, x, *, scheme, recipe, role, amax=None):
        import torch
        from auto_round.data_type.fp8 import quant_fp8_sym
        from auto_round.export.export_to_autoround.export_to_fp8 import pack_layer


        w = TorchBackend._tensor(x)
        qdq, scale, _ = quant_fp8_sym(w)  # per row: s32 = max(amax/448, floor) in fp32
        layer = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, dtype=w.dtype)
        layer.weight.data = qdq.to(w.dtype)  # the in-memory weight auto-round keeps: D(q * s32)
        layer.scale, layer.zp, layer.group_size = scale, None, -1
        layer.bits, layer.act_bits, layer.data_type = 8, 16, "fp8"
        model = torch.nn.Module()
        model.add_module("layer", layer)
        model.dtype = w.dtype
        pack_layer("layer", model, "fp8", device="cpu")
        packed = model.layer
        codes = packed.weight.view(torch.uint8).numpy()
        return {"codes": codes, "scale": _numpy(packed.weight_scale).reshape(-1, 1)}
