"""scaled_mm and linear: the public entry points (records in, checks, model, epilogue, delivery)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from .._arrays import (
    check_torch,
    code_input,
    deliver,
    dtype_name,
    float64_values,
    is_torch,
    numpy_bf16,
    same_library,
    torch,
)
from ..codec import encode
from ..errors import FormatError, InputTypeError, ShapeError
from ..formats import FORMATS, get_format
from ..quant import QuantArgs, quantize
from ..recipes import Recipe, model_dtype_free
from ..registry import get_recipe
from ..rounding import OUT_FORMATS, OutFormat, round_to_format
from .epilogue import SCALE_RESULT_OPS, _code_out
from .models import ACCUMULATION_MODELS, Accumulation
from .operands import DecodedCodes, _canonical_scales, _operand, _scale, _shape_text


@dataclass(frozen=True)
class Output:
    """What scaled_mm returns: ``dtype`` (float32, bfloat16, float16, or an FP8/FP6/FP4 format
    whose codes are returned) and, for code outputs, the encode options and the result scale."""

    dtype: object = "float32"
    saturate: bool = True
    rounding: str = "rne"
    scale_result: object = None
    scale_result_op: str = "divide"


_ACC_DEFAULTS = {"scale_order": "epilogue", "promote_every": 128, "mantissa_bits": 13}
_OUT_DEFAULTS = {"out_dtype": "float32", "saturate": True, "rounding": "rne", "scale_result": None,
                 "scale_result_op": "divide"}


def _given(options: dict, defaults: dict) -> list[str]:
    return [k for k, v in options.items() if v is not defaults[k] and v != defaults[k]]


def _accumulation(accumulate, block_k, options: dict) -> Accumulation:
    if isinstance(accumulate, Accumulation):
        extra = _given(options, _ACC_DEFAULTS)
        if extra:
            raise InputTypeError(f"{extra[0]}: give it in the Accumulation record, not also as a keyword")
        return accumulate
    if not isinstance(accumulate, str) or accumulate not in ACCUMULATION_MODELS:
        raise InputTypeError(f"accumulate: expected one of {', '.join(ACCUMULATION_MODELS)}, got {accumulate!r}")
    return Accumulation(accumulate, block_k, **options)


def _output(output, options: dict) -> Output:
    if output is None:
        return Output(options["out_dtype"], options["saturate"], options["rounding"], options["scale_result"],
                      options["scale_result_op"])
    if not isinstance(output, Output):
        raise InputTypeError(f"output: expected an Output record, got {type(output).__name__}")
    extra = _given(options, _OUT_DEFAULTS)
    if extra:
        raise InputTypeError(f"{extra[0]}: give it in the Output record, not also as a keyword")
    return output


def _out_format(out_dtype) -> OutFormat:
    """A name, a torch dtype, a numpy dtype or scalar type -> OutFormat."""
    if isinstance(out_dtype, type) and issubclass(out_dtype, np.generic) or isinstance(out_dtype, np.dtype):
        name = np.dtype(out_dtype).name
    else:
        name = str(out_dtype).removeprefix("torch.")
    if name not in OUT_FORMATS:
        raise InputTypeError(f"out_dtype: expected one of {', '.join(OUT_FORMATS)}, got {out_dtype!r}")
    return OUT_FORMATS[name]


def scaled_mm(a, b, scale_a, scale_b, *, bias=None, out_dtype="float32", accumulate="exact",
              fmt_a=None, fmt_b=None, block_k: int | None = None, block_n: int = 128,
              scale_order: str = "epilogue", promote_every: int = 128, mantissa_bits: int = 13,
              scale_result=None, scale_result_op: str = "divide", saturate: bool = True, rounding: str = "rne",
              output: Output | None = None):
    """``out = round(sum_k a[m,k] * b[k,n] * scale + bias[n])`` with ``torch._scaled_mm``'s operands.

    a: (M, K), b: (K, N): uint8 codes in ``fmt_a``/``fmt_b`` (default float8_e4m3fn) or torch float8
    tensors (format from the dtype). scale_a / scale_b: float32 dequantization multipliers per tensor,
    per row (M, 1) / per column (1, N), or per block: (M, ceil(K/block_k)) and
    (ceil(K/block_k), ceil(N/block_n)) (block_k defaults to 128). bias: (N,) float32/bfloat16/float16.
    out_dtype: float32, bfloat16 or float16. Output is torch when ``a`` is a torch tensor, else numpy.
    out_dtype may also name a signed format of fp8ref.formats with subnormals (float8_e4m3fn,
    float8_e5m2, the fnuz formats, float6_*, float4_e2m1fn; or a torch float8 dtype): the result is
    then uint8 codes (numpy, or a torch.uint8 tensor for torch input; ``codec.view_as_float8`` views
    it as torch float8), ``encode(v, fmt, saturate=saturate, rounding=rounding)`` with
    v = result / scale_result (``scale_result_op="divide"``, torch's CPU rule) or result * scale_result
    ("multiply", cuBLASLt's); scale_result is a positive finite float32 scalar (None: 1). In "exact"
    mode v is the exact value, rounded once; in the fp32 modes v = fp32(acc op scale_result).

    accumulate: "exact" (exact sum, one rounding), "fp32" (declared sequential order; ``block_k``
    also sets the K-blocks whose scaled sums are added to the fp32 total; ``scale_order`` "epilogue"
    scales each block sum, "operands" scales a and b first as torch's CPU path does), or
    "fp32-limited" (``mantissa_bits`` fraction bits, truncated after each addition, promoted to
    fp32 every ``promote_every`` elements); or any registered model (``register_accumulation``).
    docs/matmul.md defines each order exactly. The options may come as records instead:
    ``accumulate=Accumulation(...)`` and ``output=Output(...)`` (then leave those keywords alone).
    """
    acc = _accumulation(accumulate, block_k, {"scale_order": scale_order, "promote_every": promote_every,
                                              "mantissa_bits": mantissa_bits})
    if type(block_n) is not int or block_n < 1:
        raise InputTypeError(f"block_n: expected an int >= 1, got {block_n!r}")
    if block_k is not None and (type(block_k) is not int or block_k < 1):
        raise InputTypeError(f"block_k: expected an int >= 1, got {block_k!r}")
    res = _output(output, {"out_dtype": out_dtype, "saturate": saturate, "rounding": rounding,
                           "scale_result": scale_result, "scale_result_op": scale_result_op})
    code = _code_out(res.dtype, res.saturate, res.rounding, res.scale_result, res.scale_result_op)
    if code is None:
        # torch's CPU _scaled_mm silently ignores scale_result for float outputs: refuse instead
        for name, v, default in (("scale_result", res.scale_result, None), ("saturate", res.saturate, True),
                                 ("rounding", res.rounding, "rne")):
            if v is not default and v != default:
                raise InputTypeError(f"{name}: applies only to an FP8/FP6/FP4 out_dtype, got {name}={v!r} "
                                     f"with out_dtype={res.dtype!r}")
        if res.scale_result_op not in SCALE_RESULT_OPS:
            raise InputTypeError(f"scale_result_op: expected 'divide' or 'multiply', got {res.scale_result_op!r}")
    out = code or _out_format(res.dtype)
    ca, fa = _operand(a, fmt_a, "a")
    decoded = b if isinstance(b, DecodedCodes) else None
    cb, fb = (decoded.codes, decoded.fmt) if decoded is not None else _operand(b, fmt_b, "b")
    if decoded is not None and fmt_b is not None and get_format(fmt_b) != fb:
        raise FormatError(f"b: DecodedCodes of {fb.name} but fmt_b says {get_format(fmt_b).name}")
    (M, K), (K2, N) = ca.shape, cb.shape
    if K != K2:
        raise ShapeError(f"b: got shape {_shape_text(cb.shape)}, expected ({K}, N) to match a of shape "
                         f"{_shape_text(ca.shape)}")
    sa, sb, bk = _canonical_scales(_scale(scale_a, "scale_a"), _scale(scale_b, "scale_b"), M, K, N,
                                   128 if block_k is None else block_k, block_n)
    if bias is not None:
        bias = float64_values(bias, "bias", ("float32", "bfloat16", "float16"))
        if bias.shape != (N,):
            raise ShapeError(f"bias: got shape {_shape_text(bias.shape)}, expected ({N},)")
    model = ACCUMULATION_MODELS[acc.model]
    if decoded is not None and getattr(model, "takes_decoded", False):
        cb = decoded  # the model reuses what it derived from these codes before
    result = model(ca, cb, fa, fb, sa, sb, bk, bias, out, acc)
    if model.rounds_once:
        if code is not None:  # values are representatives (CodeOut): one rounding, by the codec
            return same_library(encode(result, code.fmt, saturate=code.saturate, rounding=code.rounding),
                                is_torch(a))
        return deliver(result, out.name, is_torch(a))
    if bias is not None:
        result = (result + bias.astype(np.float32)).astype(np.float32)
    if code is not None:  # v = fp32(acc / s) or fp32(acc * s) (IEEE float32), then encode from fp32
        if code.scale is not None:
            with np.errstate(over="ignore", invalid="ignore", under="ignore"):
                s32 = np.float32(code.scale)
                result = (result / s32 if code.op == "divide" else result * s32).astype(np.float32)
        return same_library(encode(result, code.fmt, saturate=code.saturate, rounding=code.rounding), is_torch(a))
    values = result.astype(np.float64)
    if out.name != "float32":  # a float32 value is already on the float32 grid
        values = round_to_format(values, out)
    return deliver(values, out.name, is_torch(a))


#: linear's activation quantization, declared as a recipe: s = fp32(amax) / fp32(max), 1 where
#: amax == 0 (q is all zero then, so any scale gives the same product); q = encode(fp32(x / s)),
#: RNE, saturating. Dynamic scales need finite x; static ones let NaN/Inf through to the product.
ACTIVATION_RECIPE = Recipe(
    name="fp8ref-linear", summary="s = fp32(amax) / fp32(max) (1 where amax == 0); q = encode(fp32(x / s))",
    source="fp8ref.matmul.linear", verified="tests/unit/matmul/test_matmul.py (Fraction oracle)",
    granularities=("tensor", "token", "group"), formats=tuple(FORMATS), require_divisible=False,
    nonfinite="propagate", amax_min=None, amax_max=None, token_2d="token", scale_form="amax/max",
    scale_dtype="float32", scale_min=None, zero_amax_scale=1.0, scale_store_dtype="float32", zero_stored_scale=None,
    apply_float16_to=None, apply_op="divide", apply_scale="stored", apply_dtype="float32", add_zero=False,
    clamp=False, rounding="rne", saturate=True, negative_zero="keep", dequantize_dtype="exact")


def linear(x, weight, weight_scale, *, input_scale=None, dynamic: str | None = None, bias=None,
           fmt="float8_e4m3fn", input_fmt="float8_e4m3fn", out_dtype=None, block_k: int = 128,
           block_n: int = 128, input_recipe: Recipe | str | None = None, **mm_options):
    """A W8A8 linear layer: ``y = x @ W.T`` with W (N, K) FP8 codes and activations quantized to FP8.

    weight: codes, a torch float8 tensor, or a ``DecodedCodes`` record of the codes (the exact
    model then decodes the weight once and reuses it across calls).

    weight_scale: per tensor (numel 1), per channel (N,) / (N, 1), or per block
    (ceil(N/block_n), ceil(K/block_k)), the layout checkpoints store. Activations: static with
    ``input_scale`` (numel 1), or ``dynamic`` = "tensor", "token" (one scale per row of x) or
    "group" (1 x block_k groups), quantized by ``fp8ref.quantize`` with ``input_recipe``
    (default ``ACTIVATION_RECIPE``: scale fp32(amax / fmt.max), 1.0 where amax == 0;
    q = encode(fp32(x / s), input_fmt), RNE, saturating). Everything else as ``scaled_mm``.
    """
    ifmt = get_format(input_fmt)
    recipe = _input_recipe(input_recipe, ifmt, input_scale is None)
    x2 = _activations(x, keep_bfloat16=model_dtype_free(recipe))
    lead, K = x2.shape[:-1], x2.shape[-1]
    x2 = x2.reshape(-1, K)
    w_codes, w_fmt = weight, fmt
    if isinstance(weight, DecodedCodes):
        w_codes, w_fmt = weight.codes, weight.fmt
    elif is_torch(weight):
        w_codes, named, _ = code_input(weight, "weight")
        w_fmt = named or fmt
    if not isinstance(w_codes, np.ndarray) or w_codes.ndim != 2 or w_codes.shape[1] != K:
        raise ShapeError(f"weight: got shape {_shape_text(getattr(w_codes, 'shape', ()))}, expected (N, {K}) "
                         f"to match x of shape {_shape_text((*lead, K))}")
    N = w_codes.shape[0]
    ws = _scale(weight_scale, "weight_scale")
    nb, kb = -(-N // block_n), -(-K // block_k)
    if ws.size == 1:
        scale_b = ws.reshape(())
    elif ws.shape in ((N,), (N, 1)):
        scale_b = ws.reshape(1, N)
    elif ws.shape == (nb, kb):
        scale_b = ws.T
    else:
        raise ShapeError(f"weight_scale: got shape {_shape_text(ws.shape)}, expected (), (1,), ({N},), ({N}, 1) "
                         f"or ({nb}, {kb}) ({block_n}x{block_k} blocks)")
    q, s_x = _quantize_input(x2, input_scale, dynamic, ifmt, block_k, recipe)
    b = weight.T if isinstance(weight, DecodedCodes) else w_codes.T  # a view: every model takes strided codes
    y = scaled_mm(same_library(q, is_torch(x)), b, s_x, scale_b.astype(np.float32),
                  bias=bias, out_dtype=out_dtype or _default_out(x), fmt_a=get_format(input_fmt), fmt_b=w_fmt,
                  block_k=block_k, block_n=block_n, **mm_options)
    return y.reshape(*lead, N)


def quantize_input(x2: np.ndarray, *, input_scale=None, dynamic: str | None = None, input_fmt="float8_e4m3fn",
                   block_k: int = 128, input_recipe: Recipe | str | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``linear``'s activation quantization alone: (uint8 codes, float32 scale) of (M, K) float32
    activations (fp8ref.nn runs it in front of a backend's scaled_mm and compares its codes)."""
    return _quantize_input(np.asarray(x2, np.float32), input_scale, dynamic, get_format(input_fmt), block_k,
                           input_recipe)


def _quantize_input(x2: np.ndarray, input_scale, dynamic, ifmt, block_k: int, recipe):
    """(codes, float32 scale) of the (M, K) float32 activations, by ``quantize`` with the recipe."""
    if input_scale is not None:
        if dynamic is not None:
            raise InputTypeError(f"dynamic: give either input_scale (static) or dynamic, got both ({dynamic!r})")
        s_x = _scale(input_scale, "input_scale")
        if s_x.size != 1:
            raise ShapeError(f"input_scale: static activation scales are per tensor, got shape "
                             f"{_shape_text(s_x.shape)}, expected () or (1,)")
        args = QuantArgs(format=ifmt, granularity="tensor", dynamic=False)
    elif dynamic not in ("tensor", "token", "group"):
        raise InputTypeError(f"dynamic: expected 'tensor', 'token' or 'group' when input_scale is None, "
                             f"got {dynamic!r}")
    else:
        args = QuantArgs(format=ifmt, granularity=dynamic, group_size=block_k if dynamic == "group" else None)
    recipe = _input_recipe(recipe, ifmt, input_scale is None)
    q = quantize(x2, args, recipe=recipe, scale=None if input_scale is None else s_x.reshape(1).astype(np.float32))
    return q.codes, np.asarray(q.scale, np.float32)


def _input_recipe(recipe: Recipe | str | None, ifmt, dynamic: bool) -> Recipe:
    """The recipe the activations are quantized with: the one given, else ACTIVATION_RECIPE (for
    this input format; NaN/Inf refused when the scale comes from x)."""
    if recipe is not None:
        return get_recipe(recipe)
    recipe = ACTIVATION_RECIPE
    if ifmt.name not in recipe.formats:  # a user FloatFormat
        recipe = replace(recipe, formats=(ifmt.name,))
    return replace(recipe, nonfinite="error") if dynamic else recipe


def _activations(x, *, keep_bfloat16: bool) -> np.ndarray:
    """x (..., K) as the quantizer takes it, every value exact: a torch bfloat16 tensor as its own
    bits (numpy bfloat16: no conversion) when ``keep_bfloat16`` (the recipe does the same arithmetic
    on them as on their float32 values), else float32 (torch converts a tensor, on its threads)."""
    dtypes = ("float32", "bfloat16", "float16")
    if not is_torch(x):
        xv = float64_values(x, "x", dtypes)
        if xv.ndim < 1:
            raise ShapeError(f"x: expected shape (..., K), got {_shape_text(xv.shape)}")
        return xv.astype(np.float32)
    name = dtype_name(x)
    if name not in dtypes:
        raise InputTypeError(f"x: expected dtype {' or '.join(dtypes)}, got torch {name}")
    check_torch(x, "x")
    if x.ndim < 1:
        raise ShapeError(f"x: expected shape (..., K), got {_shape_text(tuple(x.shape))}")
    t = x.detach().contiguous()
    if name == "bfloat16" and keep_bfloat16:
        return numpy_bf16(t.view(torch().int16).numpy().view(np.uint16))
    return t.to(torch().float32).numpy()


def _default_out(x) -> str:
    name = dtype_name(x)  # not str(dtype): a big-endian bfloat16's is '>V2'
    return name if name in OUT_FORMATS else "float32"
