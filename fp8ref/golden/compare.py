"""Compare a backend's outputs with the expected ones, element by element.

Codes are compared as codes and floats as bit patterns (so -0.0 != +0.0), except NaN,
which follows an explicit equivalence rule because implementations legitimately differ in
NaN codes and payloads (REFERENCE 8.4):

``any``    every NaN equals every NaN (TestFloat's default);
``sign``   NaNs are equal when their sign bits are;
``exact``  NaNs are compared by their exact code / bit pattern.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from ..errors import GoldenError
from ..formats import FloatFormat, get_format

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
    # under the fp32-order bound (fp8ref.conformance.gemm_bound): the fraction of the allowed
    # distance from the exact value that got uses (> 1: outside; NaN: outside the bound's domain)
    bound_used: float | None = None


class OutputError(GoldenError):
    """A backend output with the wrong dtype or shape: the whole case fails."""


def _uint_view(a: np.ndarray) -> np.ndarray:
    width = a.dtype.itemsize
    return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[width])


def _nan_mask(a: np.ndarray, fmt: FloatFormat | None) -> np.ndarray:
    if fmt is not None:
        return np.isin(a, np.array(sorted(fmt.nan_codes), dtype=np.uint8))
    return np.isnan(a.astype(np.float64))


def _sign(a: np.ndarray, fmt: FloatFormat | None) -> np.ndarray:
    if fmt is not None:
        return (a & fmt.sign_mask) != 0
    bits = _uint_view(a).astype(np.uint64)
    return (bits >> np.uint64(a.dtype.itemsize * 8 - 1)) != 0


def ordinal(a: np.ndarray, fmt: FloatFormat | None) -> np.ndarray:
    """Position of each value on its grid (sign-magnitude -> signed integer), so that
    neighbouring values differ by 1 and +0 == -0; Inf sits one past the largest finite."""
    if fmt is not None:
        mag = (a & fmt.magnitude_mask).astype(np.int64)
    else:
        bits = _uint_view(a).astype(np.uint64)
        mag = (bits & ~(np.uint64(1) << np.uint64(a.dtype.itemsize * 8 - 1))).astype(np.int64)
    return np.where(_sign(a, fmt), -mag, mag)


def check_output(name: str, expected: np.ndarray, got, fmt: str | None) -> np.ndarray:
    """The backend output as a numpy array of the expected dtype and shape, or OutputError."""
    got = np.asarray(got)
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
    diff = _uint_view(expected) != _uint_view(got)
    if nan_rule == "exact":
        return diff
    both_nan = _nan_mask(expected, fmt) & _nan_mask(got, fmt)
    if nan_rule == "sign":
        both_nan &= _sign(expected, fmt) == _sign(got, fmt)
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
