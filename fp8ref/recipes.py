"""Producer recipes: the declared arithmetic that reproduces a producer's bytes.

A ``Recipe`` lists each step and the dtype it rounds to (see docs/quantize.md):

1. ``amax``         max|x| over the granularity's reduction set (exact), optionally clamped;
                    ``token_2d`` says whether 'token' on a 2-D input is per token or per tensor;
                    ``zero_at_most``: an amax at or below it counts as zero (ModelOpt's 2^-24).
2. ``scale``        ``amax/max`` or ``1/(max/amax)``, rounded in ``scale.dtype``; a minimum,
                    a replacement for amax == 0 (and for an infinite amax, and for an infinite
                    multiplier); optionally a power of two (``pow2``); rounded again to
                    ``store_dtype``; a stored 0 replaced by eps(store dtype) where the producer does that.
3. ``apply``        x (fp16 x first cast to ``float16_to`` where the producer does that:
                    auto-round) divided by the scale, multiplied by its reciprocal or by
                    max/amax, in ``apply.dtype``; the stored or the unrounded scale; ``+ 0`` (turns -0.0
                    into +0.0); clamp to +-max.
4. ``encode``       the codec's rounding/overflow mode; negative zero kept or made +0.
5. ``dequantize``   q*s exact (rounded once to the output dtype), in the model dtype, or
                    ``float32-product``: fp32(q*s) rounded again to the output dtype (D by default).

dtypes: ``exact`` (no rounding: the fp8ref ideal), ``float32``, ``model`` (x's dtype, D).
A D op on float32 data is modelled as torch computes it on CPU: in float32, then rounded to D.

This module is pure: ``recipe_from_document`` builds a Recipe from a loaded YAML document;
``fp8ref.registry`` reads the packaged specs/recipes/*.yaml (``load_recipes``, ``get_recipe``).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from fractions import Fraction

import numpy as np

from .errors import RecipeError, ScaleError, did_you_mean
from .exact import residual_sign
from .formats import FORMATS, FloatFormat
from .rounding import eps_of, round_to
from .scaling import GRANULARITIES, MX_SCALE_RULES, POW2_RULES, amax_over_max, pow2_exponent

DTYPES = ("exact", "float32", "model")


@dataclass(frozen=True)
class Recipe:
    """One producer's quantization arithmetic; every field is a declared step (see module doc)."""

    name: str
    summary: str
    source: str
    verified: str
    granularities: tuple[str, ...]
    formats: tuple[str, ...]
    require_divisible: bool
    nonfinite: str                 # error | propagate
    amax_min: float | None
    amax_max: float | None
    token_2d: str                  # token | tensor (what 'token' means for a 2-D input)
    scale_form: str                # amax/max | 1/(max/amax) | 1/(max*(1/amax)) (torch float/tensor)
    scale_dtype: str               # exact | float32
    scale_min: float | None
    zero_amax_scale: float | None
    scale_store_dtype: str         # float32 | model
    zero_stored_scale: str | None  # None | eps
    apply_float16_to: str | None   # None | bfloat16: dtype fp16 x is cast to before the apply step
    apply_op: str                  # divide | multiply_reciprocal | multiply_multiplier
    apply_scale: str               # stored | computed
    apply_dtype: str               # exact | float32 | model
    add_zero: bool
    clamp: bool
    rounding: str                  # from_args | a codec mode
    saturate: str | bool           # from_args | True | False
    negative_zero: str             # keep | positive
    dequantize_dtype: str          # exact | model | float32-product
    # keys added later (optional in the YAML, null by default)
    amax_zero_at_most: float | None = None  # amax <= this is a zero amax (None: amax > 0 fails, i.e. 0 or NaN)
    scale_pow2: str | None = None  # None | a scaling.POW2_RULES name (s -> 2**k) | floor-multiplier (TE)
    inf_amax_scale: float | None = None  # the scale of an infinite amax (TE: 1); None: what the formula gives
    multiplier_overflow: str | None = None  # None | fp32-max: an infinite multiplier becomes FLT_MAX (TE)


