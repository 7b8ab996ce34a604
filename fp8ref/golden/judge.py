"""Judging outputs: the one place a backend's outputs are compared with fp8ref's, element by
element, for golden checks (``fp8ref golden check``) and live conformance runs alike.

Codes are compared as codes and floats as bit patterns (so -0.0 != +0.0), except NaN,
which follows an explicit equivalence rule because implementations legitimately differ in
NaN codes and payloads (REFERENCE 8.4):

``any``    every NaN equals every NaN (TestFloat's default);
``sign``   NaNs are equal when their sign bits are;
``exact``  NaNs are compared by their exact code / bit pattern.

The fp32-order bound: how a scaled_mm whose fp32 summation order is unspecified is judged.

A backend that sums in fp32 in an order it does not declare (torch's CPU ``_scaled_mm``
goes through BLAS) cannot be compared bit for bit with fp8ref's sequential fp32 model. It
declares ``accumulation_order = {"scaled_mm": "unspecified"}`` and each output element is
then checked against fp8ref's exact result: with x the exact value (bias included),

    E = gamma_{K+2} * |sa sb| * sum_k |a_k b_k|            gamma_n = n u / (1 - n u), u = 2**-24

every fp32 order (tree, blocked, vectorised, with or without FMA, sums kept wider) gives a
pre-cast value in [x - E, x + E], and the output, one monotone rounding r of it
(RNE to fp32, then to out_dtype), lies in [r(x - E), r(x + E)]. docs/conformance.md has the
proof and its domain (no fp32 underflow or overflow in any intermediate); elements outside
the domain are compared bit for bit with the exact result.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from fractions import Fraction

import numpy as np

from .. import codec
from .._arrays import bits_view
from ..errors import GoldenError
from ..formats import FloatFormat, get_format
from ..rounding import round_to
from ..ulp import ordinal, sign_bit
from .ops import OPERATIONS
from .ops.block_gemm import BLOCK_SCALES

ACCUMULATION_ORDERS = ("declared", "unspecified")
NAN_RULES = ("any", "sign", "exact")


@dataclass(frozen=True)
class Mismatch:
    case: str
    op: str
    params: Mapping[str, object]
    output: str
    index: tuple[int, ...]
    inputs: Mapping[str, object]  # the element's inputs (numpy scalars)
    expected: object
    got: object
    ulp: int | None  # distance in steps of the output's own grid; None when NaN is involved
    tags: tuple[str, ...] = ()
    # under the fp32-order bound (below): the fraction of the allowed
    # distance from the exact value that got uses (> 1: outside; NaN: outside the bound's domain)
    bound_used: float | None = None


class OutputError(GoldenError):
    """A backend output with the wrong dtype or shape: the whole case fails."""


def _nan_mask(a: np.ndarray, fmt: FloatFormat | None) -> np.ndarray:
    if fmt is not None:
        return np.isin(a, np.array(sorted(fmt.nan_codes), dtype=np.uint8))
    return np.isnan(a.astype(np.float64))




def check_output(name: str, expected: np.ndarray, got, fmt: str | None) -> np.ndarray:
    """The backend output as a numpy array of the expected dtype and shape, or OutputError."""
    try:
        got = np.asarray(got)
    except Exception as exc:  # noqa: BLE001 - whatever the backend returned, say what it was
        raise OutputError(f"{name}: cannot convert the backend's output ({type(got).__name__}) to a numpy "
                          f"array: {type(exc).__name__}: {exc}") from None
    if got.dtype.name != expected.dtype.name or got.shape != expected.shape:
        raise OutputError(f"{name}: expected {expected.dtype.name}{list(expected.shape)}"
                          + (f" ({fmt} codes)" if fmt else "")
                          + f", got {got.dtype.name}{list(got.shape)}")
    return got


def differing(expected: np.ndarray, got: np.ndarray, fmt_name: str | None, nan_rule: str) -> np.ndarray:
    """Boolean mask of the elements that differ under ``nan_rule``."""
    if nan_rule not in NAN_RULES:
        raise GoldenError(f"nan_rule: expected one of {NAN_RULES}, got {nan_rule!r}")
    fmt = get_format(fmt_name) if fmt_name else None
    diff = bits_view(expected) != bits_view(got)
    if nan_rule == "exact":
        return diff
    both_nan = _nan_mask(expected, fmt) & _nan_mask(got, fmt)
    if nan_rule == "sign":
        both_nan &= sign_bit(expected, fmt) == sign_bit(got, fmt)
    return diff & ~both_nan


def mismatches(op, case: str, params: Mapping, inputs: Mapping[str, np.ndarray], output: str,
               expected: np.ndarray, got: np.ndarray, nan_rule: str, *, excused: np.ndarray | None = None,
               bound_used: np.ndarray | None = None) -> list[Mismatch]:
    """Every differing element as a Mismatch, simplest counterexample first. ``excused``
    (a mask) leaves out elements a declared comparison rule accepts; ``bound_used`` (per
    element) is carried into each Mismatch."""
    fmt_name = op.output_format(params, output)
    fmt = get_format(fmt_name) if fmt_name else None
    mask = differing(expected, got, fmt_name, nan_rule)
    if excused is not None:
        mask &= ~excused
    if not mask.any():
        return []
    idx = np.argwhere(mask)
    e, g = expected[mask], got[mask]
    nan = _nan_mask(e, fmt) | _nan_mask(g, fmt)
    dist = np.abs(ordinal(e, fmt) - ordinal(g, fmt))
    both_nan = _nan_mask(e, fmt) & _nan_mask(g, fmt)
    tags = op.tags(params, inputs, mask, g) if hasattr(op, "tags") else [()] * len(e)
    out = []
    for k, index in enumerate(map(tuple, idx.tolist())):
        element = op.element_inputs(params, inputs, index)
        tags_k = (*tags[k], "nan-code") if both_nan[k] else tags[k]
        used = None if bound_used is None else float(bound_used[index])
        out.append(Mismatch(case, op.name, params, output, index, element, e[k], g[k],
                            None if nan[k] else int(dist[k]), tags_k, used))
    key = getattr(op, "simplicity", None)
    return sorted(out, key=(lambda m: key(params, m.inputs)) if key else (lambda m: m.index))


def ulp_distance(expected: np.ndarray, got: np.ndarray, fmt_name: str | None = None) -> np.ndarray:
    """Steps between expected and got on the output's own grid (meaningless where NaN is involved)."""
    fmt = get_format(fmt_name) if fmt_name else None
    return np.abs(ordinal(expected, fmt) - ordinal(got, fmt))


