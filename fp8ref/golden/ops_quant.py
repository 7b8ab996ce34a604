"""Suite operations above the codec: quantize and dequantize with a scheme and a producer
recipe, scaled_mm with an accumulation model, and a W8A8 linear layer.

Tensors are heavy-tailed (Student-t-like with 1 % outliers) with a different power-of-two
magnitude per row, as real weights and activations are. Static quantization gets its amax
from a separate calibration sample, so some values exceed it and clip, as in deployment.
"""

from __future__ import annotations

import numpy as np

from .. import codec, matmul, quant
from ..formats import get_format
from ..registry import get_recipe
from ..scaling import reduce_amax
from ..scheme import PRESETS
from . import values
from .ops import Case, Operation
from .suite import at_level, choices, per_level, shapes

_DTYPES = ("bfloat16", "float16", "float32")
_FP8 = ("float8_e4m3fn", "float8_e5m2")


def _shape_name(shape) -> str:
    return "x".join(map(str, shape))


def tensor(stream: values.Stream, shape: tuple, dtype: str) -> np.ndarray:
    """A heavy-tailed tensor in ``dtype`` whose rows differ in magnitude by powers of two."""
    rows = int(np.prod(shape[:-1], dtype=np.int64))
    v = values.heavy_tailed(stream, rows * shape[-1]).reshape(rows, shape[-1])
    v = np.ldexp(v, stream.integers(rows, -3, 4)[:, None]).reshape(shape)
    return values.from_bits(values.round_to(v, dtype), dtype)


def _args(params):
    return quant.as_args(PRESETS[params["scheme"]], role=params["role"])


def _amax(stream, params, x, qa):
    """Weights: their own amax. Static activations: a calibration sample's. Dynamic: none."""
    if params["role"] == "weight":
        return reduce_amax(x, qa.granularity, group_size=qa.group_size, block_shape=qa.block_shape)
    if qa.dynamic:
        return None
    calib = tensor(stream, x.shape, params["dtype"])
    return reduce_amax(calib, qa.granularity, group_size=qa.group_size, block_shape=qa.block_shape)


class _QuantBase(Operation):
    fields = {
        "schemes": (choices(tuple(PRESETS), allow_all=False), None),
        "recipes": (choices(("auto-round", "compressed-tensors", "fbgemm", "fp8ref", "hf-fp8", "vllm-dynamic",
                             "vllm-static"), allow_all=False), ("fp8ref",)),
        "roles": (choices(("weight", "activation"), allow_all=False), ("weight",)),
        "dtypes": (choices(_DTYPES), ("bfloat16",)),
        "shapes": (per_level(shapes(2)), None),
    }

    def expand(self, entry, level):
        """Combinations whose scheme and recipe fit (a recipe covers some granularities
        and formats; a weight-only scheme has no activation role)."""
        f, out = entry.fields, []
        shapes_all = at_level(f["shapes"], level)
        for scheme in f["schemes"]:
            for role in f["roles"]:
                try:
                    qa = quant.as_args(PRESETS[scheme], role=role)
                except Exception:  # noqa: BLE001 - e.g. a weight-only scheme has no activation args
                    continue
                for recipe in f["recipes"]:
                    rec = get_recipe(recipe)
                    if qa.granularity not in rec.granularities or qa.format not in rec.formats:
                        continue
                    for dtype in f["dtypes"]:
                        for shape in shapes_all:
                            params = {"scheme": scheme, "recipe": recipe, "role": role, "dtype": dtype,
                                      "shape": list(shape)}
                            out.append((f"{self.name}.{scheme}.{recipe}.{role}.{dtype}.{_shape_name(shape)}",
                                        params))
        return out

    def _quantized(self, name, params, suite):
        stream = values.Stream(suite.seed, name)
        x = tensor(stream, tuple(params["shape"]), params["dtype"])
        qa = _args(params)
        amax = _amax(stream, params, x, qa)
        return x, amax


