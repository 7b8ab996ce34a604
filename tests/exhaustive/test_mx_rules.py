"""The E8M0 scale rules by name (``fp8ref.scaling.MX_SCALE_RULES``) against an independent
Fraction/integer oracle, over every float32 exponent field and the mantissa classes that sit on
or next to each rule's boundary (significand 1, 1.5, 1.75, 1.9375 and their neighbours), for E2M1,
E2M3, E4M3 and E5M2 elements; plus the mismatch rates between rules (docs/quantize.md), and
compressed-tensors 0.20.1's ``round_to_power_2`` transcribed on the bits for every bfloat16 amax."""

from __future__ import annotations

import struct
from fractions import Fraction

import numpy as np
import pytest

from fp8ref.formats import FORMATS
from fp8ref.scaling import MX_SCALE_RULES, mx_scale_exponent

MANTISSAS = (0, 1, 0x3FFFFF, 0x400000, 0x400001, 0x5FFFFF, 0x600000, 0x600001, 0x7FFFFE, 0x7FFFFF, 0x2AAAAB,
             0x77FFFF, 0x780000, 0x780001)  # 0x780000: significand 1.9375, E2M3's round_to_power_2 boundary
ELEMENTS = ("float4_e2m1fn", "float6_e2m3fn", "float8_e4m3fn", "float8_e5m2")


def _f32(field: int, mantissa: int) -> float:
    return struct.unpack("<f", struct.pack("<I", (field << 23) | mantissa))[0]


def _floor_log2(a: Fraction) -> int:
    e = a.numerator.bit_length() - a.denominator.bit_length()
    return e if Fraction(2) ** e <= a else e - 1