# --- scale step ---------------------------------------------------------------------------
def store_dtype(recipe: Recipe, model_dtype: str, scale_dtype: str = "model") -> str:
    """The dtype a recipe's scale is stored in. ``scale_dtype`` is the scheme's: ``model`` (the
    default) keeps the recipe's own choice (the model dtype D for ``store_dtype: model``, else
    float32); float32, bfloat16 and float16 replace it (the recipe's float32 scale rounded once to
    that dtype). RecipeError where the recipe cannot: an exact scale is stored in float32, and no
    float recipe has a rule to round a scale to a power of two (``data_type: mx_fp`` has), except a
    ``pow2`` recipe, whose power-of-two scales float8_e8m0fnu holds exactly."""
    if scale_dtype == "model":
        return model_dtype if recipe.scale_store_dtype == "model" else "float32"
    if scale_dtype == "float8_e8m0fnu" and recipe.scale_pow2 is not None:
        return scale_dtype
    if scale_dtype not in ("float32", "bfloat16", "float16"):
        raise RecipeError(f"scale_dtype {scale_dtype!r}: recipe {recipe.name!r} computes a float scale and has no "
                          f"rule to round it to {scale_dtype} (power-of-two scales: use data_type mx_fp)")
    if recipe.scale_dtype == "exact" and scale_dtype != "float32":
        raise RecipeError(f"scale_dtype {scale_dtype!r}: recipe {recipe.name!r} computes its scale exactly and "
                          "stores it in float32; rounding it a second time is not its arithmetic")
    return scale_dtype


def model_dtype_free(recipe) -> bool:
    """True when no step of ``recipe`` depends on the input's dtype: neither the apply step nor the
    stored scale is rounded to the model dtype (float16's ``apply_float16_to`` aside). A bfloat16
    input then gets the codes and scales of the same values given in float32."""
    return isinstance(recipe, Recipe) and recipe.apply_dtype != "model" and recipe.scale_store_dtype != "model"


def compute_scale(amax: np.ndarray, recipe: Recipe, fmt: FloatFormat, model_dtype: str, *,
                  scale_dtype: str = "model") -> tuple[np.ndarray, np.ndarray]:
    """(stored scale, operand of the apply step), float32 arrays of amax's shape.

    The stored scale is a dequantization multiplier (x ~ decode(q) * s) in every recipe. The
    operand is the scale the producer divides by (or takes the reciprocal of), or for
    ``multiply_multiplier`` the producer's own multiplier m = fp32(max/amax).
    """
    a = np.asarray(amax, np.float64)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        if recipe.amax_min is not None:
            a = np.where(a < recipe.amax_min, recipe.amax_min, a)  # NaN stays NaN (torch clamp)
        if recipe.amax_max is not None:
            a = np.where(a > recipe.amax_max, recipe.amax_max, a)
        if recipe.scale_dtype == "exact":
            s = amax_over_max(a, fmt)
        else:
            a32 = a.astype(np.float32)  # amax is exact in float32 for <= 32-bit inputs
            if recipe.scale_form == "amax/max":
                s = a32 / np.float32(fmt.max)
            else:
                if recipe.scale_form == "1/(max/amax)":
                    m = np.float32(fmt.max) / a32
                else:  # torch's `float / tensor` is reciprocal(tensor) * float: two roundings
                    m = (np.float32(1.0) / a32) * np.float32(fmt.max)
                if recipe.zero_amax_scale is not None:
                    m = np.where(_nonzero(a32, recipe), m, np.float32(1.0 / recipe.zero_amax_scale))
                if recipe.inf_amax_scale is not None:
                    m = np.where(np.isinf(a32), np.float32(1.0 / recipe.inf_amax_scale), m)
                if recipe.multiplier_overflow == "fp32-max":  # TE's value_for_inf
                    m = np.where(np.isinf(m), np.finfo(np.float32).max, m)
                m = np.asarray(m, np.float32)
                if recipe.scale_pow2 == "floor-multiplier":  # TE force_pow_2_scales: bits & 0xFF800000
                    m = (m.view(np.uint32) & np.uint32(0xFF800000)).view(np.float32)
                s = np.float32(1.0) / m
        s = np.asarray(s, np.float32)
        if recipe.scale_min is not None:
            s = np.where(s < np.float32(recipe.scale_min), np.float32(recipe.scale_min), s)
        if recipe.zero_amax_scale is not None:
            s = np.where(_nonzero(a, recipe), s, np.float32(recipe.zero_amax_scale))
        if recipe.inf_amax_scale is not None:
            s = np.where(np.isinf(a), np.float32(recipe.inf_amax_scale), s)
        if recipe.scale_pow2 in POW2_RULES:  # 2**k, and the multiplier its exact reciprocal 2**-k
            k = pow2_exponent(s, recipe.scale_pow2)
            keep = np.isfinite(s) | (recipe.scale_pow2 == "ceil")  # 'ceil' maps every float32 (DeepGEMM)
            s = np.where(keep, np.ldexp(np.float32(1.0), k), s).astype(np.float32)
            m = np.where(keep, np.ldexp(np.float32(1.0), -k), np.float32(np.nan)).astype(np.float32)
    store = store_dtype(recipe, model_dtype, scale_dtype)
    # float8_e8m0fnu: the pow2 step's 2**k, already exact (k <= 127: a float32 2**128 is inf)
    stored = (s if store == "float8_e8m0fnu" else round_to(s, store)).astype(np.float32)
    if recipe.zero_stored_scale == "eps":
        stored = np.where(stored == 0, np.float32(eps_of(store)), stored)
    if recipe.apply_op == "multiply_multiplier" and recipe.scale_form != "amax/max":
        return stored, m
    used = stored if recipe.apply_scale == "stored" else s
    return stored, np.asarray(used, np.float32)


