"""Slow, exact, scalar reference codec written from the definitions (docs/codec.md).

Shares no code with fp8ref: it reads only the parameters of a FloatFormat (exponent_bits,
mantissa_bits, bias, specials, signed, has_zero) and derives everything else itself, so the
derived constants in fp8ref/formats.py are checked too (see ``Grid.derived``).

Design (deliberately unlike bit manipulation): list every finite magnitude of the format as a
Fraction, in code order, add the first grid point above max (the grid continues with an
unbounded exponent), and bisect. Any magnitude at or beyond that extra point rounds to a grid
point above max in every mode, so the overflow rules alone decide it.

Speed: every value of an at-most-8-bit format with |bias| <= 900 and every midpoint between
neighbours is exact in float64 (checked when the table is built), so bisecting the float copy
of the table is an exact comparison for float inputs; Fractions are used where a quotient is
needed (stochastic rounding).
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from fractions import Fraction
from functools import cache

MODES = ("rne", "rna", "rtz", "rup", "rdown", "rto", "stochastic")
DETERMINISTIC = MODES[:-1]


class NotRepresentable(ValueError):
    """The contract says this input must raise (NaN, or Inf without saturation, in a 'none' format)."""


@dataclass(frozen=True)
class Grid:
    """Everything the oracle derives from one format's parameters."""

    sign_mask: int
    nan_code: int | None
    inf_code: int | None
    max_code: int
    has_negative_zero: bool
    mags: tuple            # Fraction magnitudes of finite codes 0..max_code, then one extra point
    keys: tuple            # the same as floats (exact)
    mids: tuple            # float midpoints between consecutive entries of keys (exact)

    @property
    def derived(self) -> dict:
        return {"sign_mask": self.sign_mask, "nan_code": self.nan_code, "inf_code": self.inf_code,
                "max_code": self.max_code, "has_negative_zero": self.has_negative_zero}


def _value_of_magnitude_code(c: int, m: int, bias: int, has_zero: bool) -> Fraction:
    """Definition: field e > 0 (or no zero): 2**(e-bias) * (1 + f/2**M); e = 0: 2**(1-bias) * f/2**M."""
    e, f = c >> m, c & ((1 << m) - 1)
    if e == 0 and has_zero:
        return Fraction(f, 1 << m) * Fraction(2) ** (1 - bias)
    return (1 + Fraction(f, 1 << m)) * Fraction(2) ** (e - bias)


def _is_special(mag_code: int, fmt) -> str | None:
    """'nan', 'inf' or None for a magnitude code (sign bit removed), from the specials style."""
    E, M = fmt.exponent_bits, fmt.mantissa_bits
    all_ones = (1 << (E + M)) - 1
    if fmt.specials == "ieee" and mag_code >> M == (1 << E) - 1:
        return "inf" if mag_code & ((1 << M) - 1) == 0 else "nan"
    if fmt.specials == "fn" and mag_code == all_ones:
        return "nan"
    if fmt.specials == "p3109" and mag_code == all_ones:
        return "inf"
    return None


def _key(fmt) -> tuple:
    return (fmt.exponent_bits, fmt.mantissa_bits, fmt.bias, fmt.specials, fmt.signed, fmt.has_zero)


@cache
def _grid(key: tuple) -> Grid:
    E, M, bias, specials, signed, has_zero = key
    fmt = _Params(E, M, bias, specials, signed, has_zero)
    sign_mask = (1 << (E + M)) if signed else 0
    mags, max_code = [], -1
    for c in range(1 << (E + M)):
        if _is_special(c, fmt) is not None:
            break  # specials sit at the top of the magnitude codes
        mags.append(_value_of_magnitude_code(c, M, bias, has_zero))
        max_code = c
    # fnuz: the negative-zero code is the only NaN; all magnitude codes stay finite.
    mags.append(_value_of_magnitude_code(max_code + 1, M, bias, has_zero))  # grid continues
    assert all(a < b for a, b in zip(mags, mags[1:])), "magnitudes must increase with the code"
    keys = tuple(float(v) for v in mags)
    mids = tuple((a + b) / 2 for a, b in zip(keys, keys[1:]))
    assert all(Fraction(k) == v for k, v in zip(keys, mags)), "table must be exact in float64"
    assert all(Fraction(mid) == (a + b) / 2 for mid, a, b in zip(mids, mags, mags[1:])), "midpoints exact"
    if specials == "ieee":
        inf_code = ((1 << E) - 1) << M
        nan_code = inf_code | (1 << (M - 1))
    elif specials == "p3109":  # P3109 extended: +-Inf at 0x7F/0xFF, the one NaN at 0x80
        inf_code, nan_code = (1 << (E + M)) - 1, sign_mask
    else:
        inf_code = None
        nan_code = {"fn": (1 << (E + M)) - 1, "fnuz": sign_mask, "none": None}[specials]
    return Grid(sign_mask, nan_code, inf_code, max_code, signed and has_zero and specials not in ("fnuz", "p3109"),
                tuple(mags), keys, mids)


