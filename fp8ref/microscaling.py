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
from .errors import EncodeError, InputTypeError, ShapeError
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


GGML_UE4M3 = "ggml-ue4m3(amax/6)"  # llama.cpp's NVFP4 block scale form (no global scale)
_GGML_KVALUES = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.float32)  # 2 * E2M1


def ggml_fp32_to_ue4m3(x) -> np.ndarray:
    """llama.cpp's ggml_fp32_to_ue4m3 on float32 values: <= 0 or NaN -> 0; clamp to 448; below 2^-6
    round(x * 512) as (int)(x * 512.0f + 0.5f) (float32 operations, then truncation) into 0..7;
    above, the top three mantissa bits plus the fourth (round half up, carry into the exponent),
    and every value from 256 up -> 0x7E (448: ggml reserves exponent field 15 for saturation)."""
    x = np.asarray(x, np.float32)
    with np.errstate(invalid="ignore"):
        positive = x > 0
    xc = np.minimum(np.where(positive, x, np.float32(0)), np.float32(448)).astype(np.float32)
    bits = xc.view(np.uint32)
    exp = ((bits >> 23) & 0xFF).astype(np.int32) - 127 + 7
    sub = (xc * np.float32(512) + np.float32(0.5)).astype(np.float32).astype(np.int32)  # float32 ops, truncate
    sub = np.where(sub < 1, 0, np.minimum(sub, 7))
    man = ((bits >> 20) & 7).astype(np.int32) + ((bits >> 19) & 1).astype(np.int32)
    carry = man > 7
    exp_r, man = exp + carry, np.where(carry, 0, man)
    normal = np.where(exp_r >= 15, 0x7E, (exp_r << 3) | man)
    out = np.where(exp <= 0, sub, np.where(exp >= 15, 0x7E, normal))
    return np.where(positive, out, 0).astype(np.uint8)


def ggml_ue4m3_half(codes) -> np.ndarray:
    """llama.cpp's ggml_ue4m3_to_fp32: half of (1 + m/8) * 2^(e-7) (m * 2^-9 where e = 0) with
    e = (x >> 3) & 0xF and m = x & 7, so bit 7 is ignored and exponent 15 is finite (0xFF gives 240);
    only 0x00 and 0x7F give 0."""
    c = np.asarray(codes, np.uint8).astype(np.int32)
    exp, man = (c >> 3) & 0xF, (c & 7).astype(np.float32)
    raw = np.where(exp == 0, np.ldexp(man, -9), np.ldexp(1 + man / np.float32(8), exp - 7))  # exact in float32;
    return np.where((c == 0) | (c == 0x7F), np.float32(0), raw * np.float32(0.5)).astype(np.float32)  # 0xFF: 240


def ggml_nvfp4_dequantize(codes, scale_bytes) -> np.ndarray:
    """llama.cpp's dequantize_row_nvfp4 (and gguf-py's ``NVFP4.dequantize_blocks``): float32
    kvalues_mxfp4[q] * ggml_ue4m3_to_fp32(s) per 16 elements, so E2M1 code 0x8 gives +0.0 and a
    negative code under a zero scale -0.0 (``codes`` [..., K] unpacked, ``scale_bytes`` [..., K/16])."""
    k = _GGML_KVALUES[np.asarray(codes, np.uint8) & 0x0F]
    d = expand(ggml_ue4m3_half(scale_bytes), k.shape, "nvfp4").astype(np.float32)
    return (k * d).astype(np.float32)


def _ggml_nvfp4(arr, dtype, qa, rec: BlockRecipe, fmt, amax, given) -> dict:
    """llama.cpp's quantize_row_nvfp4_ref: per 16 elements s = ggml_fp32_to_ue4m3(fp32(amax / 6)),
    d = ggml_ue4m3_to_fp32(s) (half the scale), and each element the first index i of the smallest
    float32 |kvalues_mxfp4[i] * d - x| (best_index_mxfp4: ties to the smaller magnitude, never -0).
    A GGUF stores no global scale: it is 1, so a tensor ``amax`` changes nothing and a given global
    scale must be 1."""
    if given is not None and one_number(given, "scale") != 1:
        raise InputTypeError(f"recipe {rec.name!r}: llama.cpp's NVFP4 has no global scale (1); got scale {given!r}")
    x32 = _f32(_exact_values(arr, dtype))
    amax_b = reduce_amax(_exact_values(arr, dtype), "nvfp4")
    reject_nonfinite(amax_b, arr, dtype, rec)
    scale_codes = ggml_fp32_to_ue4m3(_f32(amax_b) / np.float32(fmt.max))  # amax / 6.0f in float32
    d = expand(ggml_ue4m3_half(scale_codes), x32.shape, "nvfp4").astype(np.float32)  # a partial last block too
    codes = np.empty(x32.shape, np.uint8)
    flat_x, flat_d, flat_c = x32.reshape(-1), d.reshape(-1), codes.reshape(-1)
    for lo in range(0, flat_x.size, 1 << 16):  # 16 candidate errors per element: bounded temporaries
        xs, ds = flat_x[lo:lo + (1 << 16), None], flat_d[lo:lo + (1 << 16), None]
        err = np.abs((_GGML_KVALUES * ds).astype(np.float32) - xs).astype(np.float32)
        flat_c[lo:lo + (1 << 16)] = np.argmin(err, axis=-1)  # the first of equal errors, as the C loop keeps
    s_blk = decode(scale_codes, NVFP4_SCALE_FORMAT)
    return dict(codes=codes, scale=s_blk, format=fmt.name, granularity="nvfp4", recipe=rec.name, args=qa,
                scale_dtype=NVFP4_SCALE_FORMAT, dtype=dtype, scale_codes=scale_codes,
                global_scale=np.array([1.0], np.float32), global_meaning="multiplier", _recipe=rec)


def _reject_nonfinite_blocks(s_blk: np.ndarray, g, rec: BlockRecipe, fmt) -> None:
    """A block whose stored scale is NaN has NaN quotients, which an element format without a NaN
    code cannot hold: said as what happened (ModelOpt's global scale of a zero amax is 0/0, so an
    all-zero weight has NaN block scales), not as NaN values in x, which may hold none."""
    bad = ~np.isfinite(s_blk)
    if bad.any() and not fmt.has_nan:
        why = (f"global scale {float(g)!r}: the tensor amax is 0, and 0/0 is NaN in this recipe"
               if g == 0 or np.isinf(g) else "x holds NaN or Inf")
        raise EncodeError(f"x: recipe {rec.name!r} gives {int(bad.sum())} of {s_blk.size} block scale(s) that are "
                          f"non-finite ({why}), and {fmt.name} has no NaN code for their elements")


def recipe_nvfp4(arr, dtype, qa, rec: BlockRecipe, fmt, amax, given) -> dict:
    """NVFP4 with a producer's global/block scale steps (BlockRecipe docstring); ``amax`` overrides
    the tensor amax A (a fused group's max); ``given`` is a stored global scale (static, e.g. a
    calibrated input global scale). The global scale returned is what the producer writes: the
    divisor g or the multiplier, per ``global_meaning``."""
    if rec.block_form == GGML_UE4M3:
        return _ggml_nvfp4(arr, dtype, qa, rec, fmt, amax, given)
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
    _reject_nonfinite_blocks(s_blk, g, rec, fmt)
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