# --- results ---------------------------------------------------------------------------------
@dataclass
class CaseResult:
    """The outcome of one case against one implementation."""

    case: str
    op: str
    params: dict
    elements: int = 0
    mismatches: list[Mismatch] = field(default_factory=list)
    status: str = "compared"  # compared | not-implemented | error | missing
    reason: str = ""
    rule: str = "bit-exact"  # or "fp32-order bound"
    in_bound: int = 0  # elements that differ from the exact result but lie inside the bound
    in_bound_max_ulp: int | None = None
    max_bound_used: float | None = None  # over every element in the bound's domain
    tensors: dict | None = None  # a failing case's inputs, expected and got (run(keep_failing=True))


def bound_reason(op: str, params) -> str | None:
    """None when an unspecified accumulation order is judged by the fp32-order bound for this
    case, else why it cannot be (such a case is not implemented in a live run, bit-exact in a check)."""
    if hasattr(OPERATIONS.get(op), "bound_applies"):  # an operation with its own order rule (attention)
        return OPERATIONS[op].bound_applies(params)
    if op != "scaled_mm":
        return f"an unspecified accumulation order is judged for scaled_mm and attention only, not {op}"
    return bound_applies(params)


def exact_params(params: Mapping) -> dict:
    """The case's parameters for fp8ref's exact result, which the fp32-order bound is centred on."""
    return dict(params, accumulate="exact", scale_order="epilogue")


def judge_output(result: CaseResult, op, case: str, params: Mapping, inputs: Mapping[str, np.ndarray],
                 output: str, expected: np.ndarray, got, nan_rule: str, *, bounded: bool = False,
                 label: str | None = None) -> None:
    """Judge one output of one case into ``result``: OutputError (naming ``label``, default the
    output) for a wrong dtype or shape, else the element count and every mismatch. ``bounded``:
    ``expected`` is fp8ref's exact result and elements inside the fp32-order bound count as in
    bound, never as matches."""
    fmt = op.output_format(params, output)
    got = check_output(label or output, expected, got, fmt)
    result.elements += expected.size
    excused = used = None
    if bounded:
        j = (op.bound_judge if hasattr(op, "bound_judge") else bound_judge)(params, inputs, got)
        excused, used = differing(expected, got, fmt, nan_rule) & j["within"], j["used"]
        _record_bound(result, excused, used, ulp_distance(expected, got, fmt))
    result.mismatches += mismatches(op, case, params, inputs, output, expected, got, nan_rule,
                                    excused=excused, bound_used=used)


