"""OpenVINO (CPU plugin): a one-node ``Convert`` model (``openvino.opset13``) to and from
``f8e4m3``, ``f8e5m2``, ``f8e8m0`` and ``f4e2m1``, compiled once per format and input dtype; and
``FakeConvert`` (opset13, experimental upstream) with its scale and shift as inputs of the model
(fake_quant, form fakeconvert: float32, float16 and bfloat16 data, e4m3fn and e5m2).

OpenVINO's Convert has no saturate flag, one behaviour per type: to f8e4m3 an overflow (and +-Inf)
gives NaN, to f8e5m2 +-Inf, as OCP's non-saturating mode (declared ``saturate=False``); to f8e8m0 it
clamps to the format's range (declared ``saturate=True``); f4e2m1 has neither Inf nor NaN (both).
Its E8M0 rounding is to nearest, ties to the even code (fp8ref ``rne``). The CPU plugin has no f64
-> f8e8m0 or f4e2m1 conversion. Codes come back as the
output tensor's bytes (uint8); f4e2m1 tensors are packed two elements per byte, the first in the
low nibble, and are unpacked (and packed for decode) here. bfloat16 inputs are fed as their bits.
"""

from __future__ import annotations

import numpy as np

from ... import codec
from ..backend import Backend
from ._common import INPUT_DTYPES, dist_version, missing

_TYPES = {"float8_e4m3fn": "f8e4m3", "float8_e5m2": "f8e5m2", "float8_e8m0fnu": "f8e8m0", "float4_e2m1fn": "f4e2m1"}
_INPUT_TYPES = {"float32": "f32", "float64": "f64", "float16": "f16", "bfloat16": "bf16"}


class OpenVinoBackend(Backend):
    name = "openvino"
    default_suites = ("formats", "fp8-static-w8a8", "fake-quant")
    capabilities = {
        "encode": {"format": tuple(_TYPES), "rounding": ("rne",), "saturate": (True, False), "dtype": INPUT_DTYPES},
        "decode": {"format": tuple(_TYPES)},
        "fake_quant": {"form": ("fakeconvert",), "format": ("float8_e4m3fn", "float8_e5m2"),
                       "dtype": ("float32", "float16", "bfloat16")},
    }

    def __init__(self):
        self._compiled = {}

    def unavailable(self) -> str | None:
        return missing("openvino")

    def version(self) -> str:
        return f"{dist_version('openvino')} (Convert and FakeConvert, CPU plugin)"

    def implements(self, op, params):
        reason = super().implements(op, params)
        if reason or op != "encode":
            return reason
        fmt = params["format"]
        if params["dtype"] == "float64" and fmt in ("float8_e8m0fnu", "float4_e2m1fn"):
            return f"OpenVINO's CPU Convert has no f64 -> {_TYPES[fmt]} ('cpu_convert can't convert')"
        # Convert has one behaviour per type: f8 overflow -> NaN / Inf (non-saturating), E8M0 clamps
        # to its range (saturating), FP4 has no Inf or NaN (both modes clamp)
        if fmt in ("float8_e4m3fn", "float8_e5m2") and params["saturate"]:
            return "OpenVINO's Convert to f8 does not saturate (overflow gives NaN / Inf)"
        if fmt == "float8_e8m0fnu" and not params["saturate"]:
            return "OpenVINO's Convert to f8e8m0 saturates (Inf and overflow give 0xFE, 0 gives 0x00)"
        return None

    def _convert(self, src: str, dst: str):
        """The compiled model ``Convert(x: src) -> dst`` (OpenVINO element type names)."""
        if (src, dst) not in self._compiled:
            import openvino as ov
            import openvino.opset13 as ops

            x = ops.parameter([-1], getattr(ov.Type, src))
            model = ov.Model([ops.convert(x, getattr(ov.Type, dst))], [x])
            self._compiled[src, dst] = ov.Core().compile_model(model, "CPU", {"INFERENCE_NUM_THREADS": 1})
        return self._compiled[src, dst]

    @staticmethod
    def _tensor(data: np.ndarray, type_name: str, n: int):
        """An OpenVINO tensor of ``n`` elements of ``type_name`` holding ``data``'s bytes."""
        import openvino as ov

        t = ov.Tensor(getattr(ov.Type, type_name), ov.Shape([n]))
        t.data.view(np.uint8).reshape(-1)[:] = np.ascontiguousarray(data).view(np.uint8).reshape(-1)
        return t

    @staticmethod
    def _bytes(compiled, tensor) -> np.ndarray:
        out = compiled([tensor])[compiled.output(0)]
        return np.ascontiguousarray(out).view(np.uint8).reshape(-1)

    def encode(self, x, fmt, *, rounding, saturate, random_bits=None):
        x = np.asarray(x)
        dtype = _INPUT_TYPES[x.dtype.name]
        flat = x.reshape(-1)
        out = self._bytes(self._convert(dtype, _TYPES[fmt]), self._tensor(flat, dtype, flat.size))
        if fmt == "float4_e2m1fn":  # two codes a byte, the first in the low nibble
            out = np.stack([out & 0x0F, out >> 4], axis=-1).reshape(-1)[:flat.size]
        return out.copy().reshape(x.shape)

    def _fake_convert_model(self, src: str, dst: str):
        """The compiled model ``FakeConvert(x, scale, shift, dst)``, all three inputs of type ``src``."""
        if ("fake-model", src, dst) not in self._compiled:
            import openvino as ov
            import openvino.opset13 as ops

            x, scale, shift = (ops.parameter([-1], getattr(ov.Type, src)) for _ in range(3))
            model = ov.Model([ops.fake_convert(x, scale, shift, dst)], [x, scale, shift])
            self._compiled["fake-model", src, dst] = ov.Core().compile_model(model, "CPU",
                                                                             {"INFERENCE_NUM_THREADS": 1})
        return self._compiled["fake-model", src, dst]

    def fake_quant(self, x, scale, shift, fmt, *, form):
        x = np.asarray(x)
        dtype = _INPUT_TYPES[x.dtype.name]
        flat = x.reshape(-1)
        compiled = self._fake_convert_model(dtype, _TYPES[fmt])
        tensors = [self._tensor(a, dtype, a.size) for a in (flat, np.asarray(scale).reshape(-1),
                                                           np.asarray(shift).reshape(-1))]
        out = np.ascontiguousarray(compiled(tensors)[compiled.output(0)]).view(np.uint8).reshape(-1)
        return out.view(x.dtype).copy().reshape(x.shape)

    def decode(self, codes, fmt):
        codes = np.asarray(codes, np.uint8)
        flat = codes.reshape(-1)
        data = flat
        if fmt == "float4_e2m1fn":
            padded = np.concatenate([flat, np.zeros(flat.size % 2, np.uint8)])
            data = padded[0::2] | (padded[1::2] << 4)
        compiled = self._convert(_TYPES[fmt], "f32")
        out = compiled([self._tensor(data, _TYPES[fmt], flat.size)])[compiled.output(0)]
        return np.asarray(out, np.float32).reshape(codes.shape)


