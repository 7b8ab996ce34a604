"""scaled_mm with an accumulation model, and a W8A8 linear layer, on heavy-tailed tensors whose
rows differ in magnitude by powers of two, as real weights and activations do, or on a crafted
degenerate pattern (``patterns``: fp8ref.golden.degenerate).

An FP8 ``out_dtype`` (codes out) comes with a ``scale_result`` input, neither 1 nor a power of two
(``degenerate.result_scale``), passed to the backend as ``scale_result=`` (v = result / scale_result,
then encoded): a backend that declares FP8 out_dtypes takes that keyword.

``scales: block16`` (NVFP4) and ``block32`` (MXFP4, MXFP8) are the block-scaled cases
(``block_gemm``): float32 block scales per 1 x 16 / 1 x 32 of K on both operands, and for block16
an ``alpha`` input (the product of the two global scales) passed as ``alpha=``."""

from __future__ import annotations

from itertools import product

import numpy as np

from ... import codec, matmul, quant
from ...formats import get_format
from ...registry import get_recipe
from ...scaling import reduce_amax
from ...scheme import PRESETS
from .. import degenerate, values
from ..case import Case, Operation
from ..fields import at_level, choices, per_level, shapes
from . import block_gemm
from .quantize import DTYPES, RECIPES, case_name, fits, with_pattern

_FP8 = ("float8_e4m3fn", "float8_e5m2")
BLOCK = matmul.SCALE_BLOCK  # scales: block128: a's per 1 x BLOCK group, b's per BLOCK x BLOCK block
_OUT_DTYPES = ("float32", "bfloat16", "float16", *_FP8)
_SCALES = ("tensor", "row", "block128", *block_gemm.BLOCK_SCALES)
_PATTERNS = (degenerate.RANDOM, *degenerate.GEMM_PATTERNS,
             *(p for p in block_gemm.BLOCK_PATTERNS if p not in degenerate.GEMM_PATTERNS))


def _codes(stream, shape, fmt) -> tuple[np.ndarray, np.ndarray]:
    """Codes of a heavy-tailed tensor quantized per row, and the per-row dequant scales."""
    return degenerate.row_codes(values.heavy_tailed(stream, shape[0] * shape[1]).reshape(shape), fmt)