# --- the fp32-order bound ----------------------------------------------------------------------
U32 = Fraction(1, 2 ** 24)
_MIN_PRODUCT = 2.0 ** -125  # nonzero fp32 products at or above this stay normal after rounding
_MIN_OPERAND = 2.0 ** -126  # fp32's smallest normal
_MAX = 2.0 ** 127  # below fp32's overflow threshold with room for every rounding


def gamma(n: int) -> float:
    """gamma_n = n u / (1 - n u) for fp32, as the float64 just above it (never below)."""
    g = n * U32 / (1 - n * U32)
    f = float(g)
    return f if Fraction(f) >= g else float(np.nextafter(f, np.inf))


def _out_round(v: np.ndarray, out_dtype: str) -> np.ndarray:
    """r(v): RNE to fp32, then RNE to out_dtype (both monotone), as float64."""
    return round_to(round_to(v, "float32"), out_dtype).astype(np.float64)


def bound_applies(params) -> str | None:
    """None when the rule can judge this scaled_mm case, else why not."""
    if params.get("accumulate") != "fp32":
        return f"the fp32-order bound covers accumulate='fp32' only, not {params.get('accumulate')!r}"
    if params.get("scales") not in ("tensor", "row", *BLOCK_SCALES):
        return (f"the fp32-order bound covers tensor, row, block16 and block32 scales only, "
                f"not {params.get('scales')!r}")
    if params.get("out_dtype") not in _GRID:
        return f"the fp32-order bound covers float outputs only, not {params.get('out_dtype')!r} codes"
    return None


def bound_interval(params, inputs) -> dict[str, np.ndarray]:
    """Per output element: the exact value ``x`` (float64, within the slack below), the
    bound ``err`` (E plus that slack), the allowed output interval [lo, hi] (on the
    out_dtype grid, as float64) and ``domain`` (True where the bound's preconditions hold)."""
    if params.get("scales") in BLOCK_SCALES:
        return _block_bound_interval(params, inputs)
    fmt = params["format"]
    a = codec.decode(inputs["a"], fmt).astype(np.float64)
    b = codec.decode(inputs["b"], fmt).astype(np.float64)
    K = a.shape[1]
    sa = np.asarray(inputs["scale_a"], np.float32).astype(np.float64).reshape(-1, 1)  # (1,1) or (M,1)
    sb = np.asarray(inputs["scale_b"], np.float32).astype(np.float64).reshape(1, -1)  # (1,1) or (1,N)
    finite_a, finite_b = np.isfinite(a).all(axis=1), np.isfinite(b).all(axis=0)
    a, b = np.where(np.isfinite(a), a, 0.0), np.where(np.isfinite(b), b, 0.0)
    s = sa * sb  # exact: two 24-bit significands
    ints = a @ b  # exact for e4m3 up to K = 2**17 (docs/matmul.md); else within the slack below
    absdot = np.abs(a) @ np.abs(b)
    bias = inputs.get("bias")
    bias64 = np.zeros((1, b.shape[1])) if bias is None else np.asarray(bias).astype(np.float64).reshape(1, -1)
    finite_bias = np.isfinite(bias64)
    bias64 = np.where(finite_bias, bias64, 0.0)
    x = s * ints + bias64
    mag = np.abs(s) * absdot
    # every float64 step above and below (at most K + 8 of them, each within 2**-53 of the
    # magnitudes involved) is covered 8 times over by this slack
    slack = (K + 8) * 2.0 ** -50 * (mag + np.abs(bias64))
    # K * 2**-149: a fused multiply-add whose result is subnormal rounds by up to 2**-150,
    # absolutely (products stay normal in the domain; plain additions there are exact)
    err = gamma(K + 2) * mag * (1 + 2.0 ** -40) + slack + K * 2.0 ** -149
    lo, hi = _out_round(x - err, params["out_dtype"]), _out_round(x + err, params["out_dtype"])
    # domain: no fp32 underflow (nonzero scaled operands, products and, for the epilogue
    # order, the scale product and the smallest nonzero scaled partial sum stay normal) and no
    # overflow anywhere (every partial sum is at most (1 + gamma) * mag)
    alpha, beta = np.abs(a) * sa, np.abs(b) * sb
    row_ok = finite_a & ((alpha == 0) | ((alpha >= _MIN_OPERAND) & (alpha <= _MAX))).all(axis=1)
    col_ok = finite_b & ((beta == 0) | ((beta >= _MIN_OPERAND) & (beta <= _MAX))).all(axis=0)
    amin = np.where(alpha > 0, alpha, np.inf).min(axis=1, keepdims=True)
    bmin = np.where(beta > 0, beta, np.inf).min(axis=0, keepdims=True)
    domain = row_ok[:, None] & col_ok[None, :] & finite_bias & (amin * bmin >= _MIN_PRODUCT)
    domain &= 2 * (mag + np.abs(bias64)) <= _MAX
    if params.get("scale_order") == "epilogue":
        tiny = get_format(fmt).min_positive ** 2  # the grid every partial sum of products lies on
        domain &= (s >= _MIN_PRODUCT) & (s * tiny >= _MIN_PRODUCT)
    return {"x": x, "err": err, "lo": lo, "hi": hi, "domain": np.broadcast_to(domain, x.shape)}


