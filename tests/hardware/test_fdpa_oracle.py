"""The instruction models against an independent Fraction oracle of the published rule (no
mmasim needed; default suite). The oracle is written from the papers' description, in exact
rational arithmetic, and shares nothing with fp8ref.hardware but the format definitions:
each term's exponent is the sum of its factors' exponents (floor(log2 |x|), at least the format's
minimum), zero terms take e_zero, every term is truncated at 2**(E - F) below the largest exponent
E, the exact sum is normalised (round toward zero to 23 / 13 fraction bits, or RNE to fp16).
CDNA3's pairwise FP8 datapath has its own oracle below."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest

from fp8ref.hardware import instruction, mma
from tests.support import mma_cases as cases

F32_MIN_E, F16_MIN_E = -126, -14


def _log2_floor(v: Fraction) -> int:
    v = abs(v)
    e = v.numerator.bit_length() - v.denominator.bit_length()
    if Fraction(2) ** e > v:
        e -= 1
    return e


def _exp(v: Fraction, emin: int) -> int:
    return max(_log2_floor(v), emin)


def _value(fmt, code: int, ignore_sign=False):
    if ignore_sign:
        code &= 0x7F
    return fmt.exact_value(int(code))


def _round(v: Fraction, fraction_bits: int, emin: int, mode: str) -> Fraction | float:
    if v == 0:
        return Fraction(0)
    ulp = Fraction(2) ** (_exp(v, emin) - fraction_bits)
    q = v / ulp
    n = int(q) if mode == "rz" else (math.floor(q) if mode == "floor" else round(q))
    return n * ulp


def _to_float(r: Fraction, acc: str) -> float:
    limit = 2.0 ** 128 if acc == "float32" else 2.0 ** 16
    if abs(r) >= limit:
        return math.copysign(math.inf, r)
    return float(r) + 0.0


def oracle_fused(ins, a, b, c, sa=None, sb=None) -> float | None:
    """One output element: a, b (K,) codes, c a float, sa/sb (K // block,) scale codes."""
    dp, fa, fb = ins.datapath, ins.a_fmt, ins.b_fmt
    c_emin = F32_MIN_E if ins.acc == "float32" else F16_MIN_E
    acc = Fraction(c) if math.isfinite(c) else None
    if acc is None:
        return None
    for i in range(0, len(a), dp.L):
        terms = []  # (value, exponent)
        if dp.family == "grouped":
            fs, ign = ins.scale_fmt, ins.scale_type == "ue4m3"
            for g in range(i, i + dp.L, dp.G):
                prods = [_value(fa, a[k]) * _value(fb, b[k]) for k in range(g, g + dp.G)]
                s1, s2 = _value(fs, sa[g // ins.block], ign), _value(fs, sb[g // ins.block], ign)
                if s1 is None or s2 is None:
                    return None
                zero = all(p == 0 for p in prods) or s1 * s2 == 0
                e = dp.e_zero if zero else _exp(s1, fs.emin) + _exp(s2, fs.emin)
                terms.append((sum(prods) * s1 * s2, e))
        else:
            for k in range(i, i + dp.L):
                x, y = _value(fa, a[k]), _value(fb, b[k])
                if x is None or y is None:
                    return None
                v, e = x * y, _exp(x, fa.emin) + _exp(y, fb.emin)
                if ins.scale_fmt is not None:
                    s1, s2 = _value(ins.scale_fmt, sa[k // ins.block]), _value(ins.scale_fmt, sb[k // ins.block])
                    if s1 is None or s2 is None:
                        return None
                    v, e = v * s1 * s2, e + _exp(s1, -127) + _exp(s2, -127)
                terms.append((v, e if v != 0 else dp.e_zero))
        terms.append((acc, _exp(acc, c_emin) if acc != 0 else dp.e_zero))
        E = max(e for _, e in terms)
        unit = Fraction(2) ** (E - dp.F)
        total = sum(int(v / unit) for v, _ in terms) * unit
        if dp.output == "rne-f16":
            r = _round(total, 10, F16_MIN_E, "rne")
        else:
            r = _round(total, 23 if dp.output == "rz-f32" else 13, F32_MIN_E, "rz")
        out = _to_float(r, ins.acc)
        if not math.isfinite(out):
            return out
        acc = Fraction(out)
    return float(acc)


def oracle_pairwise(ins, a, b, c) -> float | None:
    """CDNA3 FP8 MFMA: even and odd products fused apart (F = 24, truncation), combined by floor,
    added to C (product sum floored to F2 + 1 = 32 bits, C to 24, C dropped when more than 25
    binades below), the sum floored to 31 fraction bits, then rounded to nearest fp32."""
    dp, fa, fb = ins.datapath, ins.a_fmt, ins.b_fmt
    if not math.isfinite(c):
        return None
    acc = Fraction(c)
    for i in range(0, len(a), dp.L):
        halves = []
        for parity in (0, 1):
            terms = []
            for k in range(i + parity, i + dp.L, 2):
                x, y = _value(fa, a[k]), _value(fb, b[k])
                if x is None or y is None:
                    return None
                if x * y != 0:
                    terms.append((x * y, _exp(x, fa.emin) + _exp(y, fb.emin)))
            if not terms:
                halves.append((Fraction(0), -999))
                continue
            E = max(e for _, e in terms)
            unit = Fraction(2) ** (E - dp.F)
            halves.append((sum(int(v / unit) for v, _ in terms) * unit, E))
        e_dot = max(e for _, e in halves)
        unit = Fraction(2) ** (e_dot - dp.F)
        dot = sum(math.floor(v / unit) for v, _ in halves) * unit
        e_c = _exp(acc, F32_MIN_E) if acc != 0 else F32_MIN_E
        e_max = max(e_dot, e_c)
        u2 = Fraction(2) ** (e_max - dp.F2 - 1)
        dot = math.floor(dot / u2) * u2
        cc = Fraction(0) if e_c < e_max - dp.F - 1 else math.floor(acc / Fraction(2) ** (e_max - dp.F)) * \
            Fraction(2) ** (e_max - dp.F)
        r = _round(_round(dot + cc, dp.F2, F32_MIN_E, "floor"), 23, F32_MIN_E, "rne")
        out = _to_float(r, "float32")
        if not math.isfinite(out):
            return out
        acc = Fraction(out)
    return float(acc)


INSTRUCTIONS = [
    ("wgmma", "hopper", "m64n8k32.f32.e4m3.e4m3"),
    ("wgmma", "hopper", "m64n8k32.f16.e5m2.e4m3"),
    ("mma", "ada", "m16n8k32.f32.e5m2.e5m2.f32"),
    ("mma", "rtx blackwell", "m16n8k32.kind::f8f6f4.f32.e2m1.e3m2.f32"),
    ("tcgen05.mma", "blackwell", "m64n8k32.kind::f8f6f4.f32.e2m3.e4m3"),
    ("mma", "rtx blackwell", "m16n8k32.kind::mxf8f6f4.block32.f32.e4m3.e5m2.f32.ue8m0"),
    ("tcgen05.mma", "blackwell", "m128n8k64.kind::mxf4nvf4.block16.f32.e2m1.e2m1.ue4m3"),
    ("mma", "rtx blackwell", "m16n8k64.kind::mxf4.block32.f32.e2m1.e2m1.f32.ue8m0"),
    ("mfma", "cdna3", "f32_16x16x32_fp8_bf8"),
    ("mfma", "cdna3", "f32_32x32x16_bf8_bf8"),
]


@pytest.mark.parametrize("op,arch,s", INSTRUCTIONS, ids=[s for _, _, s in INSTRUCTIONS])
def test_instruction_matches_fraction_oracle(op, arch, s):
    ins = instruction(op, arch, s)
    rng = np.random.default_rng(7)
    checked = 0
    for A, B, C in (cases.random_case(ins, rng, False), cases.crafted(ins, rng)):
        m = min(ins.m, 24)  # the oracle is slow: a slice of rows covers every crafted pattern
        SA = SB = None
        if ins.scale_fmt is not None:
            nb = ins.k // ins.block
            lo, hi = (118, 136) if ins.scale_type == "ue8m0" else (0, 0x7F)
            SA = rng.integers(lo, hi, (ins.m, nb)).astype(np.uint8)
            SB = rng.integers(lo, hi, (nb, ins.n)).astype(np.uint8)
            SA[0, 0], SB[0, 0] = 0, 0  # the smallest scales: terms below e_zero
        D = mma(op, arch, s, A, B, C, scale_a=SA, scale_b=SB)
        for i in range(m):
            for j in range(ins.n):
                if ins.datapath.family == "pairwise":
                    want = oracle_pairwise(ins, A[i], B[:, j], float(C[i, j]))
                else:
                    want = oracle_fused(ins, A[i], B[:, j], float(C[i, j]),
                                        None if SA is None else SA[i], None if SB is None else SB[:, j])
                if want is None:
                    continue
                got = float(D[i, j])
                assert got == want and math.copysign(1, got) == math.copysign(1, want), (i, j, got, want)
                checked += 1
    assert checked > ins.n * 8


def test_align_truncate_worked_example():
    """Hopper e4m3 wgmma (F = 13): beside 1.0, a product 2**-13 survives the alignment and
    2**-14 is truncated away; two 2**-14 products are each truncated (no carry between them);
    C takes part in the alignment like a product."""
    one, tiny = 0x38, 0x01  # 1.0 and 2**-9 (the smallest subnormal)
    A = np.zeros((64, 32), np.uint8)
    B = np.full((32, 8), one, np.uint8)
    B[1, :], B[2, :], B[3, :] = 0x18, 0x10, 0x10  # 2**-4, 2**-5, 2**-5
    A[:4, 0] = one
    A[0, 1] = tiny  # 2**-13
    A[1, 2] = tiny  # 2**-14
    A[2, 2] = A[2, 3] = tiny  # 2**-14 + 2**-14 = 2**-13 exactly, but each is truncated first
    C = np.zeros((64, 8), np.float32)
    C[3, 0] = 2.0 ** -13
    A[3, 1] = tiny  # 1 + 2**-13 (product) + 2**-13 (C) = 1 + 2**-12
    D = mma("wgmma", "hopper", "m64n8k32.f32.e4m3.e4m3", A, B, C)
    assert [float(D[i, 0]) for i in range(4)] == [1 + 2.0 ** -13, 1.0, 1.0, 1 + 2.0 ** -12]


def _finite_crafted(ins, rng):
    """cases.crafted with its NaN/Inf codes and C, and C >= 2**100, made finite and small: whole
    128-column units of these run in the AVX-512 fused loop where the CPU has one (_kernels_hw_avx512.c)."""
    A, B, C = cases.crafted(ins, rng)
    for x, fmt in ((A, ins.a_fmt), (B, ins.b_fmt)):
        bad = ~np.isin(x, cases.finite_codes(fmt))
        x[bad] = rng.choice(cases.finite_codes(fmt), int(bad.sum()))
    C[~(np.abs(C) < 2.0 ** 100)] = -1.5
    return A, B, C


@pytest.mark.parametrize("s", ["m64n128k32.f32.e4m3.e4m3", "m64n256k32.f32.e5m2.e4m3"])
def test_whole_column_units_match_fraction_oracle(s):
    """The wide wgmma shapes, finite operands: cancellation, the smallest products, exponent spread
    wider than F, signed zeros, C that swamps the products, subnormal and -0 C (every column)."""
    ins = instruction("wgmma", "hopper", s)
    rng = np.random.default_rng(11)
    A, B, C = _finite_crafted(ins, rng)
    D = mma("wgmma", "hopper", s, A, B, C)
    for i in range(12):
        for j in range(ins.n):
            want = oracle_fused(ins, A[i], B[:, j], float(C[i, j]))
            got = float(D[i, j])
            assert got == want and math.copysign(1, got) == math.copysign(1, want), (i, j, got, want)
