"""ONNX's reference evaluator (``onnx.reference.ReferenceEvaluator``, pure numpy): the same opset-25
``Cast`` graphs as the onnxruntime adapter (``_onnx``). It takes and returns ml_dtypes arrays, so
codes are its output's bytes. Covers the four float8 formats (RNE, saturate 0/1), E8M0 (round_mode
up / down / nearest = fp8ref rup / rdown and rtz / rna) and FLOAT4E2M1 (RNE; Cast has no saturate
for it); and ``DequantizeLinear`` (opset 25, float32 scale per tensor / per row (axis 0) / per block
of 32 (block_size), to float32) against recipe fp8ref's dequantize (float32 for every model dtype).
"""

from __future__ import annotations

import numpy as np

from ...quant import as_args
from ...scheme import PRESETS
from ..backend import Backend
from . import _onnx
from ._common import INPUT_DTYPES, dist_version, missing

_FORMATS = (*_onnx.FP8_FORMATS, "float8_e8m0fnu", "float4_e2m1fn")


class OnnxReferenceBackend(Backend):
    name = "onnx_reference"
    capabilities = {
        "encode": {"format": _FORMATS, "rounding": ("rne", *_onnx.E8M0_ROUND_MODES), "saturate": (True, False),
                   "dtype": INPUT_DTYPES},
        "decode": {"format": _FORMATS},
        "dequantize": {"scheme": _onnx.DEQUANTIZE_SCHEMES, "recipe": ("fp8ref",)},
    }

    def __init__(self):
        self._evaluators = {}

    def unavailable(self) -> str | None:
        return missing("onnx") or missing("ml_dtypes")

    def version(self) -> str:
        return f"{dist_version('onnx')} ReferenceEvaluator, opset {_onnx.OPSET}"

    def implements(self, op, params):
        reason = super().implements(op, params)
        if reason or op != "encode":
            return reason  # dequantize: every DEQUANTIZE_SCHEMES format is one of _FORMATS
        e8m0 = params["format"] == "float8_e8m0fnu"
        if e8m0 != (params["rounding"] != "rne"):
            return ("onnx Cast rounds float8 and FP4 to nearest even only, and E8M0 by round_mode up / down / "
                    "nearest (ties up) only")
        return None

    def _evaluator(self, key, build):
        if key not in self._evaluators:
            from onnx.reference import ReferenceEvaluator

            self._evaluators[key] = ReferenceEvaluator(build())
        return self._evaluators[key]

    def encode(self, x, fmt, *, rounding, saturate, random_bits=None):
        x = np.asarray(x)
        dtype = x.dtype.name
        ev = self._evaluator(("encode", dtype, fmt, rounding, saturate),
                             lambda: _onnx.encode_model(dtype, fmt, rounding, saturate))
        y = np.asarray(ev.run(None, {"x": x})[0])
        if y.dtype.itemsize != 1:
            raise ValueError(f"ReferenceEvaluator returned {y.dtype} for a {fmt} Cast (expected 1-byte codes)")
        return y.view(np.uint8)

    def decode(self, codes, fmt):
        import ml_dtypes

        ev = self._evaluator(("decode", fmt), lambda: _onnx.decode_model(fmt))
        return np.asarray(ev.run(None, {"x": np.asarray(codes, np.uint8).view(getattr(ml_dtypes, fmt))})[0])

    def dequantize(self, codes, scale, *, scheme, recipe, role, dtype):
        import ml_dtypes

        fmt = as_args(PRESETS[scheme], role=role).format
        scale = np.asarray(scale)
        model, fed = _onnx.dequantize_model(fmt, codes.shape, scale.shape)
        ev = self._evaluator(("dequantize", fmt, codes.shape, scale.shape), lambda: model)
        feeds = {"x": np.asarray(codes, np.uint8).view(getattr(ml_dtypes, fmt)),
                 "scale": scale.astype(np.float32).reshape(fed)}
        return np.asarray(ev.run(None, feeds)[0])
