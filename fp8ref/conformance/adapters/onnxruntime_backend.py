"""onnxruntime (CPU execution provider): ``Cast`` graphs at opset 25 (``_onnx``), one session
per format x rounding x saturation x input dtype, cached.

Codes are read back bit for bit: onnxruntime returns float8 outputs other than e4m3fn as
OrtValues numpy cannot hold, so the adapter copies the output buffer's bytes (``data_ptr``),
and feeds codes in with ``OrtValue.ortvalue_from_numpy_with_onnx_type`` (no second Cast, nothing
re-rounded). Covers the four float8 formats (RNE, saturate 0/1) and E8M0 (round_mode up / down /
nearest = fp8ref rup / rdown and rtz / rna). bfloat16 inputs go in as their bits. FLOAT4E2M1 Cast
has no CPU kernel in onnxruntime 1.32 ("Could not find an implementation for Cast(25)"), so FP4
is not declared.

``QuantizeLinear`` (opset 25; x in its dtype, y_scale float32, a float8 zero point of 0, ``saturate``
the scheme's) is judged against recipe ``onnx`` (specs/recipes/onnx.yaml: the float32 division the
spec prescribes, then + 0 and Cast). ONNX takes the scale as an input and computes none: the adapter
passes fp8ref's own (``quant.quantize`` with recipe onnx), returns it unchanged, and only the codes
are onnxruntime's. Per tensor, per row (axis 0), per group and per 2-D block (blocked along axis 1,
the block's scale repeated over its rows). ``DequantizeLinear`` (float32 scale, the same layouts) to
float32 is judged against recipes fp8ref and onnx (decode(q) * s rounded once to float32, for every
model dtype); onnxruntime 1.32's CPU provider has no FLOAT4E2M1 DequantizeLinear (MXFP4 not
declared) and none with a float32 scale and a bfloat16 ``output_dtype``.
"""

from __future__ import annotations

import ctypes

import numpy as np

from ... import quant
from ...quant import as_args
from ...scheme import PRESETS
from ..backend import Backend
from . import _onnx
from ._common import INPUT_DTYPES, dist_version, missing

_FORMATS = (*_onnx.FP8_FORMATS, "float8_e8m0fnu")
_NODE = {"quantize": "QuantizeLinear", "dequantize": "DequantizeLinear"}