def _block_codes(stream, shape, fmt, rows: int) -> tuple[np.ndarray, np.ndarray]:
    """Codes of a heavy-tailed (R, K) tensor quantized per ``rows`` x BLOCK block (edge blocks
    cropped) and the dequant scales (ceil(R/rows), ceil(K/BLOCK)): ``fp32(amax / max)``, 1 where amax is 0."""
    R, K = shape
    v = values.heavy_tailed(stream, R * K).reshape(shape)
    rb, kb = -(-R // rows), -(-K // BLOCK)
    pad = np.zeros((rb * rows, kb * BLOCK))
    pad[:R, :K] = np.abs(v)
    amax = pad.reshape(rb, rows, kb, BLOCK).max(axis=(1, 3))
    scale = np.where(amax > 0, amax / np.float64(get_format(fmt).max), 1.0).astype(np.float32)
    full = np.repeat(np.repeat(scale, rows, axis=0), BLOCK, axis=1)[:R, :K]
    return codec.encode((v / full).astype(np.float32), fmt), scale


class ScaledMM(Operation):
    name = "scaled_mm"
    params = ("format", "scales", "out_dtype", "accumulate", "scale_order", "bias", "pattern", "shape")
    outputs = ("out",)
    signature = ("scaled_mm(a, b, scale_a, scale_b, *, bias, fmt, out_dtype, accumulate, scale_order) "
                 "-> out in out_dtype")
    conditional_keywords = {"alpha": ("scales", ("block16",))}  # NVFP4's global scales, folded
    fields = {
        "formats": (choices((*_FP8, "float4_e2m1fn")), ("float8_e4m3fn",)),
        "shapes": (per_level(shapes(3)), None),
        "scales": (choices(_SCALES, allow_all=False), ("tensor", "row")),
        "out_dtypes": (choices(_OUT_DTYPES), ("float32",)),
        "accumulate": (choices(matmul.ACCUMULATIONS), ("exact",)),
        "scale_order": (choices(matmul.SCALE_ORDERS, allow_all=False), ("epilogue",)),
        "bias": (choices((False, True), allow_all=False, kind=bool), (False,)),
        "patterns": (choices(_PATTERNS), (degenerate.RANDOM,)),
    }

    def expand(self, entry, level):
        f, out = entry.fields, []
        shapes_all = at_level(f["shapes"], level)
        for fmt, scales, od, acc in product(f["formats"], f["scales"], f["out_dtypes"], f["accumulate"]):
            blocked = scales in block_gemm.BLOCK_SCALES
            if blocked and (acc not in ("exact", "fp32") or od in _FP8):
                continue  # block-scaled cases: float outputs, exact and fp32 (kernels rank as models)
            for order in (f["scale_order"] if acc == "fp32" else ("epilogue",)):  # orders matter in fp32 only
                for bias, pattern, shape in product(f["bias"], f["patterns"], shapes_all):
                    if pattern != degenerate.RANDOM and scales == "block128":
                        continue  # the patterns build per-row scales (K tails of block scales: linear FP8_BLOCK)
                    if not block_gemm.fits(fmt, scales, pattern, shape[1]):
                        continue
                    params = with_pattern({"format": fmt, "scales": scales, "out_dtype": od, "accumulate": acc,
                                           "scale_order": order, "bias": bias, "shape": list(shape)}, pattern)
                    prefix = (f"scaled_mm.{fmt}.{scales}.{od}.{acc}" + (f"-{order}" if acc == "fp32" else "")
                              + (".bias" if bias else ""))
                    out.append((case_name(prefix, pattern, shape), params))
        return out

    def make_case(self, name, params, entry, suite, level) -> Case:
        stream = values.Stream(suite.seed, name)
        M, K, N = params["shape"]
        if params["scales"] in block_gemm.BLOCK_SCALES:
            return self._block_case(name, params, stream)
        if "pattern" in params:  # tensor and row scales only (expand)
            ops = degenerate.gemm_operands(params["pattern"], stream, M, K, N, params["format"])
            a, sa, bt, sb = ops["a"], ops["sa"], ops["bt"], ops["sb"]
        elif params["scales"] == "block128":  # a: (M, KB) per 1x128 group; b: (KB, NB) per 128x128 block
            a, sa = _block_codes(stream, (M, K), params["format"], 1)
            bt, sbt = _block_codes(stream, (N, K), params["format"], BLOCK)
            sb = np.ascontiguousarray(sbt.T)
        else:
            a, sa = _codes(stream, (M, K), params["format"])
            bt, sb = _codes(stream, (N, K), params["format"])
        if params["scales"] == "tensor":  # the patterns' per-tensor scales: two different non-unit values
            sa, sb = sa.max().reshape(1), (sb.min() if "pattern" in params else sb.max()).reshape(1)
        elif params["scales"] == "row":
            sb = sb.reshape(1, N)
        inputs = {"a": a, "b": np.ascontiguousarray(bt.T), "scale_a": sa, "scale_b": sb}
        if params["bias"]:
            bias = values.heavy_tailed(stream, N)
            inputs["bias"] = values.from_bits(values.round_to(bias, params["out_dtype"]), params["out_dtype"])
        if params["out_dtype"] in _FP8:
            exact = matmul.scaled_mm(a, inputs["b"], sa, sb, out_dtype="float32", fmt_a=params["format"],
                                     fmt_b=params["format"])
            inputs["scale_result"] = np.array([degenerate.result_scale(exact)], np.float32)
        return Case(name, self.name, params, inputs)

    def _block_case(self, name, params, stream) -> Case:
        M, K, N = params["shape"]
        inputs = block_gemm.operands(params.get("pattern", degenerate.RANDOM), stream, M, K, N, params["format"],
                                     params["scales"])
        if params["scales"] == "block16":
            inputs["alpha"] = block_gemm.alpha(stream)
        if params["bias"]:
            bias = values.heavy_tailed(stream, N)
            inputs["bias"] = values.from_bits(values.round_to(bias, params["out_dtype"]), params["out_dtype"])
        return Case(name, self.name, params, inputs)

    @staticmethod
    def _result_kw(inputs) -> dict:
        kw = {"scale_result": inputs["scale_result"]} if "scale_result" in inputs else {}
        return {**kw, "alpha": inputs["alpha"]} if "alpha" in inputs else kw

    def reference(self, params, inputs):
        if params["scales"] in block_gemm.BLOCK_SCALES:
            return {"out": values.from_bits(values.round_to(block_gemm.reference(params, inputs).astype(np.float64),
                                                            params["out_dtype"]), params["out_dtype"])}
        # block_k also sets fp32's K-blocks: given for block cases only (tensor and row cases sum K whole)
        kw = {"block_k": BLOCK, "block_n": BLOCK} if params["scales"] == "block128" else {}
        if "scale_result" in inputs:
            kw["scale_result"] = np.float32(inputs["scale_result"].reshape(-1)[0])
        return {"out": matmul.scaled_mm(inputs["a"], inputs["b"], inputs["scale_a"], inputs["scale_b"],
                                        bias=inputs.get("bias"), out_dtype=params["out_dtype"],
                                        accumulate=params["accumulate"], fmt_a=params["format"],
                                        fmt_b=params["format"], scale_order=params["scale_order"], **kw)}

    def call(self, backend, params, inputs):
        return {"out": backend.scaled_mm(inputs["a"], inputs["b"], inputs["scale_a"], inputs["scale_b"],
                                         bias=inputs.get("bias"), fmt=params["format"],
                                         out_dtype=params["out_dtype"], accumulate=params["accumulate"],
                                         scale_order=params["scale_order"], **self._result_kw(inputs))}

    def output_format(self, params, output):
        return params.get("out_dtype") if params.get("out_dtype") in _FP8 else None

    def element_inputs(self, params, inputs, index):
        m, n = index
        return {"a_row": m, "b_col": n}

    def operands(self, params, inputs, index):
        m, n = index
        if params["scales"] in block_gemm.BLOCK_SCALES:
            out = {f"a[{m}, :]": inputs["a"][m], f"b[:, {n}]": inputs["b"][:, n],
                   f"scale_a[{m}, :]": inputs["scale_a"][m], f"scale_b[:, {n}]": inputs["scale_b"][:, n]}
            out.update({k: inputs[k].reshape(-1)[0] for k in ("alpha",) if k in inputs})
            if "bias" in inputs:
                out[f"bias[{n}]"] = inputs["bias"][n]
            return out
        if params["scales"] == "block128":
            nb = n // BLOCK
            out = {f"a[{m}, :]": inputs["a"][m], f"b[:, {n}]": inputs["b"][:, n],
                   f"scale_a[{m}, :]": inputs["scale_a"][m], f"scale_b[:, {nb}]": inputs["scale_b"][:, nb]}
            if "bias" in inputs:
                out[f"bias[{n}]"] = inputs["bias"][n]
            return out
        sa, sb = inputs["scale_a"].reshape(-1), inputs["scale_b"].reshape(-1)
        out = {f"a[{m}, :]": inputs["a"][m], f"b[:, {n}]": inputs["b"][:, n],
               "scale_a" if sa.size == 1 else f"scale_a[{m}]": sa[0 if sa.size == 1 else m],
               "scale_b" if sb.size == 1 else f"scale_b[{n}]": sb[0 if sb.size == 1 else n]}
        if "bias" in inputs:
            out[f"bias[{n}]"] = inputs["bias"][n]
        return out


class Linear(Operation):
    name = "linear"
    params = ("scheme", "recipe", "dtype", "accumulate", "pattern", "shape")
    outputs = ("y",)
    signature = "linear(x, weight, weight_scale, *, input_scale, dynamic, accumulate) -> y in x's dtype"
    fields = {
        "schemes": (choices(("FP8_STATIC", "FP8_DYNAMIC", "FP8", "FP8_BLOCK"), allow_all=False), ("FP8_STATIC",)),
        "recipes": RECIPES,
        "dtypes": (choices(DTYPES), ("bfloat16",)),
        "shapes": (per_level(shapes(3)), None),
        "accumulate": (choices(matmul.ACCUMULATIONS), ("exact",)),
        "patterns": (choices((degenerate.RANDOM, *degenerate.LINEAR_PATTERNS)), (degenerate.RANDOM,)),
    }

    def expand(self, entry, level):
        """Combinations whose weight recipe fits the scheme (FP8_BLOCK: 128 x 128 weight blocks, 1 x 128
        activation groups); k-tail where K is not a multiple of 128 and the scheme has K blocks."""
        f, out = entry.fields, []
        shapes_all = at_level(f["shapes"], level)
        for scheme, recipe, dtype, acc, pattern, shape in product(f["schemes"], f["recipes"], f["dtypes"],
                                                                  f["accumulate"], f["patterns"], shapes_all):
            qa = quant.as_args(PRESETS[scheme])
            wshape = (shape[2], shape[1])
            if not fits(recipe, qa, wshape) or (pattern != degenerate.RANDOM and (
                    not degenerate.applies(pattern, wshape, qa) or degenerate.refused(pattern, get_recipe(recipe)))):
                continue
            params = with_pattern({"scheme": scheme, "recipe": recipe, "dtype": dtype, "accumulate": acc,
                                   "shape": list(shape)}, pattern)
            out.append((case_name(f"linear.{scheme}.{recipe}.{dtype}.{acc}", pattern, shape), params))
        return out

    def make_case(self, name, params, entry, suite, level) -> Case:
        """x (T, K); W (N, K) quantized with the scheme's weight args and the recipe; for a
        static scheme, input_scale = fp32(amax of a calibration batch / max) (a pattern's: of x,
        1.0 where that amax is 0)."""
        stream = values.Stream(suite.seed, name)
        T, K, N = params["shape"]
        scheme = PRESETS[params["scheme"]]
        qa = quant.as_args(scheme)
        pattern = params.get("pattern")
        if pattern is None:
            x = values.tensor(stream, (T, K), params["dtype"])
            w = values.tensor(stream, (N, K), params["dtype"])
        else:  # x per token (FP8_BLOCK: per 1 x 128 group), W per the scheme's weight blocks
            xa = quant.as_args(scheme, role="activation")
            xa = xa if xa.granularity == "group" else quant.QuantArgs(granularity="token")
            x = degenerate.quant_values(pattern, stream, (T, K), params["dtype"], xa)
            w = degenerate.quant_values(pattern, stream, (N, K), params["dtype"], qa)
        q = quant.quantize(w, scheme, recipe=params["recipe"],
                           amax=reduce_amax(w, qa.granularity, block_shape=qa.block_shape))
        inputs = {"x": x, "weight": q.codes, "weight_scale": q.scale}
        if not scheme["act_dynamic"]:
            amax = reduce_amax(values.tensor(stream, (T, K), params["dtype"]) if pattern is None else x, "tensor")
            if pattern is not None and not amax[0] > 0:
                amax = np.array([448.0])
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

    def operands(self, params, inputs, index):
        t, n = index
        ws = inputs["weight_scale"]
        per_channel = ws.size > 1 and ws.shape[0] > 1
        scale = ws.reshape(ws.shape[0], -1)[n if per_channel else 0]
        out = {f"x[{t}, :]": inputs["x"][t], f"weight[{n}, :]": inputs["weight"][n],
               f"weight_scale[{n}]" if per_channel else "weight_scale": scale}
        if "input_scale" in inputs:
            out["input_scale"] = inputs["input_scale"].reshape(-1)[0]
        return out