def _block_bound_interval(params, inputs) -> dict[str, np.ndarray]:
    """``bound_interval`` of a block16 / block32 case: x = alpha * sum_k (a_k sa) (b_k sb) + bias with
    the scales of k's block, E = gamma_{K+4} * |alpha| * sum_k |a_k sa b_k sb| (each term passes at
    most three roundings of products (a scaled operand or block scale product, the product, alpha)
    and K - 1 additions, and the bias one), over the domain of both fp32 orders (operands scaled first;
    per-block sums scaled in the epilogue)."""
    block = BLOCK_SCALES[params["scales"]][0]
    fmt = params["format"]
    a = codec.decode(inputs["a"], fmt).astype(np.float64)
    b = codec.decode(inputs["b"], fmt).astype(np.float64)
    K = a.shape[1]
    sa = np.asarray(inputs["scale_a"], np.float32).astype(np.float64)  # (M, KB)
    sb = np.asarray(inputs["scale_b"], np.float32).astype(np.float64)  # (KB, N)
    g = float(np.asarray(inputs["alpha"], np.float32).reshape(-1)[0]) if "alpha" in inputs else 1.0
    finite_a, finite_b = np.isfinite(a).all(axis=1), np.isfinite(b).all(axis=0)
    a, b = np.where(np.isfinite(a), a, 0.0), np.where(np.isfinite(b), b, 0.0)
    A = a * np.repeat(sa, block, axis=1)[:, :K]  # exact: few-bit significands in float64's range
    B = b * np.repeat(sb, block, axis=0)[:K]
    bias = inputs.get("bias")
    bias64 = np.zeros((1, b.shape[1])) if bias is None else np.asarray(bias).astype(np.float64).reshape(1, -1)
    finite_bias = np.isfinite(bias64)
    bias64 = np.where(finite_bias, bias64, 0.0)
    x = g * (A @ B) + bias64
    mag = g * (np.abs(A) @ np.abs(B))
    slack = (K + 8) * 2.0 ** -50 * (mag + np.abs(bias64))
    err = gamma(K + 4) * mag * (1 + 2.0 ** -40) + slack + (K + 4) * 2.0 ** -149
    lo, hi = _out_round(x - err, params["out_dtype"]), _out_round(x + err, params["out_dtype"])
    # domain: scaled operands, their products, block-scale products, the smallest nonzero scaled partial
    # sum and each times alpha stay normal; nothing can overflow (alpha < 1 shrinks, > 1 grows the sums)
    absA, absB = np.abs(A), np.abs(B)
    row_ok = finite_a & ((absA == 0) | ((absA >= _MIN_OPERAND) & (absA <= _MAX))).all(axis=1)
    col_ok = finite_b & ((absB == 0) | ((absB >= _MIN_OPERAND) & (absB <= _MAX))).all(axis=0)
    amin = np.where(absA > 0, absA, np.inf).min(axis=1, keepdims=True)
    bmin = np.where(absB > 0, absB, np.inf).min(axis=0, keepdims=True)
    s = sa[:, :, None] * sb[None, :, :]  # (M, KB, N) block scale products
    tiny = get_format(fmt).min_positive ** 2
    scales_ok = ((s * tiny * min(g, 1.0) >= _MIN_PRODUCT) & (s <= _MAX)).all(axis=1)
    domain = row_ok[:, None] & col_ok[None, :] & finite_bias & (amin * bmin * min(g, 1.0) >= _MIN_PRODUCT)
    domain &= scales_ok & (2 * max(g, 1.0) * (np.abs(A) @ np.abs(B) + np.abs(bias64)) <= _MAX)
    return {"x": x, "err": err, "lo": lo, "hi": hi, "domain": np.broadcast_to(domain, x.shape)}


