"""MX and NVFP4 quantization: the microscaling formats, whose block scales quantize() computes from x.

MX: an E8M0 power of two per 32 elements; NVFP4: an E4M3 scale per 16 elements under an fp32
global scale. ``quantize_mx`` / ``quantize_nvfp4`` are fp8ref's own rules (exact float64 steps,
one rounding each); ``recipe_mx`` / ``recipe_nvfp4`` are a producer's ``BlockRecipe``: the tool's
own D/fp32 arithmetic, step by step. Each returns the fields of a ``quant.QuantResult`` as a dict
of numpy arrays; ``fp8ref.quant.quantize`` chooses between them and wraps the result.
"""

from __future__ import annotations

import numpy as np

from ._quant_inputs import one_number, reject_nonfinite, widen
from .codec import decode, encode
from .errors import InputTypeError, ShapeError
from .formats import FORMATS
from .recipes import BlockRecipe, check_scale, exact_quotient_codes
from .rounding import round_to
from .scaling import e8m0_value, expand, mx_scale_exponent, nvfp4_global_scale, reduce_amax

NVFP4_SCALE_FORMAT = "float8_e4m3fn"


def _exact_values(arr: np.ndarray, dtype: str) -> np.ndarray:
    return widen(arr, dtype, None).astype(np.float64)


def quantize_mx(arr, dtype, qa, rec, fmt) -> dict:
    """MX by fp8ref's rule: E8M0 exponent by qa.mx_rule, then x * 2**-e (exact) encoded once."""
    x = _exact_values(arr, dtype)
    amax = reduce_amax(x, "mx")
    reject_nonfinite(amax, arr, dtype, rec)
    e = mx_scale_exponent(amax, fmt, qa.mx_rule)
    factor = np.ldexp(1.0, -expand(e, x.shape, "mx"))  # x * 2**-e is exact in float64
    codes = encode(x * factor, fmt, rounding=qa.rounding, saturate=True)
    return dict(codes=codes, scale=e8m0_value(e), format=fmt.name, granularity="mx", recipe=rec.name,
                args=qa, scale_dtype="float8_e8m0fnu", dtype=dtype,
                scale_codes=(e + 127).astype(np.uint8), _recipe=rec)


def quantize_nvfp4(arr, dtype, qa, rec, fmt) -> dict:
    """NVFP4 by fp8ref's rule: the global scale, each block scale and each element rounded once."""
    sfmt = FORMATS[NVFP4_SCALE_FORMAT]
    x = _exact_values(arr, dtype)
    amax_b = reduce_amax(x, "nvfp4")
    reject_nonfinite(amax_b, arr, dtype, rec)
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
                scale_dtype=NVFP4_SCALE_FORMAT, dtype=dtype, scale_codes=scale_codes,
                global_scale=np.array([s_glob], np.float32), _recipe=rec)


# --- producer block recipes (BlockRecipe): the tools' own D/fp32 arithmetic, step by step ----------
def _f32(v) -> np.ndarray:
    return np.asarray(v, np.float32)


def recipe_mx(arr, dtype, qa, rec: BlockRecipe, fmt) -> dict:
    """MX with a producer's E8M0 rule: codes = enc(clamp(R(x * 2**-k) [+ 0])), R = rec.apply_dtype."""
    x = _exact_values(arr, dtype)
    amax = reduce_amax(x, "mx")
    reject_nonfinite(amax, arr, dtype, rec)
    e = mx_scale_exponent(amax, fmt, rec.mx_rule)
    e = np.where(amax == 0, rec.mx_zero_code - 127, e)
    k = e if rec.mx_zero_byte == "exact" else np.where(e == -127, {"float32-min-normal": -126, "one": 0}[
        rec.mx_zero_byte], e)  # torchao: FLT_MIN for the float32 divisor 2**-127 (FLOOR...), or 1 (RCEIL)
    y = x * np.ldexp(1.0, -expand(k, x.shape, "mx"))  # exact in float64 (a power of two)
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
    top = np.float32(FORMATS["float4_e2m1fn"].max * FORMATS[NVFP4_SCALE_FORMAT].max)  # 2688
    a32 = np.float32(amax)  # exact: a D value
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        if rec.global_rule == "none":  # no per-tensor scale: a multiplier of exactly 1
            return np.float32(1.0)
        if rec.global_rule == "zero-to-one":  # torchao per_tensor_amax_to_scale; 0 -> 1 (torchao: 0 and NaN)
            return np.float32(a32 / top) if a32 > 0 else np.float32(1.0)
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


