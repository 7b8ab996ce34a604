"""quantize and dequantize with a scheme and a producer recipe, on heavy-tailed tensors or on a
crafted degenerate pattern (``patterns``: fp8ref.golden.degenerate).

Static quantization of random tensors gets its amax from a separate calibration sample, so some
values exceed it and clip, as in deployment; a pattern's static amax is its own (a calibration
sample would hide the zero or subnormal amax the pattern is about).
"""

from __future__ import annotations

from itertools import product

import numpy as np

from ... import codec, quant
from ...formats import get_format
from ...registry import get_recipe, recipe_names
from ...scaling import MX_BLOCK, reduce_amax
from ...scheme import PRESETS
from .. import degenerate, values
from ..case import Case, Operation, shape_name
from ..fields import at_level, choices, per_level, shapes
from .encode import Encode

DTYPES = ("bfloat16", "float16", "float32")
# every recipe of the registry (a suite names the producers it covers; 'all': every registered one)
RECIPES = (choices(recipe_names()), ("fp8ref",))


def fits(recipe: str, qa, shape) -> bool:
    """Whether ``recipe`` can produce ``qa``'s granularity and format on ``shape`` (a recipe that
    requires whole groups or blocks refuses a partial one)."""
    rec = get_recipe(recipe)
    if qa.granularity not in rec.granularities or qa.format not in rec.formats:
        return False
    if not getattr(rec, "require_divisible", False):
        return True
    need = {"group": (qa.group_size,), "block": qa.block_shape}.get(qa.granularity, ())
    return all(d % n == 0 for d, n in zip(shape[::-1], need[::-1], strict=False))


def case_name(prefix: str, pattern: str, shape) -> str:
    """``prefix.SHAPE`` for random inputs (the names of the suites before patterns), else
    ``prefix.PATTERN.SHAPE``."""
    return f"{prefix}.{shape_name(shape)}" if pattern == degenerate.RANDOM else \
        f"{prefix}.{pattern}.{shape_name(shape)}"


def with_pattern(params: dict, pattern: str) -> dict:
    """Random cases keep the parameters they had before patterns existed (their manifests)."""
    return params if pattern == degenerate.RANDOM else {**params, "pattern": pattern}


def _args(params):
    return quant.as_args(PRESETS[params["scheme"]], role=params["role"])


def _amax(stream, params, x, qa):
    """Weights: their own amax. Static activations: a calibration sample's (a pattern's: its own).
    Dynamic, and MX / NVFP4 (quantize computes their block scales from x and refuses an amax): none."""
    if qa.granularity in quant.SELF_SCALED:
        return None
    if params["role"] == "weight" or (not qa.dynamic and "pattern" in params):
        return reduce_amax(x, qa.granularity, group_size=qa.group_size, block_shape=qa.block_shape)
    if qa.dynamic:
        return None
    calib = values.tensor(stream, x.shape, params["dtype"])
    return reduce_amax(calib, qa.granularity, group_size=qa.group_size, block_shape=qa.block_shape)


class _QuantBase(Operation):
    params = ("scheme", "recipe", "role", "dtype", "pattern", "shape")
    patterns = (degenerate.RANDOM, *degenerate.QUANT_PATTERNS, *degenerate.EDGE_PATTERNS)
    fields = {
        "schemes": (choices(tuple(PRESETS)), None),
        "recipes": RECIPES,
        "roles": (choices(("weight", "activation"), allow_all=False), ("weight",)),
        "dtypes": (choices(DTYPES), ("bfloat16",)),
        "shapes": (per_level(shapes(2)), None),
        "patterns": (choices(patterns), (degenerate.RANDOM,)),
    }

    def expand(self, entry, level):
        """Combinations whose scheme and recipe fit (a recipe covers some granularities
        and formats; a weight-only scheme has no activation role; a pattern some granularities)."""
        f, out = entry.fields, []
        shapes_all = at_level(f["shapes"], level)
        for scheme in f["schemes"]:
            for role in f["roles"]:
                try:
                    qa = quant.as_args(PRESETS[scheme], role=role)
                except Exception:  # noqa: BLE001 - e.g. a weight-only scheme has no activation args
                    continue
                for recipe, dtype, pattern, shape in product(f["recipes"], f["dtypes"], f["patterns"], shapes_all):
                    if not fits(recipe, qa, shape) or not (pattern == degenerate.RANDOM or (
                            degenerate.applies(pattern, shape, qa)
                            and degenerate.refused(pattern, get_recipe(recipe)) is None)):
                        continue
                    params = with_pattern({"scheme": scheme, "recipe": recipe, "role": role, "dtype": dtype,
                                           "shape": list(shape)}, pattern)
                    out.append((case_name(f"{self.name}.{scheme}.{recipe}.{role}.{dtype}", pattern, shape), params))
        return out

    def _quantized(self, name, params, suite):
        stream = values.Stream(suite.seed, name)
        qa = _args(params)
        if "pattern" in params:
            x = degenerate.quant_values(params["pattern"], stream, tuple(params["shape"]), params["dtype"], qa)
        else:
            x = values.tensor(stream, tuple(params["shape"]), params["dtype"])
        amax = _amax(stream, params, x, qa)
        return x, amax


class Quantize(_QuantBase):
    name = "quantize"
    outputs = ("codes", "scale")
    signature = "quantize(x, *, scheme, recipe, role, amax=None) -> {'codes': uint8, 'scale': ...}"

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

    def tags(self, params, inputs, mask, got) -> list[tuple[str, ...]]:
        """MX codes: ``tie`` where x / 2**k lies halfway between two element values, ``zero`` where
        fp8ref's code is +-0 (a signed-zero choice); other granularities: ``zero`` where fp8ref's code is
        +-0. Scales carry no tag."""
        x = inputs["x"]
        n = int(mask.sum())
        if mask.shape != x.shape:
            return [()] * n
        expected = self.reference(params, inputs)
        if _args(params).granularity != "mx":  # a signed-zero choice (ONNX's "+ y_zero_point": -0 -> +0)
            zero = codec.decode(expected["codes"][mask], _args(params).format) == 0
            return [("zero",) if z else () for z in zero]
        fmt = get_format(_args(params).format)
        scale = np.repeat(expected["scale"].astype(np.float64), MX_BLOCK, axis=-1)[..., :x.shape[-1]]
        with np.errstate(invalid="ignore", divide="ignore"):
            q = x.astype(np.float64)[mask] / scale[mask]
        tie = Encode._ties(fmt, q)
        zero = codec.decode(expected["codes"][mask], fmt) == 0
        return [tuple(t for t, f in (("tie", a), ("zero", b)) if f) for a, b in zip(tie, zero, strict=True)]

    def element_inputs(self, params, inputs, index):
        if len(index) == len(params["shape"]):
            return {"x": inputs["x"][index]}
        return {}


class Dequantize(_QuantBase):
    name = "dequantize"
    outputs = ("values",)
    signature = "dequantize(codes, scale, *, scheme, recipe, role, dtype) -> values in dtype"

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

    def tags(self, params, inputs, mask, got) -> list[tuple[str, ...]]:
        """``zero`` where the code is +-0 (a signed-zero choice)."""
        fmt = get_format(_args(params).format)
        zero = codec.decode(inputs["codes"][mask], fmt) == 0
        return [("zero",) if z else () for z in zero]

    def call(self, backend, params, inputs):
        return {"values": backend.dequantize(inputs["codes"], inputs["scale"], scheme=params["scheme"],
                                             recipe=params["recipe"], role=params["role"], dtype=params["dtype"])}

    def element_inputs(self, params, inputs, index):
        return {"codes": inputs["codes"][index]}
