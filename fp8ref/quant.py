"""quantize / dequantize / fake_quant on top of scaling + codec + recipes.

``quantize(x, args, *, recipe=None, scale=None, amax=None)`` takes a numpy array or a torch
CPU tensor (float16, bfloat16, float32, float64) and returns a frozen ``QuantResult`` whose
arrays are in the same library. Stored scales are dequantization multipliers
(``x ~ decode(codes) * scale``). Dynamic quantization computes the scale from ``x``; static
quantization takes a calibrated ``scale`` (or an ``amax``). See docs/quantize.md.
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import threading
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np

from . import _arrays, _native
from ._arrays import (
    aligned_empty,
    bf16_bits_to_f32,
    deliver,
    float_input,
    is_torch,
    numpy_bf16,
    output_buffer,
    same_library,
    to_numpy,
)
from .codec import ROUNDING_MODES, _c_encode_params, _c_rne_params, decode, encode
from .errors import EncodeError, InputTypeError, RecipeError, ScaleError, ShapeError
from .formats import FORMATS, FloatFormat, get_format
from .limits import MAX_DIM, int_in, shown
from .recipes import BlockRecipe, Recipe, apply_scaled, check_scale, compute_scale, exact_quotient_codes, store_dtype
from .registry import get_recipe
from .rounding import round_to
from .scaling import (
    GRANULARITIES,
    MX_SCALE_RULES,
    e8m0_value,
    expand,
    group_of,
    layout,
    magnitudes_to_f64,
    mx_scale_exponent,
    nvfp4_global_scale,
    reduce_amax,
)

_ROWS_ELEMENTS = 1 << 18  # elements per work chunk: temporaries stay in cache, memory O(chunk)
_NVFP4_SCALE_FORMAT = "float8_e4m3fn"


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


# --- input plumbing ----------------------------------------------------------------------
_KINDS = {"float16": "float16", "bfloat16": "bfloat16", "float32": "float32", "float64": "float64"}


def _widen(a: np.ndarray, dtype: str, cast16: str | None, buf: np.ndarray | None = None) -> np.ndarray:
    """Exact float32 values (float64 for float64) of a chunk; ``cast16`` rounds fp16 first.
    ``buf``: optional float32 buffer of a's shape for bfloat16/float16 input."""
    if dtype == "bfloat16":
        return bf16_bits_to_f32(a, buf)
    if dtype == "float16":
        w = a.astype(np.float32) if buf is None else np.copyto(buf, a) or buf
        return round_to(w, cast16) if cast16 else w
    return a


def _values(a: np.ndarray, dtype: str) -> np.ndarray:
    """Float values for reductions: bfloat16 bits viewed as ml_dtypes.bfloat16."""
    return numpy_bf16(a) if dtype == "bfloat16" else a


def _scale_array(value, what: str, expected: tuple) -> tuple[np.ndarray, str]:
    """A user scale/amax as float64 numpy of the layout shape (also [], [N] for [N,1]), and
    its dtype name."""
    arr, dtype, _ = float_input(value, what) if (is_torch(value) or isinstance(value, np.ndarray)) else (
        _python_numbers(value, what), "float64", False)
    if dtype == "bfloat16":
        arr = _widen(arr, dtype, None)
    arr = np.asarray(arr, np.float64)
    squeezed = tuple(n for n in arr.shape if n != 1)
    if arr.shape != expected and squeezed != tuple(n for n in expected if n != 1):
        raise ShapeError(f"{what}: expected shape {expected} (or the same without size-1 axes), "
                         f"got {tuple(arr.shape)}")
    return arr.reshape(expected), dtype


def _python_numbers(value, what: str) -> np.ndarray:
    """float64 array of a Python/numpy real number or a (nested) list of them; anything else (a
    string, a complex number, None) one InputTypeError."""
    try:
        arr = np.asarray(value)
    except ValueError:  # ragged nesting
        arr = np.asarray(None)
    if arr.dtype.kind not in "fiu":
        raise InputTypeError(f"{what}: expected a real number or an array of them, got {type(value).__name__}"
                             + (f" of {arr.dtype}" if arr.dtype.kind not in "OU" else ""))
    return arr.astype(np.float64)