def recipe_nvfp4(arr, dtype, qa, rec: BlockRecipe, fmt, amax, given) -> dict:
    """NVFP4 with a producer's global/block scale steps (BlockRecipe docstring); ``amax`` overrides
    the tensor amax A (a fused group's max); ``given`` is a stored global scale (static, e.g. a
    calibrated input global scale). The global scale returned is what the producer writes: the
    divisor g or the multiplier, per ``global_meaning``."""
    sfmt = FORMATS[NVFP4_SCALE_FORMAT]
    x32 = _f32(_exact_values(arr, dtype))
    amax_b = reduce_amax(_exact_values(arr, dtype), "nvfp4")
    reject_nonfinite(amax_b, arr, dtype, rec)
    if rec.tile_rows > 1:  # one scale per tile_rows x 16 tile, written to each of its rows' 1x16 blocks
        if arr.ndim < 2:
            raise ShapeError(f"x: recipe {rec.name!r} scales {rec.tile_rows}x16 tiles and needs a 2-D weight, "
                             f"got shape {tuple(arr.shape)}")
        tiles = reduce_amax(_exact_values(arr, dtype), "block", block_shape=(rec.tile_rows, 16))
        amax_b = np.repeat(tiles, rec.tile_rows, axis=-2)[..., :arr.shape[-2], :]
    if amax is not None and given is not None:
        raise InputTypeError("scale, amax: give one of them, not both")
    if given is not None:
        g = np.float32(one_number(given, "scale"))
        check_scale(np.array([g]), "scale")
    else:
        a = amax_b.max(initial=0.0) if amax is None else one_number(amax, "amax")
        g = nvfp4_producer_global(a, rec, dtype)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        ab = _f32(amax_b)  # block amax values are D values: exact in fp32
        if rec.block_form == "global*D(amax/max_elem)":
            sb = _f32(g) * _f32(round_to(ab / np.float32(fmt.max), dtype))
        elif rec.block_form == "amax*fp32(global*fp32(1/max_elem))":  # TE: the 1/6 folded into the multiplier
            sb = _f32(ab * _f32(_f32(g) * _f32(np.float32(1.0) / np.float32(fmt.max))))
            sb = np.minimum(sb, np.finfo(np.float32).max)
        elif rec.block_form == "fp32(amax/max_elem)/global":  # torchao: two float32 roundings
            sb = _f32(_f32(ab / np.float32(fmt.max)) / _f32(g))
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
        elif rec.apply_op == "multiply_quotient":  # torchao: x * ((1 / m) / s_b), each step in float32
            m = _f32(_f32(np.float32(1.0) / _f32(g)) / s_blk)
            y = _f32(x32 * expand(m, x32.shape, "nvfp4").astype(np.float32))
        else:
            eff = _f32(s_blk / g) if rec.global_meaning == "divisor" else _f32(s_blk * g)  # fp32, rounded once
            y = x32 / expand(eff, x32.shape, "nvfp4").astype(np.float32)
    codes = _block_encode(y, rec, fmt)
    return dict(codes=codes, scale=s_blk, format=fmt.name, granularity="nvfp4", recipe=rec.name, args=qa,
                scale_dtype=NVFP4_SCALE_FORMAT, dtype=dtype, scale_codes=scale_codes,
                global_scale=np.array([g], np.float32), global_meaning=rec.global_meaning, _recipe=rec)