def _nonzero(a: np.ndarray, recipe: Recipe) -> np.ndarray:
    """Where amax is not a zero amax: ``amax > 0`` (False for 0 and NaN: HF's test), or with
    ``zero_at_most`` t ``not amax <= t`` (ModelOpt's ``amax <= 2**-24`` mask: a NaN amax stays NaN)."""
    if recipe.amax_zero_at_most is None:
        return a > 0
    return ~(a <= recipe.amax_zero_at_most)


def with_amax_ub(recipe: Recipe, ub) -> Recipe:
    """``recipe`` with its amax capped at the run-time upper bound ``ub`` (fp32): vLLM's ``scale_ub``
    and FBGEMM's ``activation_scale_ub`` (``min(amax, ub)`` before the scale formula)."""
    value = np.float32(ub)
    if not (np.isfinite(value) and value > 0):
        raise RecipeError(f"scale_ub: expected a positive finite number, got {ub!r}")
    if recipe.amax_max is not None and recipe.amax_max < float(value):
        value = np.float32(recipe.amax_max)
    return replace(recipe, amax_max=float(value))


def check_scale(scale: np.ndarray, what: str = "scale") -> None:
    """A given (e.g. calibrated) scale must be positive and finite."""
    bad = ~(np.isfinite(scale) & (scale > 0))
    if bad.any():
        idx = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ScaleError(f"{what}: expected positive finite scales, got {scale[idx]!r} at index {idx} "
                         f"({int(bad.sum())} bad of {scale.size})")


# --- apply step ---------------------------------------------------------------------------
def apply_scaled(x32: np.ndarray, s32: np.ndarray, recipe: Recipe, fmt: FloatFormat,
                 model_dtype: str) -> np.ndarray:
    """The value the producer hands to its fp8 cast, as float32 (exact in its dtype).

    ``s32`` is compute_scale's operand: divide -> x/s; multiply_reciprocal -> x*fp32(1/s);
    multiply_multiplier -> x*m. Not for ``apply_dtype == "exact"`` (exact_quotient_codes).
    """
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        if recipe.apply_op == "divide":
            y = x32 / s32
        elif recipe.apply_op == "multiply_reciprocal":
            y = x32 * (np.float32(1.0) / s32)
        else:
            y = x32 * s32
        if recipe.apply_dtype == "model":
            y = round_to(y, model_dtype)
        if recipe.add_zero:
            y = y + np.float32(0.0)  # -0.0 + +0.0 = +0.0 (IEEE, round to nearest)
        if recipe.clamp:
            np.clip(y, -fmt.max, fmt.max, out=y)
    return y


