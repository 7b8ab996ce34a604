"""ONNX's reference evaluator (``onnx.reference.ReferenceEvaluator``, pure numpy): the same opset-25
``Cast`` graphs as the onnxruntime adapter (``_onnx``). It takes and returns ml_dtypes arrays, so
codes are its output's bytes. Covers the four float8 formats (RNE, saturate 0/1), E8M0 (round_mode
up / down / nearest = fp8ref rup / rdown and rtz / rna) and FLOAT4E2M1 (RNE; Cast has no saturate
for it); ``QuantizeLinear`` (opset 25, float32 y_scale, a zero point of 0) against recipe ``onnx``,
with fp8ref's scale as its input, as the onnxruntime adapter (whose docstring says more); and
``DequantizeLinear`` (float32 scale per tensor / per row (axis 0) / blocked, to float32) against
recipes fp8ref and onnx (float32 for every model dtype).
"""

from __future__ import annotations

import numpy as np

from ... import quant
from ...quant import as_args
from ...scheme import PRESETS
from ..backend import Backend
from . import _onnx
from ._common import INPUT_DTYPES, dist_version, missing

_FORMATS = (*_onnx.FP8_FORMATS, "float8_e8m0fnu", "float4_e2m1fn")


class OnnxReferenceBackend(Backend):
    name = "onnx_reference"
    default_suites = ("formats", "fp8-static-w8a8", "degenerate", "mxfp4", "onnx")
    capabilities = {
        "encode": {"format": _FORMATS, "rounding": ("rne", *_onnx.E8M0_ROUND_MODES), "saturate": (True, False),
                   "dtype": INPUT_DTYPES},
        "decode": {"format": _FORMATS},
        "quantize": {"recipe": ("onnx",)},
        "dequantize": {"scheme": _onnx.DEQUANTIZE_SCHEMES, "recipe": ("fp8ref", "onnx")},
    }

    def __init__(self):
        self._evaluators = {}

    def unavailable(self) -> str | None:
        return missing("onnx") or missing("ml_dtypes")

    def version(self) -> str:
        return f"{dist_version('onnx')} ReferenceEvaluator, opset {_onnx.OPSET}"

    def implements(self, op, params):
        reason = super().implements(op, params)
        if reason or op == "decode":
            return reason
        if op in ("quantize", "dequantize"):
            qa = as_args(PRESETS[params["scheme"]], role=params["role"])
            if qa.format not in _FORMATS:
                return f"onnx has no {qa.format} QuantizeLinear / DequantizeLinear output"
            return _onnx.layout_reason(op, qa, params)
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

    def quantize(self, x, *, scheme, recipe, role, amax=None):
        qa = as_args(PRESETS[scheme], role=role)
        x = np.asarray(x)
        q = quant.quantize(x, qa, recipe=recipe, amax=amax)  # the scale: an input to ONNX, fp8ref's own
        scale, attrs = _onnx.scale_input(q.scale, x.shape, qa)
        ev = self._evaluator(("quantize", x.dtype.name, qa, x.shape), lambda: _onnx.quantize_model(
            x.dtype.name, qa.format, x.shape, scale.shape, attrs, qa.saturate))
        y = np.asarray(ev.run(None, {"x": x, "scale": scale})[0])
        if y.dtype.itemsize != 1:
            raise ValueError(f"ReferenceEvaluator returned {y.dtype} for a {qa.format} QuantizeLinear")
        return {"codes": y.view(np.uint8).reshape(x.shape), "scale": q.scale}

    def dequantize(self, codes, scale, *, scheme, recipe, role, dtype):
        import ml_dtypes

        qa = as_args(PRESETS[scheme], role=role)
        codes = np.asarray(codes, np.uint8)
        fed, attrs = _onnx.scale_input(scale, codes.shape, qa)
        ev = self._evaluator(("dequantize", qa, codes.shape), lambda: _onnx.dequantize_model(
            qa.format, codes.shape, fed.shape, attrs))
        return np.asarray(ev.run(None, {"x": codes.view(getattr(ml_dtypes, qa.format)), "scale": fed})[0])