class Quantize(_QuantBase):
    name = "quantize"
    outputs = ("codes", "scale")

    def make_case(self, name, params, entry, suite, level) -> Case:
        x, amax = self._quantized(name, params, suite)
        inputs = {"x": x} if amax is None else {"x": x, "amax": amax.astype(np.float64)}
        return Case(name, self.name, params, inputs)

    def reference(self, params, inputs):
        q = quant.quantize(inputs["x"], PRESETS[params["scheme"]], recipe=params["recipe"],
                           amax=inputs.get("amax"), role=params["role"])
        return {"codes": q.codes, "scale": q.scale}

    def call(self, backend, params, inputs):
        return backend.quantize(inputs["x"], scheme=params["scheme"], recipe=params["recipe"], role=params["role"],
                                amax=inputs.get("amax"))

    def output_format(self, params, output):
        return _args(params).format if output == "codes" else None

    def element_inputs(self, params, inputs, index):
        if len(index) == len(params["shape"]):
            return {"x": inputs["x"][index]}
        return {}


class Dequantize(_QuantBase):
    name = "dequantize"
    outputs = ("values",)

    def make_case(self, name, params, entry, suite, level) -> Case:
        x, amax = self._quantized(name, params, suite)
        q = quant.quantize(x, PRESETS[params["scheme"]], recipe=params["recipe"], amax=amax, role=params["role"])
        return Case(name, self.name, params, {"codes": q.codes, "scale": q.scale})

    def reference(self, params, inputs):
        qa, rec = _args(params), get_recipe(params["recipe"])
        scale = inputs["scale"]
        q = quant.QuantResult(inputs["codes"], scale, qa.format, qa.granularity, rec.name, qa,
                              scale.dtype.name, params["dtype"], _recipe=rec)
        return {"values": quant.dequantize(q)}

    def call(self, backend, params, inputs):
        return {"values": backend.dequantize(inputs["codes"], inputs["scale"], scheme=params["scheme"],
                                             recipe=params["recipe"], role=params["role"], dtype=params["dtype"])}

    def element_inputs(self, params, inputs, index):
        return {"codes": inputs["codes"][index]}


def _codes(stream, shape, fmt) -> tuple[np.ndarray, np.ndarray]:
    """Codes of a heavy-tailed tensor quantized per row, and the per-row dequant scales."""
    v = values.heavy_tailed(stream, shape[0] * shape[1]).reshape(shape)
    amax = np.abs(v).max(axis=1, keepdims=True)
    scale = (amax / np.float64(get_format(fmt).max)).astype(np.float32)
    return codec.encode((v / scale).astype(np.float32), fmt), scale


class ScaledMM(Operation):
    name = "scaled_mm"
    outputs = ("out",)
    fields = {
        "formats": (choices(_FP8), ("float8_e4m3fn",)),
        "shapes": (per_level(shapes(3)), None),
        "scales": (choices(("tensor", "row"), allow_all=False), ("tensor", "row")),
        "out_dtypes": (choices(("float32", "bfloat16", "float16")), ("float32",)),
        "accumulate": (choices(matmul.ACCUMULATIONS), ("exact",)),
        "scale_order": (choices(matmul.SCALE_ORDERS, allow_all=False), ("epilogue",)),
        "bias": (choices((False, True), allow_all=False, kind=bool), (False,)),
    }

    def expand(self, entry, level):
        f, out = entry.fields, []
        shapes_all = at_level(f["shapes"], level)
        for fmt in f["formats"]:
            for scales in f["scales"]:
                for od in f["out_dtypes"]:
                    for acc in f["accumulate"]:
                        for order in (f["scale_order"] if acc == "fp32" else ("epilogue",)):
                            for bias in f["bias"]:
                                for shape in shapes_all:
                                    params = {"format": fmt, "scales": scales, "out_dtype": od, "accumulate": acc,
                                              "scale_order": order, "bias": bias, "shape": list(shape)}
                                    name = (f"scaled_mm.{fmt}.{scales}.{od}.{acc}"
                                            + (f"-{order}" if acc == "fp32" else "")
                                            + (".bias" if bias else "") + f".{_shape_name(shape)}")
                                    out.append((name, params))
        return out

    def make_case(self, name, params, entry, suite, level) -> Case:
        stream = values.Stream(suite.seed, name)
        M, K, N = params["shape"]
        a, sa = _codes(stream, (M, K), params["format"])
        bt, sb = _codes(stream, (N, K), params["format"])
        if params["scales"] == "tensor":
            sa, sb = sa.max().reshape(1), sb.max().reshape(1)
        else:
            sb = sb.reshape(1, N)
        inputs = {"a": a, "b": np.ascontiguousarray(bt.T), "scale_a": sa, "scale_b": sb}
        if params["bias"]:
            bias = values.heavy_tailed(stream, N)
            inputs["bias"] = values.from_bits(values.round_to(bias, params["out_dtype"]), params["out_dtype"])
        return Case(name, self.name, params, inputs)

    def reference(self, params, inputs):
        return {"out": matmul.scaled_mm(inputs["a"], inputs["b"], inputs["scale_a"], inputs["scale_b"],
                                        bias=inputs.get("bias"), out_dtype=params["out_dtype"],
                                        accumulate=params["accumulate"], fmt_a=params["format"],
                                        fmt_b=params["format"], scale_order=params["scale_order"])}

    def call(self, backend, params, inputs):
        return {"out": backend.scaled_mm(inputs["a"], inputs["b"], inputs["scale_a"], inputs["scale_b"],
                                         bias=inputs.get("bias"), fmt=params["format"],
                                         out_dtype=params["out_dtype"], accumulate=params["accumulate"],
                                         scale_order=params["scale_order"])}

    def element_inputs(self, params, inputs, index):
        m, n = index
        return {"a_row": m, "b_col": n}