def exact_quotient_codes(x: np.ndarray, s: np.ndarray, fmt: FloatFormat, *, encode, rounding: str,
                         saturate: bool, out: np.ndarray, scratch: np.ndarray | None = None) -> None:
    """codes = round(x / s) with the EXACT quotient rounded once (proof: docs/quantize.md).

    x: float32 or float64 values; s: scales of x's dtype (or exactly representable in it),
    broadcastable to x; writes uint8 ``out``. ``scratch``: optional buffer like x for q.
    Bulk: q = fl(x/s) in x's width, then the codec. fl(x/s) can round differently from x/s
    only where q is exactly a decision point of the target format (a grid point or a
    midpoint, incl. the grid continued above max: <= M+2 significant bits) while x/s is
    not. Such q have >= W-(M+1) trailing zero mantissa bits (W = 23 or 52), a cheap test;
    for those few elements the sign of the exact residual x - q*s decides, and an inexact
    q is moved one ulp toward x/s: that value is no decision point and no decision point
    lies between it and x/s, so it rounds like x/s in every deterministic mode.
    """
    q = scratch if scratch is not None else np.empty(x.shape, x.dtype)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        np.divide(x, s, out=q)
    encode(q, fmt, rounding=rounding, saturate=saturate, out=out)
    idx = _maybe_on_grid(q, (52 if q.dtype == np.float64 else 23) - (fmt.mantissa_bits + 1))
    if idx.size == 0:
        return
    at = np.unravel_index(idx, x.shape)
    qc, xc = q[at], x[at]
    with np.errstate(invalid="ignore", over="ignore"):
        sign = residual_sign(xc.astype(np.float64), qc.astype(np.float64),
                              np.broadcast_to(s, x.shape)[at].astype(np.float64))
    finite_x = np.isfinite(xc)
    sign = np.where(np.isinf(qc) & finite_x, -np.sign(qc), sign)  # overflowed q: x/s is finite
    move = finite_x & (sign != 0)
    if move.any():
        toward = np.where(sign > 0, np.inf, -np.inf).astype(q.dtype)
        qc = np.where(move, np.nextafter(qc, toward), qc)
        out[at] = encode(qc, fmt, rounding=rounding, saturate=saturate)


def _maybe_on_grid(q: np.ndarray, tail: int) -> np.ndarray:
    """Flat indices of the q whose low ``tail`` mantissa bits are all zero (a superset of
    the decision points, and of zeros, infinities and exact quotients)."""
    bits = q.reshape(-1).view(np.uint64 if q.dtype == np.float64 else np.uint32)
    return np.flatnonzero((bits & bits.dtype.type((1 << tail) - 1)) == 0)


# --- loading (edge) -----------------------------------------------------------------------
_STEPS = {
    "amax": {"min": "amax_min", "max": "amax_max", "token_2d": "token_2d", "zero_at_most": "amax_zero_at_most"},
    "scale": {"form": "scale_form", "dtype": "scale_dtype", "min": "scale_min",
              "zero_amax": "zero_amax_scale", "store_dtype": "scale_store_dtype",
              "zero_stored": "zero_stored_scale", "pow2": "scale_pow2", "inf_amax": "inf_amax_scale",
              "multiplier_overflow": "multiplier_overflow"},
    "apply": {"float16_to": "apply_float16_to", "op": "apply_op", "scale": "apply_scale", "dtype": "apply_dtype",
              "add_zero": "add_zero", "clamp": "clamp"},
    "encode": {"rounding": "rounding", "saturate": "saturate", "negative_zero": "negative_zero"},
    "dequantize": {"dtype": "dequantize_dtype"},
}
_TOP = ("name", "summary", "source", "verified", "granularities", "formats", "require_divisible",
        "nonfinite", "steps")