def _one_number(value, what: str) -> np.float64:
    """The one number of a scalar, a one-element array/tensor or list (NVFP4's global scale or amax)."""
    arr = (to_numpy(value, what) if is_torch(value) or isinstance(value, (np.ndarray, np.generic))
           else _python_numbers(value, what))
    if arr.dtype.kind not in "fiu" or arr.size != 1:
        raise InputTypeError(f"{what}: expected one real number (the tensor's), got "
                             f"{arr.dtype} of shape {tuple(arr.shape)}")
    return np.float64(arr.reshape(-1)[0])


# --- public API ---------------------------------------------------------------------------
def as_args(args, *, role: str = "weight") -> QuantArgs:
    """QuantArgs, or a QuantizationScheme / mapping of its fields (``role``: weight|activation)."""
    if isinstance(args, QuantArgs):
        return args
    if not isinstance(args, Mapping):
        raise InputTypeError(f"args: expected QuantArgs or a QuantizationScheme, got {type(args).__name__}")
    if role not in ("weight", "activation"):
        raise InputTypeError(f"role: expected 'weight' or 'activation', got {role!r}")
    from .scheme import QuantizationScheme
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
    return QuantArgs(format=s["act_format"] if act else s["weight_format"], granularity=gran,
                     group_size=group if gran == "group" else None,
                     block_shape=None if act else s["block_shape"],
                     dynamic=bool(s["act_dynamic"]) if act else True,  # a weight's scale comes from W
                     rounding=s["rounding"], saturate=s["saturate"], recipe=s["recipe"],
                     scale_dtype=s["scale_dtype"] if family == "fp" else "model")  # MX/NVFP4: the format's


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
    qa = as_args(args, role=role)
    rec = get_recipe(recipe if recipe is not None else qa.recipe)
    arr, dtype, as_torch = float_input(x, "x")
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
            res = _block_mx(arr, dtype, qa, rec, fmt)
        else:
            res = _block_nvfp4(arr, dtype, qa, rec, fmt, amax, scale)
    elif qa.granularity in SELF_SCALED:
        if scale is not None or amax is not None:
            raise InputTypeError(f"scale, amax: granularity {qa.granularity!r} computes its scales from x")
        res = (_quantize_mx if qa.granularity == "mx" else _quantize_nvfp4)(arr, dtype, qa, rec, fmt)
    else:
        codes = flat.reshape(shape) if given_out else aligned_empty(shape, np.uint8)
        res = _quantize_scaled(arr, dtype, qa, rec, fmt, shape, sshape, scale, amax, codes,
                               stream=given_out and codes.nbytes >= _arrays.STREAM_BYTES)
    res = _wrap(res, as_torch)
    return dataclasses.replace(res, codes=out) if given_out else res


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


def _reject_nonfinite(amax: np.ndarray, arr: np.ndarray, dtype: str, rec: Recipe) -> None:
    if rec.nonfinite != "error" or np.isfinite(amax).all():
        return
    bad = ~np.isfinite(_widen(arr, dtype, None))
    idx = tuple(int(i) for i in np.argwhere(bad)[0])
    raise EncodeError(f"x: recipe {rec.name!r} needs finite values, got {int(bad.sum())} NaN/Inf "
                     f"(first at index {idx}); pass recipe= a producer recipe to model its NaN/Inf behaviour")


def _rows(arr: np.ndarray) -> np.ndarray:
    return arr.reshape(-1, arr.shape[-1]) if arr.ndim else arr.reshape(1, 1)


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
    fast = _c_amax(arr, dtype, qa)
    if fast is not None:
        return fast
    vals = _values(arr, dtype)
    if qa.granularity not in ("tensor", "channel", "token") or arr.ndim == 0:
        return reduce_amax(vals if arr.ndim else vals.reshape(1), qa.granularity,
                           group_size=qa.group_size, block_shape=qa.block_shape)
    rows = _rows(vals)
    gran = "channel" if qa.granularity != "tensor" else "tensor"
    parts = {}
    spans = _chunks(rows.shape[0], rows.shape[1])
    _parallel(lambda sp: parts.__setitem__(sp, reduce_amax(rows[sp[0]:sp[1]], gran)), spans)
    if gran == "tensor":
        return np.max(np.concatenate([parts[sp] for sp in spans])).reshape(1)  # NaN propagates
    return np.concatenate([parts[sp] for sp in spans]).reshape(arr.shape[:-1] + (1,))