class OpenVinoFakeConvertBackend(OpenVinoBackend):
    """OpenVINO's ``FakeConvert`` (opset13; experimental upstream): ``(f8(x * scale - shift) + shift) / scale``
    back in x's dtype, here with scale 1 and shift 0, so its output is the f8 value itself. FakeConvert
    clamps to the f8 range (declared ``saturate=True``). The codes are fp8ref's encoding of the returned
    values, checked to be exact: a value off the f8 grid fails the case instead of being rounded."""

    name = "openvino_fakeconvert"
    default_suites = ("formats", "fp8-static-w8a8")
    capabilities = {
        "encode": {"format": ("float8_e4m3fn", "float8_e5m2"), "rounding": ("rne",), "saturate": (True,),
                   "dtype": ("float32", "float16", "bfloat16")},
    }

    def version(self) -> str:
        return f"{dist_version('openvino')} (FakeConvert, scale 1, CPU plugin)"

    def implements(self, op, params):
        return Backend.implements(self, op, params)

    def _fake_convert(self, src: str, dst: str):
        if ("fake", src, dst) not in self._compiled:
            import openvino as ov
            import openvino.opset13 as ops

            x = ops.parameter([-1], getattr(ov.Type, src))
            one = ops.convert(ops.constant(np.array([1.0], np.float32)), getattr(ov.Type, src))
            zero = ops.convert(ops.constant(np.array([0.0], np.float32)), getattr(ov.Type, src))
            model = ov.Model([ops.fake_convert(x, one, zero, dst)], [x])
            self._compiled["fake", src, dst] = ov.Core().compile_model(model, "CPU", {"INFERENCE_NUM_THREADS": 1})
        return self._compiled["fake", src, dst]

    def encode(self, x, fmt, *, rounding, saturate, random_bits=None):
        x = np.asarray(x)
        flat = x.reshape(-1)
        dtype = _INPUT_TYPES[x.dtype.name]
        out = self._bytes(self._fake_convert(dtype, _TYPES[fmt]), self._tensor(flat, dtype, flat.size))
        values = out.view(x.dtype).astype(np.float64)
        codes = codec.encode(values, fmt, rounding="rne", saturate=False)
        back = codec.decode(codes, fmt).astype(np.float64)
        off = ~((back == values) | (np.isnan(back) & np.isnan(values)))
        if off.any():
            i = int(np.argmax(off))
            raise ValueError(f"FakeConvert returned {values[i]!r} for x={flat[i]!r}, not a {fmt} value "
                             f"({int(off.sum())} such elements)")
        return codes.reshape(x.shape)