_GRID = {"float32": (24, -126), "bfloat16": (8, -126), "float16": (11, -14)}  # precision, emin


def _half_gap(g: np.ndarray, away: np.ndarray, out_dtype: str) -> np.ndarray:
    """Half the distance from g to its neighbour on the out_dtype grid, toward larger
    magnitude where ``away``, else toward zero: g's rounding boundary on that side."""
    p, emin = _GRID[out_dtype]
    a = np.abs(g)
    _, e = np.frexp(np.where(np.isfinite(a) & (a > 0), a, 1.0))
    exp = np.where(a > 0, np.maximum(e - 1, emin), emin)
    ulp = np.ldexp(1.0, exp - p + 1)
    power_of_two = (a == np.ldexp(1.0, exp)) & (exp > emin)
    return np.where(~away & power_of_two, ulp / 2, ulp) / 2


def bound_judge(params, inputs, got: np.ndarray) -> dict[str, np.ndarray]:
    """``within``: got lies in [r(x - E), r(x + E)] and the element is in the domain (the
    verdict). ``used``: how much of E got needs, as a fraction: the distance from x to got's
    rounding interval on the out_dtype grid, over E (0 when got is x correctly rounded, about
    1 at the edge of the bound; a diagnostic, exact up to where a tie or the fp32-then-
    out_dtype rounding puts that interval's end; NaN outside the domain or for a NaN got)."""
    iv = bound_interval(params, inputs)
    out_dtype = params["out_dtype"]
    g = got.astype(np.float64)
    x, lo, hi = iv["x"], iv["lo"], iv["hi"]
    within = iv["domain"] & (g >= lo) & (g <= hi)
    above = g > x  # got's interval starts below it, toward x
    p, _ = _GRID[out_dtype]
    fmax = float(np.finfo(np.float32).max) if out_dtype == "float32" else (
        65504.0 if out_dtype == "float16" else float(np.ldexp(2.0 - 2.0 ** (1 - p), 127)))
    gf = np.where(np.isinf(g), np.copysign(fmax, g), g)
    edge = np.where(np.isinf(g), np.copysign(fmax + _half_gap(np.array(fmax), np.array(True), out_dtype), g),
                    gf - np.where(above, 1, -1) * _half_gap(gf, above != (gf > 0), out_dtype))
    dist = np.where(above, np.maximum(edge - x, 0.0), np.maximum(x - edge, 0.0))
    err = iv["err"]
    with np.errstate(divide="ignore", invalid="ignore"):
        used = np.where(dist == 0, 0.0, dist / err)
    used = np.where(iv["domain"] & ~np.isnan(g), used, np.nan)
    return {"within": within, "used": used}


def _record_bound(result: CaseResult, excused: np.ndarray, used: np.ndarray,
                  ulp: np.ndarray) -> None:
    """Add one output's in-bound counts to a CaseResult: elements that differ from the exact result
    but lie inside the bound, the largest ULP among them, and the largest fraction of the bound used."""
    result.in_bound += int(excused.sum())
    if excused.any():
        result.in_bound_max_ulp = max(int(ulp[excused].max()), result.in_bound_max_ulp or 0)
    finite = used[~np.isnan(used)]
    if finite.size:
        top = float(finite.max())
        result.max_bound_used = top if result.max_bound_used is None else max(top, result.max_bound_used)