def _round_f32(x: Fraction) -> Fraction:
    """x > 0 rounded to the nearest float32 (ties to even), subnormals included (exact integers)."""
    ulp = Fraction(2) ** (max(_floor_log2(x), -126) - 23)
    q = int(x // ulp)
    rem = x - q * ulp
    q += rem * 2 > ulp or (rem * 2 == ulp and q % 2 == 1)
    return q * ulp


def _oracle(a: float, rule: str, emax: int, max_elem: Fraction, ct_threshold: Fraction = Fraction(7, 4),
            mbits: int = 1) -> int:
    """The unbiased exponent, read from the rules' definitions with exact arithmetic (``ct_threshold``:
    the significand at which compressed-tensors' round_to_power_2 rounds up for the element type)."""
    if a != a or a in (float("inf"), float("-inf")):
        return 128
    if a == 0:
        return -127
    x = Fraction(a)
    fl = _floor_log2(x)
    if rule in ("floor", "ocp-floor"):
        k = fl - emax
    elif rule in ("even", "ct-round-to-power-2"):  # round up iff the significand is >= 1.75 (CT E2M3: 1.9375)
        threshold = ct_threshold if rule == "ct-round-to-power-2" else Fraction(7, 4)
        k = fl + (x >= threshold * Fraction(2) ** fl) - emax
    elif rule == "round-up":  # d = float32(amax / max_elem) (RNE); the smallest 2**k >= d, at least 2**-126
        d = _round_f32(x / max_elem)
        if d == 0:
            return -127
        k = _floor_log2(d)
        k = max(-126, k + (Fraction(2) ** k != d))
    elif rule == "torchao-ceil":  # ceil(log2 amax) - emax
        k = fl + (x != Fraction(2) ** fl) - emax
    elif rule == "torchao-even":  # round up iff the significand is >= 2 - 2**-(m + 1), m the element's mantissa bits
        k = fl + (x >= (2 - Fraction(1, 2 ** (mbits + 1))) * Fraction(2) ** fl) - emax
    elif rule == "torchao-rceil":  # ceil of float32 log2 of d = float32(amax / max_elem)
        d = _round_f32(x / max_elem)
        if d == 0:
            return -127
        k = _floor_log2(d)
        k += Fraction(2) ** k != d and not _log2f_stays(d, k)
    elif rule == "log2f-floor":  # floorf of log2(amax) rounded to float32: fl + 1 when that rounding reaches it
        k = fl + _log2f_reaches(x, fl + 1) - emax
    else:  # rceil: the smallest k with 2**k * max_elem >= amax
        r = x / max_elem
        k = _floor_log2(r)
        k += Fraction(2) ** k != r
    return max(-127, min(127, k))


def _log2f_reaches(x: Fraction, n: int) -> bool:
    """Does log2(x) = n + d (d < 0, x < 2**n) round to the float32 n (ties to n: its last bit is 0)?
    d = log1p(x / 2**n - 1) / ln 2 in double (x / 2**n - 1 is exact); the float32 neighbours of n
    on d's side are half an ulp away: ulp(n) / 2 below a positive n (a quarter below a power of two),
    ulp(|n|) / 2 above |n| for n < 0; n = 0 is never reached (float32 holds a tiny d)."""
    import math

    if n == 0:
        return False
    d = math.log1p(float(x / Fraction(2) ** n - 1)) / math.log(2)
    m = abs(n).bit_length() - 1  # floor(log2 |n|)
    half = 2.0 ** (m - 24) if n > 0 and n & (n - 1) else 2.0 ** (m - 24 - (n > 0))
    return -d <= half


def _log2f_stays(x: Fraction, n: int) -> bool:
    """Does log2(x) = n + d (d > 0, 2**n < x) round to the float32 n? d = log1p(x / 2**n - 1) / ln 2 in
    double; the float32 neighbour of n on d's side is ulp(n) above a positive n, ulp(|n|) above a
    negative one (half that where |n| is a power of two, the binade below); ties go to n (even)."""
    import math

    if n == 0:
        return False
    d = math.log1p(float(x / Fraction(2) ** n - 1)) / math.log(2)
    m = abs(n).bit_length() - 1
    half = 2.0 ** (m - 24) if n > 0 or abs(n) & (abs(n) - 1) else 2.0 ** (m - 25)
    return d <= half


AMAX = [_f32(f, m) for f in range(255) for m in MANTISSAS] + [float("inf"), float("nan")]


@pytest.mark.parametrize("rule", MX_SCALE_RULES)
@pytest.mark.parametrize("elem", ELEMENTS)
def test_rule_matches_the_oracle_on_every_boundary_class(rule, elem):
    fmt = FORMATS[elem]
    got = mx_scale_exponent(np.array(AMAX, np.float64), fmt, rule)
    # compressed-tensors 0.20.1 generate_mx_scales: elem_mantissa 3 for 6 bits, E2M1's 1 otherwise
    threshold = Fraction(31, 16) if elem == "float6_e2m3fn" else Fraction(7, 4)
    want = [_oracle(a, rule, fmt.emax, Fraction(float(fmt.max)), threshold, fmt.mantissa_bits) for a in AMAX]
    bad = [(a.hex(), int(g), w) for a, g, w in zip(AMAX, got, want) if g != w]
    assert not bad, bad[:5]


def test_the_oracle_tells_the_rules_apart():
    """Each pair of distinct rules disagrees somewhere on the grid (so the test above can fail)."""
    fmt = FORMATS["float4_e2m1fn"]
    rows = {r: [_oracle(a, r, fmt.emax, Fraction(6)) for a in AMAX] for r in ("ocp-floor", "even", "rceil")}
    assert rows["ocp-floor"] != rows["even"] != rows["rceil"] != rows["ocp-floor"]


@pytest.mark.parametrize("elem,pair,rate", [
    ("float4_e2m1fn", ("ocp-floor", "even"), 1024), ("float8_e4m3fn", ("ocp-floor", "even"), 1024),
    ("float4_e2m1fn", ("rceil", "ocp-floor"), 2047), ("float8_e4m3fn", ("rceil", "ocp-floor"), 1023),
    ("float4_e2m1fn", ("rceil", "even"), 1023), ("float8_e4m3fn", ("rceil", "even"), 1),
    ("float4_e2m1fn", ("even", "ct-round-to-power-2"), 0), ("float8_e4m3fn", ("floor", "ocp-floor"), 0),
])
def test_mismatch_rates_between_rules_over_a_uniform_binade(elem, pair, rate):
    """Of the 4096 significands 1 + i/4096 (one binade): ocp-floor vs even differ on [1.75, 2);
    rceil vs ocp-floor above max_elem's significand (1.5 for E2M1, 1.75 for E4M3); rceil vs even
    on (1.5, 1.75) for E2M1 and at 1.75 alone for E4M3."""
    amax = 1.0 + np.arange(4096) / 4096.0
    fmt = FORMATS[elem]
    a, b = (mx_scale_exponent(amax, fmt, r) for r in pair)
    assert int((a != b).sum()) == rate


@pytest.mark.parametrize("elem,elem_mantissa", [("float6_e2m3fn", 3), ("float4_e2m1fn", 1), ("float8_e4m3fn", 1)])
def test_ct_round_to_power_2_transcribed_on_every_bfloat16(elem, elem_mantissa):
    """compressed-tensors 0.20.1 quantization/utils/mxfp_utils.py, step by step on bfloat16 bits:
    round_to_power_2 adds 1 << (7 - elem_mantissa - 1) and masks sign and exponent, generate_mx_scales
    takes 127 + floor(log2) - offset (offset = floor(log2(max_elem)) = 2, 2, 8); every positive finite
    bfloat16 amax whose result is a normal exponent."""
    bits = np.arange(0x0001, 0x7F80, dtype=np.int32)  # positive finite bfloat16 (subnormals included)
    p2 = (bits + (1 << (7 - elem_mantissa - 1))) & (0x1FF << 7)  # uint16 arithmetic: no sign carry below inf
    amax = (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    offset = {"float6_e2m3fn": 2, "float4_e2m1fn": 2, "float8_e4m3fn": 8}[elem]
    field = p2 >> 7
    ct = np.where(field == 0, -127, field - 127 - offset)  # log2(0) = -inf: the zero block's byte 0
    ok = (field > 0) & (field < 255) & (field - 127 - offset >= -127)
    got = mx_scale_exponent(amax, FORMATS[elem], "ct-round-to-power-2")
    assert np.array_equal(got[ok], ct[ok])
    assert ok.sum() > 30000
