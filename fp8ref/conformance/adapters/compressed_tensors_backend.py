"""compressed-tensors: its quantize/dequantize forward functions
(``compressed_tensors.quantization.lifecycle.forward``) with scales from its
``calculate_qparams``, on CPU (the eager path; REFERENCE 4.1).

Implemented: recipe ``compressed-tensors``, float8_e4m3fn, weights per tensor or per
channel and static per-tensor activations (the scale from the calibrated amax, as its
static min-max observer does). Codes are the fp8 cast of the values its ``quantize``
returns (they already lie on the fp8 grid).
"""

from __future__ import annotations

import numpy as np

from ...quant import as_args
from ...scheme import PRESETS
from ..backend import Backend
from ._common import dist_version, missing
from .torch_backend import TorchBackend

_SCHEMES = ("FP8", "FP8_STATIC", "FP8_DYNAMIC")
_DTYPES = ("bfloat16", "float16", "float32")


class CompressedTensorsBackend(Backend):
    name = "compressed_tensors"
    capabilities = {
        "quantize": {"recipe": ("compressed-tensors",), "scheme": _SCHEMES, "dtype": _DTYPES},
        "dequantize": {"recipe": ("compressed-tensors",), "scheme": _SCHEMES, "dtype": _DTYPES},
    }

    def unavailable(self) -> str | None:
        return missing("compressed_tensors", "compressed-tensors")

    def version(self) -> str:
        return dist_version("compressed-tensors")

    def implements(self, op, params):
        reason = super().implements(op, params)
        if reason:
            return reason
        qa = as_args(PRESETS[params["scheme"]], role=params["role"])
        if qa.granularity not in ("tensor", "channel") or (params["role"] == "activation" and qa.dynamic):
            return f"{self.name} adapter covers weights per tensor/channel and static activations only"
        return None

    @staticmethod
    def _args(scheme: str, role: str):
        from compressed_tensors.quantization import QuantizationArgs

        qa = as_args(PRESETS[scheme], role=role)
        return QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy=qa.granularity,
                                dynamic=False), qa

    def quantize(self, x, *, scheme, recipe, role, amax=None):
        import torch
        from compressed_tensors.quantization.lifecycle.forward import quantize
        from compressed_tensors.quantization.utils import calculate_qparams


        args, qa = self._args(scheme, role)
        t = TorchBackend._tensor(x)
        if role == "weight":  # its min-max observer: per-channel min/max over the last dim
            dims = dict(dim=-1, keepdim=True) if qa.granularity == "channel" else {}
            lo = t.amin(**dims).reshape(-1, 1) if dims else t.min().reshape(1)
            hi = t.amax(**dims).reshape(-1, 1) if dims else t.max().reshape(1)
        else:  # static activations: the calibrated amax, held in the model dtype
            hi = torch.from_numpy(np.asarray(amax, dtype=np.float64)).to(t.dtype).reshape(1)
            lo = -hi
        scale, zero_point = calculate_qparams(lo, hi, args)
        q = quantize(t, scale, zero_point, args)
        codes = q.to(torch.float8_e4m3fn).view(torch.uint8).numpy()
        return {"codes": codes, "scale": _numpy(scale)}

    def dequantize(self, codes, scale, *, scheme, recipe, role, dtype):
        import torch
        from compressed_tensors.quantization.lifecycle.forward import dequantize


        args, _ = self._args(scheme, role)
        q = torch.from_numpy(np.ascontiguousarray(codes)).view(torch.float8_e4m3fn)
        s = TorchBackend._tensor(np.ascontiguousarray(scale))
        return _numpy(dequantize(q, s, None, args, dtype=getattr(torch, dtype)))


def _numpy(t) -> np.ndarray:
    import torch

    t = t.detach().contiguous()
    if t.dtype == torch.bfloat16:
        import ml_dtypes

        return t.view(torch.uint16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()