@dataclass(frozen=True)
class _Params:
    exponent_bits: int
    mantissa_bits: int
    bias: int
    specials: str
    signed: bool
    has_zero: bool


def grid(fmt) -> Grid:
    return _grid(_key(fmt))


# --- decode -------------------------------------------------------------------------------
def decode(code: int, fmt):
    """Exact value of a code: a Fraction, +-math.inf, or None for NaN. (-0 decodes to Fraction 0.)"""
    g = grid(fmt)
    bits = int(fmt.signed) + fmt.exponent_bits + fmt.mantissa_bits
    if not 0 <= code < (1 << bits):
        raise ValueError(f"code {code} out of range for {bits} bits")
    negative = bool(code & g.sign_mask)
    mag = code & ~g.sign_mask
    if fmt.specials in ("fnuz", "p3109") and code == g.sign_mask:
        return None
    kind = _is_special(mag, fmt)
    if kind == "nan":
        return None
    if kind == "inf":
        return -math.inf if negative else math.inf
    v = _value_of_magnitude_code(mag, fmt.mantissa_bits, fmt.bias, fmt.has_zero)
    return -v if negative else v


def decode_float(code: int, fmt) -> float:
    """``decode`` as a Python float carrying the contract's signs: -0.0 for the negative-zero code,
    NaN negative only for signed 'fn'/'ieee' NaN codes with the sign bit set."""
    v = decode(code, fmt)
    negative = bool(code & grid(fmt).sign_mask)
    if v is None:
        return math.copysign(math.nan, -1.0 if negative and fmt.specials in ("fn", "ieee") else 1.0)
    if v == 0:
        return -0.0 if negative else 0.0
    return float(v)


# --- encode -------------------------------------------------------------------------------
def locate(value, fmt) -> tuple:
    """Classify an input; the result (hashable) decides every deterministic mode.

    ('nan', neg) | ('inf', neg) | ('zero', neg) | ('below_min', neg) for formats without zero |
    ('exact', neg, i) | ('between', neg, i, rel) with mags[i] < |x| < mags[i+1], rel = -1/0/+1 for
    below/at/above the midpoint | ('beyond', neg) for |x| above the first point past max.
    """
    if isinstance(value, float):
        if math.isnan(value):
            return ("nan", math.copysign(1.0, value) < 0)
        neg = math.copysign(1.0, value) < 0
        if math.isinf(value):
            return ("inf", neg)
        mag = -value if neg else value
    else:
        value = Fraction(value)
        neg = value < 0
        mag = float(abs(value))
        if Fraction(mag) != abs(value):
            raise ValueError("oracle inputs must be exact in float64")
    if mag == 0:
        return ("zero", neg)
    g = grid(fmt)
    i = bisect.bisect_left(g.keys, mag)
    if i < len(g.keys) and g.keys[i] == mag:
        return ("beyond", neg) if i == len(g.keys) - 1 else ("exact", neg, i)
    if i == len(g.keys):
        return ("beyond", neg)
    if i == 0:  # below the smallest entry: only formats without zero
        return ("below_min", neg)
    mid = g.mids[i - 1]
    return ("between", neg, i - 1, (mag > mid) - (mag < mid))


def encode(value, fmt, saturate: bool = True, rounding: str = "rne",
           random_bits: int | None = None, n_bits: int | None = None) -> int:
    """The code fp8ref must produce for one value (a float, incl. nan/inf/-0.0, or a Fraction)."""
    if rounding not in MODES:
        raise ValueError(f"unknown rounding {rounding!r}")
    if (rounding == "stochastic") != (random_bits is not None):
        raise ValueError("random_bits is required for, and only for, stochastic rounding")
    if rounding == "stochastic" and not (n_bits and 0 <= random_bits < (1 << n_bits)):
        raise ValueError("random_bits must be an n_bits-bit unsigned integer")
    case = locate(value, fmt)
    if case[0] == "between" and rounding == "stochastic" and (fmt.signed or not case[1]):
        g = grid(fmt)
        i = case[2]
        lo, hi = g.mags[i], g.mags[i + 1]
        d = (abs(Fraction(value)) - lo) / (hi - lo)
        up = math.floor(d * (1 << n_bits)) + random_bits >= (1 << n_bits)
        return _finish(case[1], i + up, fmt, saturate, rounding)
    return decide(case, fmt, saturate, rounding)