# --- fused C loops (fp8ref/_csrc/quant.c); the numpy code above and below is the fallback ----
_C_KINDS = {"bfloat16": 0, "float16": 1, "float32": 2}
_C_MODEL = {"bfloat16": 1, "float16": 2, "float32": 0}


def _c_ok(arr: np.ndarray, dtype: str, granularity: str) -> bool:
    return (dtype in _C_KINDS and arr.ndim >= 1 and arr.size > 0
            and granularity in ("tensor", "channel", "token", "group", "block") and _native.kernels() is not None)


def _c_sizes(**sizes: int) -> None:
    """The C boundary: the loops take row counts, row lengths and group lengths as int64/size_t, and
    divide by the group length. Validation keeps them in range; this guards what reaches C anyway."""
    for name, value in sizes.items():
        if not int_in(int(value), 1, MAX_DIM):
            raise ShapeError(f"{name}: {shown(value)} is outside 1..{MAX_DIM}, which the C loops take")


def _c_amax(arr: np.ndarray, dtype: str, qa: QuantArgs) -> np.ndarray | None:
    """reduce_amax by the C loop: magnitude bits per (row, group of g along K), reduced further
    here for tensor and block; None where the loop does not apply."""
    gran = qa.granularity
    if not _c_ok(arr, dtype, gran) or (gran == "block" and arr.ndim < 2):
        return None
    rows = _rows(arr)
    n_rows, k = rows.shape
    g = qa.group_size if gran == "group" else qa.block_shape[1] if gran == "block" else k
    _c_sizes(rows=n_rows, row_length=k, group_size=g)
    ng = -(-k // g)
    wide = dtype == "float32"
    bits = rows.view(np.uint32 if wide else np.uint16)
    part = np.empty((n_rows, ng), bits.dtype)
    _native.parallel("fp8ref_amax_u32" if wide else "fp8ref_amax_u16",
                     _native.amax_job(bits.ctypes.data, part.ctypes.data, k, g), n_rows, work=bits.size,
                     keep=(bits, part))
    if gran == "tensor":
        part = part.max(keepdims=True).reshape(1)
    elif gran == "block":
        bh, r2 = qa.block_shape[0], arr.shape[-2]
        p = part.reshape(arr.shape[:-2] + (r2, ng))
        p = np.pad(p, [(0, 0)] * (p.ndim - 2) + [(0, -r2 % bh), (0, 0)])  # +0: neutral for the max
        part = p.reshape(p.shape[:-2] + (p.shape[-2] // bh, bh, ng)).max(axis=-2)
    else:
        part = part.reshape(arr.shape[:-1] + (ng,))
    return magnitudes_to_f64(part, np.dtype(np.float32) if wide else _values(arr[:0], dtype).dtype)


def _operand_offsets(shape: tuple, qa: QuantArgs, sshape: tuple) -> tuple[np.ndarray, int]:
    """(per-row index of the row's first operand in the flattened scale array, elements per operand
    along the row) for the C loops."""
    n_rows, k = int(np.prod(shape[:-1], dtype=np.int64)), shape[-1]
    r = np.arange(n_rows, dtype=np.int64)
    if qa.granularity == "tensor":
        return np.zeros(n_rows, np.int64), k
    if qa.granularity in ("channel", "token"):
        return r, k
    if qa.granularity == "group":
        return r * sshape[-1], qa.group_size
    (bh, bw), r2 = qa.block_shape, shape[-2]
    return ((r // r2) * sshape[-2] + (r % r2) // bh) * sshape[-1], bw


def _c_job(arr, dtype, qa, rec, fmt, shape, rounding, saturate, cast16, neg0, codes, stream=False):
    """The C loops' job for the apply + encode steps (operands still to fill), or None where they
    do not apply (the numpy path then runs). Same roundings, in the same order, as
    exact_quotient_codes / apply_scaled. ``stream``: write the codes around the cache."""
    if not _c_ok(arr, dtype, qa.granularity) or (qa.granularity == "block" and arr.ndim < 2):
        return None
    params = _c_encode_params(fmt, saturate, rounding)
    exact = rec.apply_dtype == "exact"
    if params is None or not (rounding == "rne" or exact) or (exact and rec.nonfinite != "error"):
        return None  # the exact loop needs finite x: the recipe rejects NaN/Inf
    model_dtype = "bfloat16" if cast16 else dtype
    rne = _c_rne_params(fmt, saturate) if rounding == "rne" else None
    job = _native.quant_job(arr.ctypes.data, codes.ctypes.data, None, None, None, None, ctypes.addressof(params),
                            None if rne is None else ctypes.addressof(rne), shape[-1], shape[-1], 0, 1,
                            _C_KINDS[dtype], int(exact), int(rec.apply_op != "divide"),
                            _C_MODEL[model_dtype] if rec.apply_dtype == "model" else 0, int(cast16 is not None),
                            0.0 if rec.add_zero else -0.0, fmt.max if rec.clamp else np.inf,
                            0x100 if neg0 is None else neg0, int(stream))
    job._keep = params, rne  # the job points into them
    return job


def _c_operands(operand: np.ndarray, rec: Recipe) -> tuple[np.ndarray, np.ndarray]:
    """(float32 operands as the C loops take them, usable mask): the exact loop needs positive finite
    scales, the producer loops multiply by fp32(1/s) for multiply_reciprocal."""
    ops = np.ascontiguousarray(operand, np.float32).reshape(-1)
    if rec.apply_dtype == "exact":
        return ops, np.isfinite(ops) & (ops > 0)
    if rec.apply_op == "multiply_reciprocal":
        with np.errstate(divide="ignore", over="ignore"):
            ops = np.float32(1.0) / ops
    return ops, np.ones(ops.shape, bool)


def _c_quantize(arr, dtype, qa, rec, fmt, shape, sshape, operand, rounding, saturate, cast16, neg0,
                codes, stream=False) -> bool:
    """The C loop for the apply + encode steps with known operands; False where it does not apply."""
    job = _c_job(arr, dtype, qa, rec, fmt, shape, rounding, saturate, cast16, neg0, codes, stream)
    if job is None:
        return False
    ops, usable = _c_operands(operand, rec)
    if not usable.all():
        return False
    s_off, g = _operand_offsets(shape, qa, sshape)
    _c_sizes(rows=len(s_off), row_length=shape[-1], group_size=g)
    job.g = g
    job.s, job.s_off = ops.ctypes.data, s_off.ctypes.data
    _native.parallel("fp8ref_quant", job, len(s_off), work=arr.size, keep=(arr, codes, ops, s_off))
    return True


@lru_cache(maxsize=64)
def _operand_table(rec: Recipe, fmt: FloatFormat, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """compute_scale's operand for every 15-bit magnitude of a 16-bit dtype, as _c_operands gives
    it (compute_scale is elementwise: looking an amax up here is computing it)."""
    mags = np.arange(1 << 15, dtype=np.uint16)
    vdtype = _values(mags[:0], dtype).dtype if dtype == "bfloat16" else np.dtype(dtype)
    with np.errstate(invalid="ignore"):  # signalling NaN patterns widen to quiet NaN
        amax = magnitudes_to_f64(mags, vdtype)
    ops, usable = _c_operands(compute_scale(amax, rec, fmt, dtype)[1], rec)
    ops.setflags(write=False)
    return ops, usable


def _c_quantize_fused(arr, dtype, qa, rec, fmt, shape, sshape, rounding, saturate, cast16, neg0,
                      codes, stream=False) -> tuple[np.ndarray, bool] | None:
    """Dynamic scales of 16-bit input in one pass (amax, operand, codes per cache-sized tile): the
    amax (float64, of sshape) and whether the codes are final (False: an operand the loop cannot
    take, such as an all-zero row's, was used; the caller quantizes again). None: not applicable."""
    if dtype not in ("bfloat16", "float16") or qa.granularity == "tensor":
        return None
    job = _c_job(arr, dtype, qa, rec, fmt, shape, rounding, saturate, cast16, neg0, codes, stream)
    if job is None:
        return None
    table, usable = _operand_table(rec, fmt, dtype)
    _c_sizes(row_length=shape[-1], **({"block_rows": qa.block_shape[0], "group_size": qa.block_shape[1]}
                                      if qa.granularity == "block" else {"group_size": qa.group_size or shape[-1]}))
    if qa.granularity == "block":
        (job.bh, job.g), job.r2 = qa.block_shape, shape[-2]
    else:
        job.g = qa.group_size if qa.granularity == "group" else shape[-1]
        job.r2 = max(1, int(np.prod(shape[:-1], dtype=np.int64)))
    n_rows = int(np.prod(shape[:-1], dtype=np.int64))
    bands = n_rows // job.r2 * -(-job.r2 // job.bh)
    bits = np.empty(bands * -(-shape[-1] // job.g), np.uint16)
    job.table, job.amax = table.ctypes.data, bits.ctypes.data
    _native.parallel("fp8ref_quant_fused", job, bands, work=arr.size, keep=(arr, codes, table, bits))
    amax = magnitudes_to_f64(bits, _values(arr[:0], dtype).dtype).reshape(sshape)
    return amax, bool(usable[bits].all())


def _quantize_scaled(arr, dtype, qa, rec, fmt, shape, sshape, scale, amax, codes, stream=False) -> dict:
    cast16 = rec.apply_float16_to if dtype == "float16" else None
    store = store_dtype(rec, dtype, qa.scale_dtype)
    rounding = qa.rounding if rec.rounding == "from_args" else rec.rounding
    saturate = qa.saturate if rec.saturate == "from_args" else rec.saturate
    neg0 = fmt.sign_mask if rec.negative_zero == "positive" and fmt.has_negative_zero else None
    done = False
    if scale is not None:
        given, given_dtype = _scale_array(scale, "scale", sshape)
        check_scale(given)
        if rec.nonfinite == "error":  # the dynamic path finds NaN/Inf through amax
            _reject_nonfinite(_amax(arr, dtype, QuantArgs()), arr, dtype, rec)
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
        fused = _c_quantize_fused(arr, dtype, qa, rec, fmt, shape, sshape, rounding, saturate, cast16, neg0,
                                  codes, stream) if fusable else None
        done = fused is not None and fused[1]
        a = _scale_array(amax, "amax", sshape)[0] if amax is not None else fused[0] if fused else _amax(arr, dtype, qa)
        if amax is None:
            _reject_nonfinite(a, arr, dtype, rec)
        elif rec.nonfinite == "error":
            ok = np.isfinite(a) & (a >= 0)
            if not ok.all():
                raise ScaleError(f"amax: expected finite non-negative values, got {a[~ok][:3]}")
            _reject_nonfinite(_amax(arr, dtype, QuantArgs()), arr, dtype, rec)  # x itself, as with scale=
        stored, operand = compute_scale(a, rec, fmt, dtype, scale_dtype=qa.scale_dtype)
    if not done and not _c_quantize(arr, dtype, qa, rec, fmt, shape, sshape, operand, rounding, saturate, cast16, neg0,
                                    codes, stream):
        _numpy_apply(arr, dtype, qa, rec, fmt, shape, operand, rounding, saturate, cast16, neg0, codes)
    return dict(codes=codes, scale=stored.reshape(sshape), format=fmt.name, granularity=qa.granularity,
                recipe=rec.name, args=qa, scale_dtype=store, dtype=dtype, _recipe=rec)


def _numpy_apply(arr, dtype, qa, rec, fmt, shape, operand, rounding, saturate, cast16, neg0, codes) -> None:
    """The apply + encode steps in numpy, in row chunks on all cores, into ``codes``."""
    full = expand(operand, shape, qa.granularity, group_size=qa.group_size, block_shape=qa.block_shape)
    rows, out_rows = _rows(arr), _rows(codes)
    op_rows = _operand_rows(full, shape, qa.granularity)

    local = threading.local()

    def work(span):
        lo, hi = span
        shape2 = (hi - lo, rows.shape[1])
        if getattr(local, "shape", None) != shape2:  # per-thread buffers: no page faults per chunk
            wide = np.float64 if dtype == "float64" else np.float32
            local.shape, local.x, local.q = shape2, np.empty(shape2, np.float32), np.empty(shape2, wide)
        xw = _widen(rows[lo:hi], dtype, cast16, local.x)
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
    """The expanded operand as rows matching _rows(x): (R, 1), (1, 1) or (R, K)."""
    full = np.asarray(full, np.float32)
    if granularity == "tensor":
        return full.reshape(1, 1)
    if granularity in ("channel", "token"):
        return full.reshape(-1, 1)
    return np.ascontiguousarray(np.broadcast_to(full, shape)).reshape(-1, shape[-1])


def _exact_values(arr: np.ndarray, dtype: str) -> np.ndarray:
    return _widen(arr, dtype, None).astype(np.float64)


def _quantize_mx(arr, dtype, qa, rec, fmt) -> dict:
    x = _exact_values(arr, dtype)
    amax = reduce_amax(x, "mx")
    _reject_nonfinite(amax, arr, dtype, rec)
    e = mx_scale_exponent(amax, fmt, qa.mx_rule)
    factor = np.ldexp(1.0, -expand(e, x.shape, "mx"))  # x * 2**-e is exact in float64
    codes = encode(x * factor, fmt, rounding=qa.rounding, saturate=True)
    return dict(codes=codes, scale=e8m0_value(e), format=fmt.name, granularity="mx", recipe=rec.name,
                args=qa, scale_dtype="float8_e8m0fnu", dtype=dtype,
                scale_codes=(e + 127).astype(np.uint8), _recipe=rec)


def _quantize_nvfp4(arr, dtype, qa, rec, fmt) -> dict:
    sfmt = FORMATS[_NVFP4_SCALE_FORMAT]
    x = _exact_values(arr, dtype)
    amax_b = reduce_amax(x, "nvfp4")
    _reject_nonfinite(amax_b, arr, dtype, rec)
    s_glob = nvfp4_global_scale(float(amax_b.max(initial=0.0)), fmt, sfmt)
    # block scale = round_e4m3(amax_b / (max_elem * s_glob)): divisor exact in float64 (26 bits)
    scale_codes = np.empty(amax_b.shape, np.uint8)
    exact_quotient_codes(amax_b, np.float64(fmt.max) * np.float64(s_glob), sfmt, encode=encode,
                         rounding="rne", saturate=True, out=scale_codes)
    s_blk = decode(scale_codes, sfmt)
    # element divisor s_blk * s_glob is exact in float64 (4 + 24 bits); a zero block scale
    # (amax_b below half the smallest E4M3 step) maps its elements to signed zero via 1/inf.
    div = s_blk.astype(np.float64) * np.float64(s_glob)
    div = expand(np.where(div == 0, np.inf, div), x.shape, "nvfp4")
    codes = np.empty(x.shape, np.uint8)
    exact_quotient_codes(x, div, fmt, encode=encode, rounding=qa.rounding, saturate=True, out=codes)
    return dict(codes=codes, scale=s_blk, format=fmt.name, granularity="nvfp4", recipe=rec.name, args=qa,
                scale_dtype=_NVFP4_SCALE_FORMAT, dtype=dtype, scale_codes=scale_codes,
                global_scale=np.array([s_glob], np.float32), _recipe=rec)


# --- producer block recipes (BlockRecipe): the tools' own D/fp32 arithmetic, step by step ----------
def _f32(v) -> np.ndarray:
    return np.asarray(v, np.float32)


def _block_mx(arr, dtype, qa, rec: BlockRecipe, fmt) -> dict:
    """MX with a producer's E8M0 rule: codes = enc(clamp(R(x * 2**-k) [+ 0])), R = rec.apply_dtype."""
    x = _exact_values(arr, dtype)
    amax = reduce_amax(x, "mx")
    _reject_nonfinite(amax, arr, dtype, rec)
    e = mx_scale_exponent(amax, fmt, rec.mx_rule)
    e = np.where(amax == 0, rec.mx_zero_code - 127, e)
    y = x * np.ldexp(1.0, -expand(e, x.shape, "mx"))  # exact in float64 (a power of two)
    y = round_to(y, dtype if rec.apply_dtype == "model" else "float32")
    codes = _block_encode(y, rec, fmt)
    return dict(codes=codes, scale=e8m0_value(e), format=fmt.name, granularity="mx", recipe=rec.name,
                args=qa, scale_dtype="float8_e8m0fnu", dtype=dtype, scale_codes=(e + 127).astype(np.uint8),
                _recipe=rec)


def _block_encode(y32: np.ndarray, rec: BlockRecipe, fmt) -> np.ndarray:
    y = _f32(y32)
    with np.errstate(invalid="ignore"):
        if rec.add_zero:
            y = y + np.float32(0.0)  # -0.0 + 0.0 = +0.0
        y = np.clip(y, -fmt.max, fmt.max).astype(np.float32)
    codes = encode(y, fmt, rounding="rne", saturate=True)
    if rec.encode_ties == "toward-zero":  # a halfway y keeps the truncated (smaller) neighbour
        down = encode(y, fmt, rounding="rtz", saturate=True)
        y64 = y.astype(np.float64)
        with np.errstate(invalid="ignore"):
            tie = np.abs(y64 - decode(down, fmt)) == np.abs(decode(codes, fmt) - y64)
        codes = np.where(tie, down, codes).astype(np.uint8)
    if rec.negative_zero == "positive" and fmt.has_negative_zero:
        codes[codes == fmt.sign_mask] = 0
    return codes


def nvfp4_producer_global(amax: float, rec: BlockRecipe, dtype: str) -> np.float32:
    """The NVFP4 global scale ``rec`` stores for tensor amax A (a D value) of a ``dtype`` model:
    divisor fp32(R(2688 / max(A, tiny(D)))) with R = D or fp32 (NaN/Inf/0 -> 1, compressed-tensors'
    nan_to_num); with ``global.rule: reciprocal`` fp32(R(fp32(R(1 / max(A, tiny))) * 2688)), as torch
    computes ``2688.0 / t`` (``t.reciprocal() * 2688``, compressed-tensors' generate_gparam; an
    infinite A stores 0, as the tool does); or
    multiplier fp32(A) / 2688 in float32 (ModelOpt)."""
    top = np.float32(FORMATS["float4_e2m1fn"].max * FORMATS[_NVFP4_SCALE_FORMAT].max)  # 2688
    a32 = np.float32(amax)  # exact: a D value
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        if rec.global_meaning == "multiplier":
            return np.float32(a32 / top)
        if rec.global_rule == "fp32-max":  # TE compute_global_encode_scaling_factor_FP4
            g = np.float32(top / a32)
            g = np.finfo(np.float32).max if not np.isfinite(g) else g  # fminf: inf and NaN -> FLT_MAX
            return np.float32(1.0) if a32 == 0 or g == 0 else np.float32(g)
        tiny = np.float32({"float32": np.finfo(np.float32).tiny, "bfloat16": 2.0 ** -126,
                           "float16": 2.0 ** -14}.get(dtype, np.finfo(np.float32).tiny))
        r_dtype = dtype if rec.global_dtype == "model" else "float32"
        if rec.global_rule == "reciprocal":  # each D op computes in float32 and rounds to D
            inv = np.float32(round_to(np.float32(np.float32(1.0) / max(a32, tiny)), r_dtype))
            g = np.float32(round_to(np.float32(inv * top), r_dtype))
            return g if np.isfinite(g) else np.float32(1.0)  # nan_to_num only: A = inf stores 2688/inf = 0
        else:
            g = np.float32(round_to(np.float32(top / max(a32, tiny)), r_dtype))
    return g if np.isfinite(g) and g != 0 else np.float32(1.0)


def _block_nvfp4(arr, dtype, qa, rec: BlockRecipe, fmt, amax, given) -> dict:
    """NVFP4 with a producer's global/block scale steps (BlockRecipe docstring); ``amax`` overrides
    the tensor amax A (a fused group's max); ``given`` is a stored global scale (static, e.g. a
    calibrated input global scale). The global scale returned is what the producer writes: the
    divisor g or the multiplier, per ``global_meaning``."""
    sfmt = FORMATS[_NVFP4_SCALE_FORMAT]
    x32 = _f32(_exact_values(arr, dtype))
    amax_b = reduce_amax(_exact_values(arr, dtype), "nvfp4")
    _reject_nonfinite(amax_b, arr, dtype, rec)
    if rec.tile_rows > 1:  # one scale per tile_rows x 16 tile, written to each of its rows' 1x16 blocks
        if arr.ndim < 2:
            raise ShapeError(f"x: recipe {rec.name!r} scales {rec.tile_rows}x16 tiles and needs a 2-D weight, "
                             f"got shape {tuple(arr.shape)}")
        tiles = reduce_amax(_exact_values(arr, dtype), "block", block_shape=(rec.tile_rows, 16))
        amax_b = np.repeat(tiles, rec.tile_rows, axis=-2)[..., :arr.shape[-2], :]
    if amax is not None and given is not None:
        raise InputTypeError("scale, amax: give one of them, not both")
    if given is not None:
        g = np.float32(_one_number(given, "scale"))
        check_scale(np.array([g]), "scale")
    else:
        a = amax_b.max(initial=0.0) if amax is None else _one_number(amax, "amax")
        g = nvfp4_producer_global(a, rec, dtype)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        ab = _f32(amax_b)  # block amax values are D values: exact in fp32
        if rec.block_form == "global*D(amax/max_elem)":
            sb = _f32(g) * _f32(round_to(ab / np.float32(fmt.max), dtype))
        elif rec.block_form == "amax*fp32(global*fp32(1/max_elem))":  # TE: the 1/6 folded into the multiplier
            sb = _f32(ab * _f32(_f32(g) * _f32(np.float32(1.0) / np.float32(fmt.max))))
            sb = np.minimum(sb, np.finfo(np.float32).max)
        else:
            sb = ab / _f32(np.float32(fmt.max) * g)
        if rec.block_zero_amax is not None:
            sb = np.where(sb == 0, np.float32(rec.block_zero_amax), sb)
        if rec.block_min is not None:
            sb = np.maximum(sb, np.float32(rec.block_min))
        sb = np.clip(_f32(sb), -sfmt.max, sfmt.max).astype(np.float32)
    scale_codes = encode(sb, sfmt, rounding="rne", saturate=True)
    s_blk = decode(scale_codes, sfmt)
    if rec.block_zero_stored is not None:
        zero = s_blk == 0
        scale_codes = np.where(zero, encode(np.float32(rec.block_zero_stored), sfmt), scale_codes).astype(np.uint8)
        s_blk = decode(scale_codes, sfmt)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        if rec.apply_op == "multiply_reciprocal":  # TE: x * fminf(1 / (s_b * fp32(1/g)), FLT_MAX)
            m = _f32(np.float32(1.0) / _f32(s_blk * (np.float32(1.0) / _f32(g))))
            m = np.minimum(m, np.finfo(np.float32).max).astype(np.float32)
            y = _f32(x32 * expand(m, x32.shape, "nvfp4").astype(np.float32))
        else:
            eff = _f32(s_blk / g) if rec.global_meaning == "divisor" else _f32(s_blk * g)  # fp32, rounded once
            y = x32 / expand(eff, x32.shape, "nvfp4").astype(np.float32)
    codes = _block_encode(y, rec, fmt)
    return dict(codes=codes, scale=s_blk, format=fmt.name, granularity="nvfp4", recipe=rec.name, args=qa,
                scale_dtype=_NVFP4_SCALE_FORMAT, dtype=dtype, scale_codes=scale_codes,
                global_scale=np.array([g], np.float32), global_meaning=rec.global_meaning, _recipe=rec)


def _wrap(res: dict, as_torch: bool) -> QuantResult:
    res["codes"] = same_library(res["codes"], as_torch)
    half = res["scale_dtype"] in ("bfloat16", "float16")  # other scales are float32 values
    if half or as_torch:
        res["scale"] = deliver(res["scale"], res["scale_dtype"] if half else "float32", as_torch)
    for k in ("scale_codes", "global_scale"):
        if res.get(k) is not None:
            res[k] = same_library(res[k], as_torch)
    return QuantResult(**res)


# --- dequantize ---------------------------------------------------------------------------
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


def divide_round_once(p: np.ndarray, g: float, dtype: str) -> np.ndarray:
    """p / g rounded once to ``dtype`` (p and g float64 values, g > 0 finite).

    The float64 quotient is rounded again to ``dtype``; that double rounding differs from the
    single one only where the float64 quotient is exactly a midpoint of ``dtype`` while the
    exact quotient is not. Those elements are moved one float64 ulp toward the exact quotient
    (sign of the exact residual p - q*g), which then rounds like it.
    """
    from .exact import residual_sign

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


__all__ = ["QuantArgs", "QuantResult", "as_args", "dequantize", "fake_quant", "quantize"]