_CHOICES = {
    "nonfinite": ("error", "propagate"), "token_2d": ("token", "tensor"),
    "apply_float16_to": (None, "bfloat16"),
    "scale_form": ("amax/max", "1/(max/amax)", "1/(max*(1/amax))"), "scale_dtype": ("exact", "float32"),
    "scale_store_dtype": ("float32", "model"), "zero_stored_scale": (None, "eps"),
    "scale_pow2": (None, "floor-multiplier", *POW2_RULES), "multiplier_overflow": (None, "fp32-max"),
    "apply_op": ("divide", "multiply_reciprocal", "multiply_multiplier"),
    "apply_scale": ("stored", "computed"), "apply_dtype": DTYPES,
    "rounding": ("from_args", "rne", "rna", "rtz", "rup", "rdown", "rto"),
    "saturate": ("from_args", True, False), "negative_zero": ("keep", "positive"),
    "dequantize_dtype": ("exact", "model", "float32-product"),
}
_NUMBERS = ("amax_min", "amax_max", "amax_zero_at_most", "scale_min", "zero_amax_scale", "inf_amax_scale")
# keys added after the first recipes: absent means null (the older recipes' behaviour)
_OPTIONAL = {"amax": ("zero_at_most",), "scale": ("pow2", "inf_amax", "multiplier_overflow")}
_BOOLS = ("add_zero", "clamp", "require_divisible")