class OnnxRuntimeBackend(Backend):
    name = "onnxruntime"
    default_suites = ("formats", "fp8-static-w8a8", "degenerate", "onnx")
    capabilities = {
        "encode": {"format": _FORMATS, "rounding": ("rne", *_onnx.E8M0_ROUND_MODES), "saturate": (True, False),
                   "dtype": INPUT_DTYPES},
        "decode": {"format": _FORMATS},
        "quantize": {"recipe": ("onnx",)},
        "dequantize": {"scheme": _onnx.DEQUANTIZE_SCHEMES, "recipe": ("fp8ref", "onnx")},
    }

    def __init__(self):
        self._sessions = {}

    def unavailable(self) -> str | None:
        return missing("onnxruntime") or missing("onnx")

    def version(self) -> str:
        return f"{dist_version('onnxruntime')}, {dist_version('onnx')}, opset {_onnx.OPSET}, CPUExecutionProvider"

    def implements(self, op, params):
        if op in ("encode", "decode") and params.get("format") == "float4_e2m1fn":
            return "onnxruntime 1.32 has no CPU kernel for Cast(25) with FLOAT4E2M1 ('Could not find an " \
                   "implementation for Cast(25)')"
        reason = super().implements(op, params)
        if reason or op == "decode":
            return reason
        if op in ("quantize", "dequantize"):
            qa = as_args(PRESETS[params["scheme"]], role=params["role"])
            if qa.format not in _FORMATS:
                return f"onnxruntime 1.32 has no CPU {_NODE[op]} for {qa.format}"
            if op == "quantize" and params["dtype"] == "bfloat16":
                return "onnxruntime 1.32 has no CPU QuantizeLinear(25) for a bfloat16 x with a float32 y_scale"
            return _onnx.layout_reason(op, qa, params)
        e8m0 = params["format"] == "float8_e8m0fnu"
        if e8m0 != (params["rounding"] != "rne"):
            return ("onnx Cast rounds float8 to nearest even only, and E8M0 by round_mode up / down / "
                    "nearest (ties up) only")
        return None

    def _session(self, key, build):
        if key not in self._sessions:
            import onnxruntime

            options = onnxruntime.SessionOptions()
            options.intra_op_num_threads = 1
            self._sessions[key] = onnxruntime.InferenceSession(build().SerializeToString(), options,
                                                               providers=["CPUExecutionProvider"])
        return self._sessions[key]

    @staticmethod
    def _bytes(out) -> np.ndarray:
        """An output OrtValue's bytes (a copy: the OrtValue owns the buffer)."""
        n = out.tensor_size_in_bytes()
        return np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(out.data_ptr())).copy() if n else \
            np.zeros(0, np.uint8)

    @staticmethod
    def _value(x: np.ndarray, type_name: str):
        from onnxruntime import OrtValue

        return OrtValue.ortvalue_from_numpy_with_onnx_type(np.ascontiguousarray(x), _onnx.element_type(type_name))

    def encode(self, x, fmt, *, rounding, saturate, random_bits=None):
        x = np.asarray(x)
        dtype = x.dtype.name
        session = self._session(("encode", dtype, fmt, rounding, saturate),
                                lambda: _onnx.encode_model(dtype, fmt, rounding, saturate))
        feed = self._value(x.view(np.uint16) if dtype == "bfloat16" else x, _onnx.INPUT_TYPES[dtype])
        out = session.run_with_ort_values(["y"], {"x": feed})[0]
        n = int(np.prod(out.shape()))
        if out.tensor_size_in_bytes() != n:
            raise ValueError(f"onnxruntime returned {out.tensor_size_in_bytes()} bytes for {n} {fmt} codes")
        return self._bytes(out).reshape(x.shape)

    def decode(self, codes, fmt):
        session = self._session(("decode", fmt), lambda: _onnx.decode_model(fmt))
        return session.run_with_ort_values(["y"], {"x": self._value(np.asarray(codes, np.uint8),
                                                                        _onnx.ELEMENT_TYPES[fmt])})[0].numpy()

    def quantize(self, x, *, scheme, recipe, role, amax=None):
        qa = as_args(PRESETS[scheme], role=role)
        x = np.asarray(x)
        q = quant.quantize(x, qa, recipe=recipe, amax=amax)  # the scale: an input to ONNX, fp8ref's own
        scale, attrs = _onnx.scale_input(q.scale, x.shape, qa)
        dtype = x.dtype.name
        session = self._session(("quantize", dtype, qa, x.shape), lambda: _onnx.quantize_model(
            dtype, qa.format, x.shape, scale.shape, attrs, qa.saturate))
        feeds = {"x": self._value(x.view(np.uint16) if dtype == "bfloat16" else x, _onnx.INPUT_TYPES[dtype]),
                 "scale": self._value(scale, "FLOAT")}
        out = session.run_with_ort_values(["y"], feeds)[0]
        return {"codes": self._bytes(out).reshape(x.shape), "scale": q.scale}

    def dequantize(self, codes, scale, *, scheme, recipe, role, dtype):
        qa = as_args(PRESETS[scheme], role=role)
        codes = np.asarray(codes, np.uint8)
        fed, attrs = _onnx.scale_input(scale, codes.shape, qa)
        session = self._session(("dequantize", qa, codes.shape), lambda: _onnx.dequantize_model(
            qa.format, codes.shape, fed.shape, attrs))
        feeds = {"x": self._value(codes, _onnx.ELEMENT_TYPES[qa.format]), "scale": self._value(fed, "FLOAT")}
        return session.run_with_ort_values(["y"], feeds)[0].numpy()