def decide(case: tuple, fmt, saturate: bool, rounding: str) -> int:
    """The code for a ``locate`` result under a deterministic mode (stochastic: exact cases only)."""
    g = grid(fmt)
    kind, neg = case[0], case[1]
    sign = g.sign_mask if neg else 0
    if kind == "nan":
        if g.nan_code is None:
            raise NotRepresentable("NaN has no code in this format")
        return g.nan_code | (sign if fmt.specials == "fn" or fmt.specials == "ieee" else 0)
    if neg and not fmt.signed and kind != "zero":
        return g.nan_code  # unsigned: negative nonzero and -Inf are NaN
    if kind == "inf":
        if fmt.specials == "none" and not saturate:
            raise NotRepresentable("Inf without saturation has no code in this format")
        return _overflow(neg, fmt, saturate, "rne")  # Inf behaves as an rne overflow in every mode
    if kind == "zero":
        if not fmt.has_zero:
            return 0 if saturate else g.nan_code
        return sign if g.has_negative_zero else 0
    if kind == "below_min":  # nothing smaller exists: the minimum, keeping a sign where signed
        return g.sign_mask if neg else 0
    if kind == "beyond":
        return _finish(neg, g.max_code + 1, fmt, saturate, rounding)
    i = case[2]
    if kind == "exact":
        return _finish(neg, i, fmt, saturate, rounding)
    rel = case[3]
    # i and i+1 are consecutive codes; the index is the magnitude code.
    if rounding == "rne":
        up = rel > 0 or (rel == 0 and (i + 1) % 2 == 0)
    elif rounding == "rna":
        up = rel >= 0
    elif rounding == "rtz":
        up = False
    elif rounding == "rup":
        up = not neg
    elif rounding == "rdown":
        up = neg
    elif rounding == "rto":
        up = (i + 1) % 2 == 1
    else:
        raise ValueError("stochastic rounding of an inexact value needs encode()")
    return _finish(neg, i + up, fmt, saturate, rounding)


def _finish(neg: bool, mag_code: int, fmt, saturate: bool, rounding: str) -> int:
    g = grid(fmt)
    if mag_code > g.max_code:
        return _overflow(neg, fmt, saturate, rounding)
    if mag_code == 0 and fmt.has_zero and not g.has_negative_zero:
        return 0  # fnuz (0x80 is NaN) and unsigned formats have no -0
    return mag_code | (g.sign_mask if neg else 0)


def _overflow(neg: bool, fmt, saturate: bool, rounding: str) -> int:
    """Rounded magnitude above max (or an infinite input, which behaves like rne overflow)."""
    g = grid(fmt)
    sign = g.sign_mask if neg else 0
    to_max = g.max_code | sign
    if saturate:
        return to_max
    if rounding in ("rtz", "rto") or (rounding == "rup" and neg) or (rounding == "rdown" and not neg):
        return to_max
    if fmt.specials == "ieee":
        return g.inf_code | sign
    if fmt.specials == "fn":
        return g.nan_code | sign
    if fmt.specials == "fnuz":
        return g.nan_code
    if fmt.specials == "p3109":
        return g.inf_code | sign
    return to_max  # 'none': only a finite overflow reaches here (NaN/Inf inputs raise first)


def encode_table(values: list, fmt, modes=DETERMINISTIC, saturates=(True, False)) -> dict:
    """{(mode, saturate): list of codes, -1 where the contract says raise} for many float inputs.

    ``locate`` decides every deterministic mode, so ``encode`` runs once per distinct class.
    """
    classes: dict = {}
    index = [classes.setdefault(locate(v, fmt), len(classes)) for v in values]
    reps: list = [None] * len(classes)
    for v, k in zip(values, index):
        if reps[k] is None:
            reps[k] = v
    table = {}
    for mode in modes:
        for sat in saturates:
            per_class = []
            for v in reps:
                try:
                    per_class.append(encode(v, fmt, sat, mode))
                except NotRepresentable:
                    per_class.append(-1)
            table[mode, sat] = [per_class[k] for k in index]
    return table