def _number(doc, path, value):
    """A float, int or an exact fraction string like '1/229376' -> nearest float64."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise doc.error(path, f"expected a number or null, got {value!r}")
    if isinstance(value, (int, float)):
        return float(value)
    try:
        return float(Fraction(str(value)))
    except (ValueError, ZeroDivisionError):
        raise doc.error(path, f"expected a number, a fraction like '1/229376' or null, got {value!r}") from None


def _exact_keys(doc, path, mapping, keys, optional=()):
    if not isinstance(mapping, dict):
        raise doc.error(path, f"expected a mapping, got {type(mapping).__name__}")
    unknown = [k for k in mapping if k not in keys]
    if unknown:
        raise doc.error(tuple(path) + (unknown[0],), "unknown key" + did_you_mean(unknown[0], keys, clause=True)
                        + f" (expected {', '.join(keys)})")
    missing = [k for k in keys if k not in mapping and k not in optional]
    if missing:
        raise doc.error(path, f"missing key(s) {', '.join(missing)}")


def _header(doc, data, granularities: tuple, formats: tuple | None) -> dict:
    """The fields every recipe kind starts with: non-empty strings, then non-empty lists of the
    granularities and formats it applies to (``None``: any name)."""
    values: dict = {}
    for key in ("name", "summary", "source", "verified", "nonfinite"):
        if not isinstance(data[key], str) or not data[key]:
            raise doc.error((key,), f"expected a non-empty string, got {data[key]!r}")
        values[key] = data[key]
    for key, allowed in (("granularities", granularities), ("formats", formats)):
        seq = data[key]
        if not isinstance(seq, list) or not seq or not all(isinstance(v, str) for v in seq):
            raise doc.error((key,), f"expected a non-empty list of strings, got {seq!r}")
        for i, v in enumerate(seq):
            if allowed is not None and v not in allowed:
                raise doc.error((key, i), f"expected one of {', '.join(allowed)}, got {v!r}")
        values[key] = tuple(seq)
    return values


def recipe_from_document(doc) -> Recipe:
    """Validate a loaded recipe YAML document (fp8ref.io.yaml.YamlDocument) strictly."""
    data = doc.data
    _exact_keys(doc, (), data, _TOP)
    values = _header(doc, data, GRANULARITIES, None)
    values["require_divisible"] = data["require_divisible"]
    _exact_keys(doc, ("steps",), data["steps"], tuple(_STEPS))
    for step, keys in _STEPS.items():
        body = data["steps"][step]
        _exact_keys(doc, ("steps", step), body, tuple(keys), _OPTIONAL.get(step, ()))
        for key, field_name in keys.items():
            path = ("steps", step, key)
            value = body.get(key)
            if field_name in _NUMBERS:
                value = _number(doc, path, value)
            values[field_name] = value
    for name in _BOOLS:
        if not isinstance(values[name], bool):
            raise doc.error(_path_of(name), f"expected true or false, got {values[name]!r}")
    for name, allowed in _CHOICES.items():
        if not any(values[name] == a and type(values[name]) is type(a) for a in allowed):
            shown = ", ".join("null" if a is None else str(a).lower() if isinstance(a, bool) else a for a in allowed)
            raise doc.error(_path_of(name), f"expected one of {shown}, got {values[name]!r}")
    if values["amax_zero_at_most"] is not None and values["zero_amax_scale"] is None:
        raise doc.error(("steps", "amax", "zero_at_most"), "a zero amax needs its scale: set steps.scale.zero_amax")
    if values["scale_dtype"] == "exact" and values["scale_store_dtype"] != "float32":
        raise doc.error(("steps", "scale", "store_dtype"), "an exact scale is stored in float32")
    multiplier = values["scale_form"] != "amax/max" and values["scale_dtype"] != "exact"
    if values["scale_pow2"] == "floor-multiplier" and not multiplier:  # the POW2_RULES act on the scale: any form
        raise doc.error(("steps", "scale", "pow2"), "floor-multiplier goes with a float32 multiplier form "
                        "(1/(max/amax))")
    if values["multiplier_overflow"] is not None and not multiplier:
        raise doc.error(("steps", "scale", "multiplier_overflow"), "needs a float32 multiplier form (1/(max/amax))")
    for i, f in enumerate(values["formats"]):
        if f not in FORMATS:
            raise doc.error(("formats", i), f"unknown format {f!r}")
    return Recipe(**{f.name: values[f.name] for f in fields(Recipe)})


def _path_of(field_name: str) -> tuple:
    if field_name in _TOP:
        return (field_name,)
    for step, keys in _STEPS.items():
        for key, name in keys.items():
            if name == field_name:
                return ("steps", step, key)
    return ()


# --- block-scaled (MX, NVFP4) producer recipes ------------------------------------------------
@dataclass(frozen=True)
class BlockRecipe:
    """A producer's MX or NVFP4 arithmetic (``kind: block`` in the YAML). Steps, in order:

    1. ``global`` (NVFP4): from the tensor amax A (a fused group's max where the producer fuses):
       ``divisor`` g = D-or-fp32(max_elem*max_scale / max(A, tiny)) (compressed-tensors), or
       ``multiplier`` = fp32(A) / (max_elem*max_scale) in float32 (ModelOpt); ``rule: fp32-max``
       (TE): g = fp32(2688 / A) with no tiny clamp, inf and NaN -> FLT_MAX, A == 0 -> 1;
       ``rule: reciprocal`` (compressed-tensors: torch's python-float / tensor is
       ``t.reciprocal() * 2688``): g = R(fp32(R(1 / max(A, tiny))) * 2688), two roundings;
       multiplier ``rule: zero-to-one`` (torchao NVFP4Tensor): fp32(A) / 2688, A == 0 -> 1 (torchao
       stores 0 and NaN block scales there); ``rule: none``: no per-tensor scale (a multiplier of 1).
    2. ``block_scale``: NVFP4 ``global*D(amax/max_elem)`` (fp32 product of the divisor and the
       D-rounded amax/6), ``amax/fp32(max_elem*global)`` (fp32 quotient by the fp32 product) or
       ``amax*fp32(global*fp32(1/max_elem))`` (TE: the 1/6 folded into the multiplier, capped at
       FLT_MAX), ``fp32(amax/max_elem)/global`` (torchao: the float32 amax/6, then divided by the
       multiplier in float32); ``tile_rows: 16`` takes amax over 16x16 tiles (TE's 2-D weights), each row's
       1x16 block storing its tile's scale;
       ``zero_amax`` replaces a 0 quotient before the E4M3 rounding, ``min`` clamps it from
       below, ``zero_stored`` replaces a stored 0 after it. MX: the E8M0 exponent by ``rule``
       (``fp8ref.scaling.mx_scale_exponent``), ``zero_code`` the byte of an all-zero block.
    3. ``apply``: NVFP4 x / fp32(effective scale) in float32 (effective = s_b/g or s_b*multiplier,
       rounded to fp32 first), or with ``op: multiply_reciprocal`` (TE) x * min(fp32(1/fp32(s_b *
       fp32(1/g))), FLT_MAX), or with ``op: multiply_quotient`` (torchao) x * fp32(fp32(1/m) / s_b) for
       multiplier m; MX x * 2**-k, exact, then rounded to ``dtype`` (``zero_byte``: the factor where
       k = -127, see ``mx_zero_byte``); ``+ 0`` if
       ``add_zero`` (-0.0 -> +0.0); clamp to +-max_elem.
    4. ``encode``: RNE (``ties: toward-zero``: halfway cases to the smaller magnitude), saturating;
       ``negative_zero`` keep (tiny negatives give the -0 code) or positive.
    """

    name: str
    summary: str
    source: str
    verified: str
    granularities: tuple[str, ...]
    formats: tuple[str, ...]
    nonfinite: str
    global_meaning: str | None      # None (MX) | divisor | multiplier
    global_dtype: str | None        # None | model | float32
    block_form: str | None          # None (MX) | global*D(amax/max_elem) | amax/fp32(max_elem*global) |
    #                                 ggml-ue4m3(amax/6): llama.cpp's whole NVFP4 quantizer (microscaling._ggml_nvfp4)
    block_zero_amax: float | None
    block_min: float | None
    block_zero_stored: float | None
    mx_rule: str | None             # None (NVFP4) | a scaling.MX_SCALE_RULES name
    mx_zero_code: int | None
    apply_dtype: str                # float32 | model (MX: the dtype x * 2**-k is rounded to)
    add_zero: bool
    negative_zero: str              # keep | positive
    dequantize_dtype: str           # exact | model
    # keys added later (optional in the YAML; the defaults are the older recipes' behaviour)
    # clamp-amax: R(2688/max(A, tiny)) | reciprocal: R(R(1/max(A, tiny))*2688) (CT) | fp32-max: 2688/A,
    # inf/NaN -> FLT_MAX (TE)
    global_rule: str = "clamp-amax"
    tile_rows: int = 1               # 1: 1x16 blocks | 16: 16x16 tiles share one scale (TE's 2-D weights)
    # divide: x / fp32(s_b/g) | multiply_reciprocal: x * min(fp32(1/fp32(s_b*fp32(1/g))), FLT_MAX) (TE)
    apply_op: str = "divide"
    # even: ties to the even code (RNE) | toward-zero: ties to the smaller magnitude (llama.cpp's
    # best_index_mxfp4 keeps the first of two equal errors)
    encode_ties: str = "even"
    # MX: what x is scaled by where the E8M0 byte is 0 (2**-127): exact (x * 2**127) | float32-min-normal
    # (x / 2**-126: torchao FLOOR/CEIL/EVEN clamp the float32 scale to FLT_MIN) | one (x * 1: torchao RCEIL)
    mx_zero_byte: str = "exact"


_BLOCK_STEPS = {
    "global": {"meaning": "global_meaning", "dtype": "global_dtype", "rule": "global_rule"},
    "block_scale": {"form": "block_form", "zero_amax": "block_zero_amax", "min": "block_min",
                    "zero_stored": "block_zero_stored", "mx_rule": "mx_rule", "zero_code": "mx_zero_code",
                    "tile_rows": "tile_rows"},
    "apply": {"dtype": "apply_dtype", "add_zero": "add_zero", "op": "apply_op", "zero_byte": "mx_zero_byte"},
    "encode": {"negative_zero": "negative_zero", "ties": "encode_ties"},
    "dequantize": {"dtype": "dequantize_dtype"},
}
_BLOCK_OPTIONAL = ("rule", "tile_rows", "op", "ties", "zero_byte")
_BLOCK_TOP = ("name", "kind", "summary", "source", "verified", "granularities", "formats", "nonfinite", "steps")
_BLOCK_CHOICES = {
    "nonfinite": ("error", "propagate"), "global_meaning": (None, "divisor", "multiplier"),
    "global_dtype": (None, "model", "float32"),
    "block_form": (None, "global*D(amax/max_elem)", "amax/fp32(max_elem*global)",
                   "amax*fp32(global*fp32(1/max_elem))", "ggml-ue4m3(amax/6)", "fp32(amax/max_elem)/global"),
    "global_rule": ("clamp-amax", "reciprocal", "fp32-max", "zero-to-one", "none"), "tile_rows": (1, 16),
    "apply_op": ("divide", "multiply_reciprocal", "multiply_quotient"), "encode_ties": ("even", "toward-zero"),
    "mx_zero_byte": ("exact", "float32-min-normal", "one"),
    "apply_dtype": ("float32", "model"), "negative_zero": ("keep", "positive"),
    "dequantize_dtype": ("exact", "model"),
}


def block_recipe_from_document(doc) -> BlockRecipe:
    """Validate a ``kind: block`` recipe document strictly (every key present, nothing else)."""
    data = doc.data
    _exact_keys(doc, (), data, _BLOCK_TOP)
    values = _header(doc, data, ("mx", "nvfp4"), ("float4_e2m1fn", "float6_e2m3fn", "float6_e3m2fn", "float8_e4m3fn",
                                                  "float8_e5m2"))
    if len(values["granularities"]) != 1:
        raise doc.error(("granularities",), "a block recipe is for one of mx, nvfp4")
    _exact_keys(doc, ("steps",), data["steps"], tuple(_BLOCK_STEPS))
    defaults = {f.name: f.default for f in fields(BlockRecipe)}
    for step, keys in _BLOCK_STEPS.items():
        body = data["steps"][step]
        _exact_keys(doc, ("steps", step), body, tuple(keys), _BLOCK_OPTIONAL)
        for key, field_name in keys.items():
            value = body[key] if key in body else defaults[field_name]
            if field_name in ("block_zero_amax", "block_min", "block_zero_stored"):
                value = _number(doc, ("steps", step, key), value)
            values[field_name] = value
    for name, allowed in _BLOCK_CHOICES.items():
        if not any(values[name] == a and type(values[name]) is type(a) for a in allowed):
            raise doc.error(_block_path(name), f"expected one of {', '.join(map(str, allowed))}, got {values[name]!r}")
    if not isinstance(values["add_zero"], bool):
        raise doc.error(_block_path("add_zero"), f"expected true or false, got {values['add_zero']!r}")
    nv = values["granularities"] == ("nvfp4",)
    mx_fields = ("mx_rule", "mx_zero_code")
    nv_fields = ("global_meaning", "global_dtype", "block_form")
    for name in nv_fields if not nv else mx_fields:
        if values[name] is not None:
            raise doc.error(_block_path(name), f"must be null for granularity {values['granularities'][0]}")
    for name in nv_fields if nv else mx_fields:
        if values[name] is None:
            raise doc.error(_block_path(name), f"needed for granularity {values['granularities'][0]}")
    if not nv and (values["global_rule"], values["tile_rows"], values["apply_op"]) != ("clamp-amax", 1, "divide"):
        raise doc.error(("steps",), "global.rule, block_scale.tile_rows and apply.op are NVFP4 steps")
    if nv and values["global_rule"] == "fp32-max" and values["global_meaning"] != "divisor":
        raise doc.error(_block_path("global_rule"), "fp32-max is a rule for a divisor global (2688 / amax)")
    if nv and values["global_rule"] in ("zero-to-one", "none") and values["global_meaning"] != "multiplier":
        raise doc.error(_block_path("global_rule"), f"{values['global_rule']} is a rule for a multiplier global")
    if nv and values["mx_zero_byte"] != "exact":
        raise doc.error(_block_path("mx_zero_byte"), "apply.zero_byte is an MX step")
    if not nv:
        if values["mx_rule"] not in MX_SCALE_RULES:
            raise doc.error(_block_path("mx_rule"), f"expected one of {', '.join(MX_SCALE_RULES)}, "
                            f"got {values['mx_rule']!r}")
        if type(values["mx_zero_code"]) is not int or not 0 <= values["mx_zero_code"] <= 254:
            raise doc.error(_block_path("mx_zero_code"),
                            f"expected an E8M0 byte 0..254, got {values['mx_zero_code']!r}")
    return BlockRecipe(**{f.name: values[f.name] for f in fields(BlockRecipe)})


def _block_path(field_name: str) -> tuple:
    for step, keys in _BLOCK_STEPS.items():
        for key, name in keys.items():
            if name == field_name:
                return ("steps", step, key)
    return (field_name,)
