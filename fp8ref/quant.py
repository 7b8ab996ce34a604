"""quantize / dequantize / fake_quant on top of scaling + codec + recipes.

``quantize(x, args, *, recipe=None, scale=None, amax=None)`` takes a numpy array or a torch
CPU tensor (float16, bfloat16, float32, float64) and returns a frozen ``QuantResult`` whose
arrays are in the same library. Stored scales are dequantization multipliers
(``x ~ decode(codes) * scale``). Dynamic quantization computes the scale from ``x``; static
quantization takes a calibrated ``scale`` (or an ``amax``). See docs/quantize.md.

This module is the API and the element-scale path (tensor, channel, token, group, block); the
MX and NVFP4 block formats are ``microscaling``, the C loops' glue ``_native_quant``, and what
all three read from the caller ``_quant_inputs``.
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np

from . import _arrays, _native, _native_quant, microscaling
from ._arrays import (
    aligned_empty,
    bits_input,
    deliver,
    empty_float32_tensor,
    f32_to_bf16_bits,
    float_input,
    is_torch,
    output_buffer,
    same_library,
    tensor_pair,
    to_numpy,
)
from ._quant_inputs import as_rows, reduction_values, reject_nonfinite, scale_array, widen
from .codec import ROUNDING_MODES, decode, encode
from .errors import Fp8RefError, InputTypeError, RecipeError, ScaleError, ShapeError
from .exact import residual_sign
from .formats import FloatFormat, get_format
from .microscaling import nvfp4_producer_global
from .recipes import BlockRecipe, Recipe, apply_scaled, check_scale, compute_scale, exact_quotient_codes, store_dtype
from .registry import get_recipe
from .rounding import round_to
from .scaling import GRANULARITIES, MX_SCALE_RULES, expand, group_of, layout, reduce_amax
from .scheme import QuantizationScheme

_ROWS_ELEMENTS = 1 << 18  # elements per work chunk: temporaries stay in cache, memory O(chunk)


_SCALE_DTYPES = ("model", "float32", "bfloat16", "float16", "float8_e8m0fnu", "float8_e4m3fn")


@dataclass(frozen=True)
class QuantArgs:
    """What to quantize to (the recipe says how the producer computes it)."""

    format: str = "float8_e4m3fn"
    granularity: str = "tensor"          # one of scaling.GRANULARITIES
    group_size: int | None = None        # granularity 'group'
    block_shape: tuple[int, int] | None = None  # granularity 'block'
    dynamic: bool = True                 # scale from x itself (weights, dynamic activations);
    #                                      False: static activations, a calibrated scale/amax is required
    rounding: str = "rne"
    saturate: bool = True
    mx_rule: str = "floor"               # MX E8M0 scale rule by name: scaling.MX_SCALE_RULES (floor = ocp-floor)
    recipe: str | None = None            # default recipe when quantize(recipe=None)
    scale_dtype: str = "model"           # 'model': the recipe's own; float32/bfloat16/float16 (recipes.store_dtype)

    def __post_init__(self):
        get_format(self.format)
        if self.granularity not in GRANULARITIES:
            raise ShapeError(f"granularity: expected one of {', '.join(GRANULARITIES)}, got {self.granularity!r}")
        if self.granularity == "group":
            group_of("group", self.group_size)
        if self.granularity == "block":
            layout((1, 1), "block", block_shape=self.block_shape)
            object.__setattr__(self, "block_shape", tuple(self.block_shape))
        if self.rounding not in ROUNDING_MODES or self.rounding == "stochastic":
            raise InputTypeError(f"rounding: expected one of {', '.join(ROUNDING_MODES[:-1])} "
                                 f"(stochastic rounding: use fp8ref.encode), got {self.rounding!r}")
        for name in ("saturate", "dynamic"):
            if not isinstance(getattr(self, name), bool):
                raise InputTypeError(f"{name}: expected True or False, got {getattr(self, name)!r}")
        if self.scale_dtype not in _SCALE_DTYPES:
            raise InputTypeError(f"scale_dtype: expected one of {', '.join(_SCALE_DTYPES)}, got {self.scale_dtype!r}")
        if self.mx_rule not in MX_SCALE_RULES:
            raise InputTypeError(f"mx_rule: expected one of {', '.join(MX_SCALE_RULES)}, got {self.mx_rule!r}")


@dataclass(frozen=True)
class QuantResult:
    """codes (uint8) and scale (dequant multiplier, values exact in ``scale_dtype``)."""

    codes: object
    scale: object
    format: str
    granularity: str
    recipe: str
    args: QuantArgs
    scale_dtype: str                     # float32, bfloat16, float16, float8_e8m0fnu, float8_e4m3fn
    dtype: str                           # the input's dtype
    scale_codes: object = None           # MX (E8M0) / NVFP4 (E4M3) block scale codes
    global_scale: object = None          # NVFP4 fp32 global scale, as the producer stores it ...
    global_meaning: str = "multiplier"   # ... a dequant multiplier, or a divisor (x ~ q * s_b / g)
    _recipe: Recipe = field(default=None, repr=False, compare=False)


# --- public API ---------------------------------------------------------------------------
def as_args(args, *, role: str = "weight") -> QuantArgs:
    """QuantArgs, or a QuantizationScheme / mapping of its fields (``role``: weight|activation)."""
    if isinstance(args, QuantArgs):
        return args
    if not isinstance(args, Mapping):
        raise InputTypeError(f"args: expected QuantArgs or a QuantizationScheme, got {type(args).__name__}")
    if role not in ("weight", "activation"):
        raise InputTypeError(f"role: expected 'weight' or 'activation', got {role!r}")
    s = args if isinstance(args, QuantizationScheme) else QuantizationScheme.from_dict(args)
    act = role == "activation"
    if act and not s.quantizes_activations:
        raise ShapeError(f"args: the scheme does not quantize activations (act_bits={s['act_bits']})")
    family = s["act_data_type"] if act else s["data_type"]
    gran = s["act_granularity"] if act else s["weight_granularity"]
    group = s["act_group_size"] if act else s["group_size"]
    if family == "mx_fp":
        gran = "mx"
    elif family.startswith("nv_fp"):
        gran = "nvfp4"
    # the scheme's scale_dtype is its weights': FP8 inputs under MX weights (MXFP4XFP8) scale in the model dtype
    own_scale = family == "fp" and not (act and s["data_type"] != "fp")
    return QuantArgs(format=s["act_format"] if act else s["weight_format"], granularity=gran,
                     group_size=group if gran == "group" else None,
                     block_shape=None if act else s["block_shape"],
                     dynamic=bool(s["act_dynamic"]) if act else True,  # a weight's scale comes from W
                     rounding=s["rounding"], saturate=s["saturate"], recipe=s["recipe"],
                     scale_dtype=s["scale_dtype"] if own_scale else "model")  # MX/NVFP4: the format's


def quantize(x, args, *, recipe=None, scale=None, amax=None, role: str = "weight", out=None) -> QuantResult:
    """Quantize ``x`` per ``args`` (QuantArgs or QuantizationScheme) with ``recipe``.

    recipe: a Recipe or a built-in name; None -> args' recipe, else 'fp8ref'.
    scale: a calibrated dequant scale of the granularity's shape (static quantization).
    amax: a calibrated max|x| of that shape; the recipe turns it into the scale.
    out: a preallocated array for the codes (granularities tensor, channel, token, group and block):
    uint8 of x's shape, contiguous, in x's library (a torch tensor may also have the format's float8
    dtype), not overlapping x; the result's ``codes`` is ``out`` itself. A pipeline that quantizes
    into the same buffer again saves what a fresh array costs (the kernel zeroes its pages on first
    touch). An error found before the codes are computed (arguments, scales) leaves ``out`` as it
    was; a non-finite x found by the loop itself (recipes that reject NaN/Inf) may leave it partly
    written.
    """
    if out is not None and scale is None and amax is None:
        res = _quantize_tensor_into(x, args, recipe, role, out)
        if res is not None:
            return res
    return _quantize(float_input(x, "x"), args, recipe, scale, amax, role, out)


def _quantize_tensor_into(x, args, recipe, role, out) -> QuantResult | None:
    """``quantize(x, args, out=out)`` of torch tensors with dynamic scales in the fewest steps: the
    fused C pass, a plan per set of arguments and shape (_tensor_plan), the tensors' addresses instead
    of numpy views. None where it does not apply, or where a code is not final (an amax of NaN/Inf,
    an operand the loop cannot take): _quantize then runs, checks everything and gives the same
    result. After a large pass, each torch, numpy or ctypes step of a call costs 5-35 us from the
    caches (1-4 warm): the general path's 0.45-0.6 ms is about as long as the C tasks of a
    1024x4096 weight (docs/performance.md, eighteenth pass)."""
    pair = tensor_pair(x, out)
    if pair is None or not _native.kernels_available():
        return None
    dtype, shape, out_dtype, xp, op = pair
    try:
        plan = _tensor_plan(args, recipe, role, dtype, shape, out_dtype)
    except TypeError:  # unhashable arguments (a dict of scheme fields): the general path
        return None
    if plan is None:
        return None
    n = math.prod(shape)
    if xp < op + n and op < xp + 2 * n:  # overlapping: the general path refuses it
        return None
    qa, rec, fmt, sshape, fused, stream = plan
    scale, sp = empty_float32_tensor(sshape)  # float32 values exact in the recipe's scale dtype
    if _native_quant.run_fused(fused, xp, op, sp, None, n, stream, (x, out, scale)):
        return None
    store = store_dtype(rec, dtype, qa.scale_dtype)
    return QuantResult(codes=out, scale=scale if store == "float32" else deliver(to_numpy(scale, "scale"), store, True),
                       format=fmt.name, granularity=qa.granularity, recipe=rec.name, args=qa, scale_dtype=store,
                       dtype=dtype, _recipe=rec)


@lru_cache(maxsize=256)
def _tensor_plan(args, recipe, role, dtype: str, shape: tuple, out_dtype: str) -> tuple | None:
    """What _quantize decides for a torch ``x`` of ``dtype`` and ``shape`` quantized into a torch
    ``out`` of ``out_dtype`` (names) with dynamic scales, where the fused loop does it all: (args,
    recipe, format, scale shape, fused_plan, stream); None where it does not, or where _quantize
    refuses the call (it then says why)."""
    try:
        qa = as_args(args, role=role)
        rec = get_recipe(recipe if recipe is not None else qa.recipe)
        fmt = get_format(qa.format)
        _check_recipe(rec, qa, fmt)
        if (isinstance(rec, BlockRecipe) or not qa.dynamic or qa.scale_dtype != "model"
                or qa.granularity not in ("channel", "group", "block")
                or out_dtype not in ("uint8", fmt.torch_dtype_name)):
            return None
        store_dtype(rec, dtype, qa.scale_dtype)  # a RecipeError where it has none
        sshape = layout(shape, qa.granularity, group_size=qa.group_size, block_shape=qa.block_shape)
        _check_divisible(rec, qa, shape)
        fused = _native_quant.fused_plan(dtype, qa, rec, fmt, shape, *_modes(dtype, qa, rec, fmt))
    except Fp8RefError:
        return None
    if fused is None:
        return None
    return qa, rec, fmt, sshape, fused, math.prod(shape) * 3 >= _arrays.STREAM_BYTES


def quantize_bits(bits: np.ndarray, dtype: str, args, *, recipe=None, scale=None, amax=None, role: str = "weight",
                  out=None) -> QuantResult:
    """``quantize`` of numpy values given with their dtype's name: for 'bfloat16', ``bits`` is the
    uint16 bit patterns and a bfloat16 ``scale`` comes back as uint16 bit patterns too (no ml_dtypes
    import, half a second of CPU: ``fp8ref verify`` reads the original's BF16 tensors so)."""
    return _quantize(bits_input(bits, dtype, "x"), args, recipe, scale, amax, role, out, scale_bits=True)


def _quantize(x_input, args, recipe, scale, amax, role, out, scale_bits: bool = False) -> QuantResult:
    qa = as_args(args, role=role)
    rec = get_recipe(recipe if recipe is not None else qa.recipe)
    arr, dtype, as_torch = x_input
    fmt = get_format(qa.format)
    _check_recipe(rec, qa, fmt)
    if scale is not None and amax is not None:
        raise InputTypeError("scale, amax: give one of them, not both")
    if not qa.dynamic and scale is None and amax is None:
        raise ScaleError("scale: static quantization (dynamic=False) needs a calibrated scale= or amax=")
    shape = tuple(arr.shape)
    if arr.size == 0:  # no amax to take a scale from: refused, not a numpy error from deep inside
        raise ShapeError(f"x: shape {shape} has no elements; there is nothing to quantize")
    if qa.granularity == "token" and arr.ndim == 2 and rec.token_2d == "tensor":
        qa = QuantArgs(**{**qa.__dict__, "granularity": "tensor"})
    sshape = layout(shape, qa.granularity, group_size=qa.group_size, block_shape=qa.block_shape)
    _check_divisible(rec, qa, shape)
    given_out = out is not None
    if given_out:
        if isinstance(rec, BlockRecipe) or qa.granularity in SELF_SCALED:
            raise InputTypeError(f"out: granularity {qa.granularity!r} returns packed or block-scaled codes; "
                                 f"out= takes the granularities {', '.join(_OUT_GRANULARITIES)}")
        out, flat = output_buffer(out, shape, as_torch, np.uint8, "quantize's codes", float8=fmt.torch_dtype_name)
        if np.may_share_memory(arr, flat):
            raise InputTypeError("out: overlaps x; quantize reads x while it writes the codes")
    if isinstance(rec, BlockRecipe):
        if (scale is not None or amax is not None) and qa.granularity != "nvfp4":
            raise InputTypeError(f"scale, amax: granularity {qa.granularity!r} computes its scales from x "
                                 f"(NVFP4 takes amax=, the tensor amax of the global scale (e.g. a fused "
                                 f"group's), or scale=, a stored global scale in the recipe's meaning)")
        if qa.granularity == "mx":
            res = microscaling.recipe_mx(arr, dtype, qa, rec, fmt)
        else:
            res = microscaling.recipe_nvfp4(arr, dtype, qa, rec, fmt, amax, scale)
    elif qa.granularity in SELF_SCALED:
        if scale is not None or amax is not None:
            raise InputTypeError(f"scale, amax: granularity {qa.granularity!r} computes its scales from x")
        own_rule = microscaling.quantize_mx if qa.granularity == "mx" else microscaling.quantize_nvfp4
        res = own_rule(arr, dtype, qa, rec, fmt)
    else:
        codes = flat.reshape(shape) if given_out else aligned_empty(shape, np.uint8)
        # the pass's traffic (x read, codes written) decides: a 4096x4096 weight's 16 MiB of codes
        # behind 32 MiB of input stay in no cache either (docs/quantize.md)
        res = _quantize_scaled(arr, dtype, qa, rec, fmt, shape, sshape, scale, amax, codes,
                               stream=given_out and arr.nbytes + codes.nbytes >= _arrays.STREAM_BYTES)
    return _wrap(res, as_torch, scale_bits, codes=out)


_OUT_GRANULARITIES = ("tensor", "channel", "token", "group", "block")


# granularities whose block scales quantize() computes from x itself: a caller passes no amax
# (NVFP4 block recipes alone take an optional tensor amax for the global scale)
SELF_SCALED = ("mx", "nvfp4")


def _check_recipe(rec: Recipe | BlockRecipe, qa: QuantArgs, fmt: FloatFormat) -> None:
    if qa.granularity not in rec.granularities:
        raise RecipeError(f"recipe {rec.name!r}: granularity {qa.granularity!r} is not one the producer "
                          f"implements (expected one of {', '.join(rec.granularities)})")
    if fmt.name not in rec.formats:
        raise RecipeError(f"recipe {rec.name!r}: format {fmt.name!r} is not one the producer writes "
                          f"(expected one of {', '.join(rec.formats)})")


def _check_divisible(rec: Recipe | BlockRecipe, qa: QuantArgs, shape: tuple) -> None:
    if isinstance(rec, BlockRecipe) or not rec.require_divisible or qa.granularity not in ("group", "block"):
        return
    if qa.granularity == "group":
        need, dims = (qa.group_size,), shape[-1:]
    else:
        need, dims = qa.block_shape, shape[-2:]
    if any(d % n for d, n in zip(dims, need, strict=False)):
        raise ShapeError(f"x: recipe {rec.name!r} requires the {qa.granularity} {tuple(need)} to divide the "
                         f"shape; got shape {shape}, expected the last dims to be multiples of {tuple(need)}")


# --- element scales (tensor, channel, token, group, block): the C loops (_native_quant), else numpy ---
def _chunks(n_rows: int, row_len: int, align: int = 1) -> list[tuple[int, int]]:
    step = max(align, (_ROWS_ELEMENTS // max(row_len, 1)) // align * align)
    return [(r, min(r + step, n_rows)) for r in range(0, n_rows, step)]


def _parallel(fn, spans) -> None:
    """Run fn over row spans; numpy and the codec release the GIL. Elementwise: the result
    does not depend on the number of threads."""
    workers = min(len(spans), os.cpu_count() or 1)
    if workers <= 1:
        for span in spans:
            fn(span)
        return
    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(fn, spans))


def _amax(arr: np.ndarray, dtype: str, qa: QuantArgs) -> np.ndarray:
    fast = _native_quant.c_amax(arr, dtype, qa)
    if fast is not None:
        return fast
    vals = reduction_values(arr, dtype)
    if qa.granularity not in ("tensor", "channel", "token") or arr.ndim == 0:
        return reduce_amax(vals if arr.ndim else vals.reshape(1), qa.granularity,
                           group_size=qa.group_size, block_shape=qa.block_shape)
    rows = as_rows(vals)
    gran = "channel" if qa.granularity != "tensor" else "tensor"
    parts = {}
    spans = _chunks(rows.shape[0], rows.shape[1])
    _parallel(lambda sp: parts.__setitem__(sp, reduce_amax(rows[sp[0]:sp[1]], gran)), spans)
    if gran == "tensor":
        return np.max(np.concatenate([parts[sp] for sp in spans])).reshape(1)  # NaN propagates
    return np.concatenate([parts[sp] for sp in spans]).reshape(arr.shape[:-1] + (1,))


def _modes(dtype: str, qa: QuantArgs, rec: Recipe, fmt: FloatFormat) -> tuple:
    """(rounding, saturate, cast16, neg0): the apply and encode steps' modes, as the recipe and args decide"""
    return (qa.rounding if rec.rounding == "from_args" else rec.rounding,
            qa.saturate if rec.saturate == "from_args" else rec.saturate,
            rec.apply_float16_to if dtype == "float16" else None,
            fmt.sign_mask if rec.negative_zero == "positive" and fmt.has_negative_zero else None)


def _quantize_scaled(arr, dtype, qa, rec, fmt, shape, sshape, scale, amax, codes, stream=False) -> dict:
    rounding, saturate, cast16, neg0 = _modes(dtype, qa, rec, fmt)
    store = store_dtype(rec, dtype, qa.scale_dtype)
    done, bound = False, None
    if scale is not None:
        given, given_dtype = scale_array(scale, "scale", sshape)
        check_scale(given)
        if rec.nonfinite == "error":  # the dynamic path finds NaN/Inf through amax
            reject_nonfinite(_amax(arr, dtype, QuantArgs()), arr, dtype, rec)
        stored = given.astype(np.float32)
        if not np.array_equal(stored.astype(np.float64), given):
            raise ScaleError("scale: expected values exactly representable in float32 (fp8ref scales are "
                             "float32); round the scale first")
        with np.errstate(over="ignore"):  # a subnormal scale's multiplier is +inf, as in float32
            operand = np.float32(1.0) / stored if rec.apply_op == "multiply_multiplier" else stored
        store = given_dtype if given_dtype in ("bfloat16", "float16") else "float32"  # as given
    else:
        # the fused loop's operand table holds the recipe's own scales (scale_dtype 'model')
        fusable = amax is None and qa.scale_dtype == "model"
        fused = _native_quant.c_quantize_fused(arr, dtype, qa, rec, fmt, shape, sshape, rounding, saturate, cast16,
                                               neg0, codes, stream) if fusable else None
        done = fused is not None and fused[0] is None  # every code final (c_quantize_fused)
        if done:
            stored, operand = fused[1], None
        else:
            a = (scale_array(amax, "amax", sshape)[0] if amax is not None else fused[0] if fused
                 else _amax(arr, dtype, qa))
            if amax is None:
                reject_nonfinite(a, arr, dtype, rec)
            elif rec.nonfinite == "error":
                ok = np.isfinite(a) & (a >= 0)
                if not ok.all():
                    raise ScaleError(f"amax: expected finite non-negative values, got {a[~ok][:3]}")
                reject_nonfinite(_amax(arr, dtype, QuantArgs()), arr, dtype, rec)  # x itself, as with scale=
            stored, operand = compute_scale(a, rec, fmt, dtype, scale_dtype=qa.scale_dtype)
            if amax is None and dtype == "bfloat16" and np.isfinite(top := np.max(a)):
                bound = int(np.float32(top).view(np.uint32)) >> 16  # the amax of bfloat16 inputs: one of them
    if not done and not _native_quant.c_quantize(arr, dtype, qa, rec, fmt, shape, sshape, operand, rounding,
                                                 saturate, cast16, neg0, codes, stream, bound):
        _numpy_apply(arr, dtype, qa, rec, fmt, shape, operand, rounding, saturate, cast16, neg0, codes)
    return dict(codes=codes, scale=stored.reshape(sshape), format=fmt.name, granularity=qa.granularity,
                recipe=rec.name, args=qa, scale_dtype=store, dtype=dtype, _recipe=rec)


def _numpy_apply(arr, dtype, qa, rec, fmt, shape, operand, rounding, saturate, cast16, neg0, codes) -> None:
    """The apply + encode steps in numpy, in row chunks on all cores, into ``codes``."""
    full = expand(operand, shape, qa.granularity, group_size=qa.group_size, block_shape=qa.block_shape)
    rows, out_rows = as_rows(arr), as_rows(codes)
    op_rows = _operand_rows(full, shape, qa.granularity)

    local = threading.local()

    def work(span):
        lo, hi = span
        shape2 = (hi - lo, rows.shape[1])
        if getattr(local, "shape", None) != shape2:  # per-thread buffers: no page faults per chunk
            wide = np.float64 if dtype == "float64" else np.float32
            local.shape, local.x, local.q = shape2, np.empty(shape2, np.float32), np.empty(shape2, wide)
        xw = widen(rows[lo:hi], dtype, cast16, local.x)
        s = op_rows if op_rows.shape[0] == 1 else op_rows[lo:hi]
        out = out_rows[lo:hi]
        if rec.apply_dtype == "exact":
            exact_quotient_codes(xw, s.astype(xw.dtype, copy=False), fmt, encode=encode, rounding=rounding,
                                 saturate=saturate, out=out, scratch=local.q)
        else:
            xw32 = xw.astype(np.float32) if xw.dtype != np.float32 else xw
            encode(apply_scaled(xw32, s, rec, fmt, "bfloat16" if cast16 else dtype), fmt,
                   rounding=rounding, saturate=saturate, out=out)
        if neg0 is not None:
            out[out == neg0] = 0

    _parallel(work, _chunks(rows.shape[0], rows.shape[1]))


def _operand_rows(full: np.ndarray, shape: tuple, granularity: str) -> np.ndarray:
    """The expanded operand as rows matching as_rows(x): (R, 1), (1, 1) or (R, K)."""
    full = np.asarray(full, np.float32)
    if granularity == "tensor":
        return full.reshape(1, 1)
    if granularity in ("channel", "token"):
        return full.reshape(-1, 1)
    return np.ascontiguousarray(np.broadcast_to(full, shape)).reshape(-1, shape[-1])


def _wrap(res: dict, as_torch: bool, scale_bits: bool = False, codes=None) -> QuantResult:
    """The result in the caller's library; ``codes``: the caller's out= (the codes are in it)."""
    res["codes"] = same_library(res["codes"], as_torch) if codes is None else codes
    half = res["scale_dtype"] in ("bfloat16", "float16")  # other scales are float32 values
    if scale_bits and res["scale_dtype"] == "bfloat16":
        res["scale"] = f32_to_bf16_bits(np.asarray(res["scale"]).astype(np.float32))  # deliver's bits
    elif half or as_torch:
        res["scale"] = deliver(res["scale"], res["scale_dtype"] if half else "float32", as_torch)
    for k in ("scale_codes", "global_scale"):
        if res.get(k) is not None:
            res[k] = same_library(res[k], as_torch)
    return QuantResult(**res)


# --- dequantize ---------------------------------------------------------------------------
_KINDS = {"float16": "float16", "bfloat16": "bfloat16", "float32": "float32", "float64": "float64"}


def dequantize(q: QuantResult, *, dtype: str | None = None):
    """decode(codes) * scale, the exact product rounded once to ``dtype``; for a recipe with
    ``dequantize.dtype: float32-product`` the float32 product rounded again to ``dtype`` (the
    producer's two roundings).

    Default dtype: the input's dtype for recipes that dequantize in the model dtype (``model``,
    ``float32-product``), else float32. (For the other built-in recipes the producer's own
    product is exact before its final rounding, so one rounding reproduces it.)
    """
    if not isinstance(q, QuantResult):
        raise InputTypeError(f"q: expected a QuantResult from quantize, got {type(q).__name__}")
    rule = None if q._recipe is None else q._recipe.dequantize_dtype
    if dtype is None:
        dtype = q.dtype if rule in ("model", "float32-product") else "float32"
    if dtype not in _KINDS:
        raise InputTypeError(f"dtype: expected one of {', '.join(_KINDS)}, got {dtype!r}")
    as_torch = is_torch(q.codes)
    codes = to_numpy(q.codes)
    vals = decode(codes, q.format).astype(np.float64)
    a = q.args
    s = expand(to_numpy(q.scale).astype(np.float64), codes.shape, q.granularity, group_size=a.group_size,
               block_shape=a.block_shape)
    g = None if q.global_scale is None else float(to_numpy(q.global_scale).reshape(-1)[0])
    if q.global_meaning == "divisor":
        if rule == "model":  # CT: D(fp32(q * fp32(s_b / g)))
            eff = (s.astype(np.float32) / np.float32(g)).astype(np.float32)
            out = round_to((vals.astype(np.float32) * eff).astype(np.float32), dtype)
        else:
            out = divide_round_once(vals * s, g, dtype)
        return deliver(out, dtype, as_torch)
    if g is not None:
        s = s * g  # fp32 x (E4M3 value): exact in float64
    with np.errstate(invalid="ignore", over="ignore"):
        p = vals * s  # exact in float64 (<= 4 + 24 significant bits; NVFP4: 4 + 4 + 24)
        if rule == "float32-product":  # ModelOpt's in-memory fp32(q) * fp32(1/m), then .to(D)
            p = p.astype(np.float32)
        out = round_to(p, dtype)
    return deliver(out, dtype, as_torch)


def requantize(codes, scale, args, *, recipe, via: tuple[str, ...] = ("float32",)) -> QuantResult:
    """Stored ``codes`` with their ``scale`` (``args``' format and granularity) dequantized as an engine
    does at load and quantized again by ``recipe``: the exact q * s rounded in turn to each dtype of
    ``via``, then ``quantize(recipe=recipe)`` on that tensor (its dtype the last of ``via``).

    vLLM's ``requant_weight_ue8m0_inplace``: ``w_q.to(float32) * s`` then ``per_block_cast_to_fp8`` =
    via ("float32",), recipe vllm-block-ue8m0. SGLang's ``requant_weight_ue8m0``: ``(q.float() *
    s).to(bfloat16)`` then DeepGEMM's ``per_block_cast_to_fp8`` = via ("float32", "bfloat16"), recipe
    deepgemm-ue8m0."""
    qa = as_args(args)
    codes = np.asarray(to_numpy(codes))
    if codes.dtype != np.uint8:
        raise InputTypeError(f"codes: expected uint8 codes, got {codes.dtype}")
    if not via or any(d not in ("float32", "bfloat16", "float16") for d in via):
        raise InputTypeError(f"via: expected float32, bfloat16 or float16 steps, got {via!r}")
    s = expand(np.asarray(to_numpy(scale), np.float64), codes.shape, qa.granularity, group_size=qa.group_size,
               block_shape=qa.block_shape)
    with np.errstate(invalid="ignore", over="ignore"):
        w = decode(codes, qa.format).astype(np.float64) * s  # exact: <= 4 + 24 significant bits
        for dtype in via:
            w = round_to(w, dtype)
    return quantize(deliver(w, via[-1], False), qa, recipe=recipe)


def divide_round_once(p: np.ndarray, g: float, dtype: str) -> np.ndarray:
    """p / g rounded once to ``dtype`` (p and g float64 values, g > 0 finite).

    The float64 quotient is rounded again to ``dtype``; that double rounding differs from the
    single one only where the float64 quotient is exactly a midpoint of ``dtype`` while the
    exact quotient is not. Those elements are moved one float64 ulp toward the exact quotient
    (sign of the exact residual p - q*g), which then rounds like it.
    """
    p = np.asarray(p, np.float64)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        q = p / np.float64(g)
    if dtype == "float64":
        return q
    tail = {"float32": 29, "bfloat16": 45, "float16": 42}[dtype]  # float64 bits below dtype's lsb
    bits = np.abs(q).view(np.uint64)
    mid = ((bits & np.uint64((1 << tail) - 1)) == np.uint64(1 << (tail - 1))) & np.isfinite(q)
    if mid.any():
        idx = np.nonzero(mid)
        sign = residual_sign(p[idx], q[idx], np.full(q[idx].shape, np.float64(g)))
        q = q.copy()
        q[idx] = np.where(sign == 0, q[idx], np.nextafter(q[idx], np.where(sign > 0, np.inf, -np.inf)))
    with np.errstate(invalid="ignore", over="ignore"):
        return round_to(q, dtype)


def fake_quant(x, args, *, recipe=None, scale=None, amax=None, role: str = "weight"):
    """quantize then dequantize, in x's dtype (the recipe's dtypes for every step)."""
    arr, dtype, _ = float_input(x, "x")
    q = quantize(x, args, recipe=recipe, scale=scale, amax=amax, role=role)
    return dequantize(q, dtype=dtype)


__all__ = ["QuantArgs", "QuantResult", "as_args", "dequantize", "fake_quant", "nvfp4_producer_global", "quantize"]