class Linear(Operation):
    name = "linear"
    outputs = ("y",)
    fields = {
        "schemes": (choices(("FP8_STATIC", "FP8_DYNAMIC", "FP8"), allow_all=False), ("FP8_STATIC",)),
        "recipes": _QuantBase.fields["recipes"],
        "dtypes": (choices(_DTYPES), ("bfloat16",)),
        "shapes": (per_level(shapes(3)), None),
        "accumulate": (choices(matmul.ACCUMULATIONS), ("exact",)),
    }

    def expand(self, entry, level):
        f, out = entry.fields, []
        shapes_all = at_level(f["shapes"], level)
        for scheme in f["schemes"]:
            for recipe in f["recipes"]:
                for dtype in f["dtypes"]:
                    for acc in f["accumulate"]:
                        for shape in shapes_all:
                            params = {"scheme": scheme, "recipe": recipe, "dtype": dtype, "accumulate": acc,
                                      "shape": list(shape)}
                            out.append((f"linear.{scheme}.{recipe}.{dtype}.{acc}.{_shape_name(shape)}", params))
        return out

    def make_case(self, name, params, entry, suite, level) -> Case:
        """x (T, K); W (N, K) quantized with the scheme's weight args and the recipe; for a
        static scheme, input_scale = fp32(amax of a calibration batch / max)."""
        stream = values.Stream(suite.seed, name)
        T, K, N = params["shape"]
        scheme = PRESETS[params["scheme"]]
        x = tensor(stream, (T, K), params["dtype"])
        w = tensor(stream, (N, K), params["dtype"])
        qa = quant.as_args(scheme)
        q = quant.quantize(w, scheme, recipe=params["recipe"],
                           amax=reduce_amax(w, qa.granularity, block_shape=qa.block_shape))
        inputs = {"x": x, "weight": q.codes, "weight_scale": q.scale}
        if not scheme["act_dynamic"]:
            amax = reduce_amax(tensor(stream, (T, K), params["dtype"]), "tensor")
            inputs["input_scale"] = (amax / np.float64(448.0)).astype(np.float32)
        return Case(name, self.name, params, inputs)

    @staticmethod
    def _dynamic(params, inputs):
        return None if "input_scale" in inputs else PRESETS[params["scheme"]]["act_granularity"]

    def reference(self, params, inputs):
        # a loader widens a stored bf16/fp16 weight scale to fp32 (exact) for the GEMM
        return {"y": matmul.linear(inputs["x"], inputs["weight"], inputs["weight_scale"].astype(np.float32),
                                   input_scale=inputs.get("input_scale"), dynamic=self._dynamic(params, inputs),
                                   accumulate=params["accumulate"])}

    def call(self, backend, params, inputs):
        return {"y": backend.linear(inputs["x"], inputs["weight"], inputs["weight_scale"],
                                    input_scale=inputs.get("input_scale"), dynamic=self._dynamic(params, inputs),
                                    accumulate=params["accumulate"])}

    def element_inputs(self, params, inputs, index):
        t, n = index
        return {"token": t, "out_channel": n}
