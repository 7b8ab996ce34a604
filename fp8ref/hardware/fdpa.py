"""The tensor-core datapaths, exactly: integers times powers of two, held in float64.

Every operand is split once, by a 256-entry table per format built from the format's parameters,
into a signed integer significand ``sig`` (hidden bit included) and its normalised exponent ``e``
(subnormals and zero: the format's minimum exponent); value = sig * 2**(e - mantissa_bits). A
product of two codes is sig_a*sig_b (at most 8 bits) times a power of two, with alignment
exponent e_a + e_b. Aligning a term to the step's largest exponent E and truncating it to F
fraction bits is trunc(term * 2**(F - E)): an integer of at most F + 3 bits. Every such integer
and their sums stay below 2**53, and every scaling is by a power of two inside float64's range,
so float64 multiply / trunc / floor / sum compute them without any rounding: this is the integer
shift arithmetic of the model, vectorised. The final normalisation (trunc, floor or rint at the
output's last bit) is exact in float64 too.

NaN and infinity follow the published model: a NaN operand or scale, Inf*0, or Infs of both signs
give NaN (canonical 0x7FFFFFFF / 0x7FFF); otherwise an Inf gives that Inf. NVIDIA results are never
-0 (the model adds +0.0 last).
"""

from __future__ import annotations

from functools import cache

import numpy as np

from ..formats import FloatFormat
from .isa import Datapath

NAN32, NAN16 = np.uint32(0x7FFFFFFF), np.uint16(0x7FFF)
_FLOAT = {"float32": (np.float32, np.uint32, 8, 23), "float16": (np.float16, np.uint16, 5, 10)}
# special classes of an operand
FINITE, NAN, POS_INF, NEG_INF = 0, 1, 2, 3


@cache
def code_fields(fmt: FloatFormat, ignore_sign: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(sig int64, e int64, special int8) for each of the 256 codes of ``fmt`` (from the format's
    parameters, not from a decode). ``ignore_sign`` reads the sign bit as 0 (UE4M3 scales)."""
    sig = np.zeros(256, np.int64)
    e = np.zeros(256, np.int64)
    special = np.zeros(256, np.int8)
    mb = fmt.mantissa_bits
    for code in range(256):
        c = code & (fmt.n_codes - 1)
        if ignore_sign:
            c &= ~fmt.sign_mask & 0xFF
        mag = c & fmt.magnitude_mask
        negative = bool(c & fmt.sign_mask)
        if fmt.exact_value(c) is None:
            inf = fmt.has_inf and mag == fmt.inf_code
            special[code] = (NEG_INF if negative else POS_INF) if inf else NAN
            continue
        field, frac = mag >> mb, mag & ((1 << mb) - 1)
        if field == 0 and fmt.has_subnormals:
            sig[code], e[code] = frac, fmt.emin
        else:
            sig[code], e[code] = frac | (1 << mb), field - fmt.bias
        if negative:
            sig[code] = -sig[code]
    for arr in (sig, e, special):
        arr.setflags(write=False)
    return sig, e, special


def float_fields(x: np.ndarray, dtype: str) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """(sig, e, special, mantissa_bits) of float32/float16 values, from their bits."""
    _, uint, ebits, mb = _FLOAT[dtype]
    bits = np.ascontiguousarray(x).view(uint).astype(np.int64)
    field = (bits >> mb) & ((1 << ebits) - 1)
    frac = bits & ((1 << mb) - 1)
    negative = (bits >> (ebits + mb)) & 1 == 1
    bias = (1 << (ebits - 1)) - 1
    top = field == (1 << ebits) - 1
    sig = np.where(field > 0, frac | (1 << mb), frac)
    sig = np.where(negative, -sig, sig)
    sig = np.where(top, 0, sig)
    e = np.maximum(field, 1) - bias
    special = np.where(top, np.where(frac != 0, NAN, np.where(negative, NEG_INF, POS_INF)), FINITE).astype(np.int8)
    return sig, e, special, mb


def _exps(e: np.ndarray, sig: np.ndarray) -> np.ndarray:
    """Alignment exponents as int32, zeros and specials far below everything (they never win the
    max unless everything is zero; then the sum is 0 whatever E is)."""
    return np.where(sig == 0, -(1 << 20), e).astype(np.int32)


@cache
def value_fields(fmt: FloatFormat, ignore_sign: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(float64 value with NaN/Inf, int32 alignment exponent) per code; exact."""
    sig, e, special = code_fields(fmt, ignore_sign)
    v = np.ldexp(sig.astype(np.float64), (e - fmt.mantissa_bits).astype(np.int64))
    v = np.where(special == NAN, np.nan, np.where(special == POS_INF, np.inf, np.where(special == NEG_INF, -np.inf, v)))
    ex = _exps(e, sig)
    v.setflags(write=False)
    ex.setflags(write=False)
    return v, ex


def _c_fields(c: np.ndarray, acc: str, e_zero: int) -> tuple[np.ndarray, np.ndarray]:
    """C as float64 and its alignment exponent (e_zero for a zero C)."""
    sig, e, _, _ = float_fields(c, acc)
    return c.astype(np.float64), np.where(sig == 0, e_zero, e).astype(np.int32)


def normalise(v: np.ndarray, output: str) -> np.ndarray:
    """The exact float64 sum ``v`` normalised as ``output`` (NaN/Inf pass through)."""
    a = np.abs(v)
    _, ex = np.frexp(a)
    ev = ex.astype(np.int32) - 1
    with np.errstate(invalid="ignore"):
        if output in ("rz-f32", "rz-e8m13"):
            q = np.maximum(ev, -126) - (23 if output == "rz-f32" else 13)
            r = np.ldexp(np.trunc(np.ldexp(a, -q)), q)
            r = np.where(r >= 2.0 ** 128, np.inf, r)
        elif output == "rne-f16":
            q = np.maximum(ev, -14) - 10
            r = np.ldexp(np.rint(np.ldexp(a, -q)), q)
            r = np.where(r >= 2.0 ** 16, np.inf, r)
        else:
            raise ValueError(output)
        r = np.where(np.isfinite(v), np.copysign(r, v), v)
    return r + 0.0  # +0.0: the model never returns -0


def deliver(values: np.ndarray, acc: str) -> np.ndarray:
    """float64 results -> the accumulator dtype, NaN as the canonical code."""
    ftype, uint, _, _ = _FLOAT[acc]
    out = values.astype(ftype)
    out.view(uint)[np.isnan(out)] = NAN32 if acc == "float32" else NAN16
    return out


def _aligned_sum(p: np.ndarray, e: np.ndarray, cv: np.ndarray, ec: np.ndarray, F: int, e_zero_in) -> np.ndarray:
    """Terms p (..., L) with exponents e, and C: aligned to the largest exponent, truncated to F
    fraction bits, summed exactly; the float64 value of the sum. float32 terms are allowed when
    every aligned term and partial sum is an integer below 2**24 (F <= 16, L <= 32)."""
    E = np.maximum(e.max(axis=-1), ec)
    if e_zero_in is not None:  # a zero term's exponent e_zero takes part in the max
        E = np.maximum(E, e_zero_in)
    up = np.ldexp(1.0, (F - E).astype(np.int32))
    if p.dtype == np.float32:  # no nonzero product lies below 2**-60, so E < -60 means p == 0
        up_p = np.ldexp(np.float32(1), (F - np.maximum(E, -60)).astype(np.int32))
    else:
        up_p = up
    with np.errstate(invalid="ignore"):
        S = np.trunc(p * up_p[..., None]).sum(axis=-1, dtype=p.dtype).astype(np.float64) + np.trunc(cv * up)
    return S / up


def fused_step(dp: Datapath, acc: str, a, b, fa, fb, c, sa=None, sb=None, fs=None, ignore_sign=False, block=None):
    """One ``fused``/``grouped`` step: a, b (..., L) codes, c (...) accumulator values, optional
    block-scale codes sa, sb (..., L // block). Returns the new accumulator (acc dtype)."""
    va, ea = value_fields(fa)
    vb, eb = value_fields(fb)
    cv, ec = _c_fields(c, acc, dp.e_zero)
    with np.errstate(invalid="ignore", over="ignore"):
        if dp.family == "grouped":
            p, e, e_zero_in = _groups(dp, va[a] * vb[b], sa, sb, fs, ignore_sign, block)
        else:
            if dp.F <= 16 and sa is None and dp.L <= 32:
                va, vb = va.astype(np.float32), vb.astype(np.float32)
            p = va[a] * vb[b]
            e = ea[a] + eb[b]
            e_zero_in = None
            if dp.e_zero > fa.emin + fb.emin:  # nonzero products can sit below e_zero (e5m2, f16)
                e_zero_in = np.where((e < -(1 << 19)).any(axis=-1), dp.e_zero, -(1 << 20))
            if sa is not None:  # one scale pair per step: exponents add, significands are 1
                vs, es = value_fields(fs)
                s = vs[sa[..., 0]] * vs[sb[..., 0]]
                p = p * s[..., None]
                e = e + (es[sa[..., 0]] + es[sb[..., 0]])[..., None]
                has_zero = (e < -(1 << 19)).any(axis=-1)
                e_zero_in = np.where(has_zero, dp.e_zero, -(1 << 20))
        S = _aligned_sum(p, e, cv, ec, dp.F, e_zero_in)
    return deliver(normalise(S, dp.output), acc)


def _groups(dp, prod, sa, sb, fs, ignore_sign, block):
    """Group sums of G products (exact in float64) times their scales, as the step's terms."""
    G = dp.G
    shape = prod.shape[:-1] + (prod.shape[-1] // G, G)
    grouped = prod.reshape(shape)
    P = grouped.sum(-1)
    all_zero = (grouped == 0).all(-1)
    vs, es = value_fields(fs, ignore_sign)
    rep = block // G
    s = np.repeat(vs[sa] * vs[sb], rep, -1)
    e_scale = np.repeat(es[sa] + es[sb], rep, -1)
    zero = all_zero | (s == 0)
    e = np.where(zero, -(1 << 20), e_scale)
    e_zero_in = np.where(zero.any(-1), dp.e_zero, -(1 << 20))
    return P * s, e, e_zero_in


def pairwise_step(dp: Datapath, a, b, fa, fb, c):
    """One CDNA3 FP8 MFMA step (``pairwise`` datapath): a, b (..., L) codes, c (...) float32."""
    va, ea = value_fields(fa)
    vb, eb = value_fields(fb)
    F, F2 = dp.F, dp.F2
    with np.errstate(invalid="ignore", over="ignore"):
        p = va[a] * vb[b]
        e = ea[a] + eb[b]
        halves = []
        for par in (0, 1):
            pe, ee = p[..., par::2], e[..., par::2]
            E = np.maximum(ee.max(axis=-1), -999)  # an all-zero half: any E gives 0
            up = np.ldexp(1.0, (F - E).astype(np.int32))
            halves.append((np.trunc(pe * up[..., None]).sum(axis=-1), E))  # in units 2**(E - F)
        (S0, E0), (S1, E1) = halves
        e_dot = np.maximum(E0, E1)
        # combine the halves: floor to F bits at e_dot
        Sd = np.floor(np.ldexp(S0, (E0 - e_dot).astype(np.int32))) + \
            np.floor(np.ldexp(S1, (E1 - e_dot).astype(np.int32)))
        sig_c, e_c, sp_c, _ = float_fields(c, "float32")
        e_c = np.where(sp_c != FINITE, -1, e_c)  # a NaN/Inf C aligns with exponent -1 (frexp's)
        cv = c.astype(np.float64)
        e_max = np.maximum(e_dot, e_c)
        # products floored to F2 + 1 bits at e_max, C floored to F bits; C dropped far below
        dot = np.floor(np.ldexp(Sd, (e_dot - e_max + F2 + 1 - F).astype(np.int32)))
        cs = np.floor(np.ldexp(cv, (F2 + 1 - e_max).astype(np.int32) - (F2 + 1 - F)))
        cs = np.where(e_c < e_max - F - 1, 0.0, cs)
        T = dot + np.ldexp(cs, F2 + 1 - F)  # units 2**(e_max - F2 - 1)
        v = np.ldexp(T, (e_max - F2 - 1).astype(np.int32))
        _, ex = np.frexp(np.abs(v))
        q = np.maximum(ex.astype(np.int32) - 1, -126) - F2
        v = np.where(np.isfinite(v), np.ldexp(np.floor(np.ldexp(v, -q)), q), v) + 0.0
        out = v.astype(np.float32)
    out.view(np.uint32)[np.isnan(out)] = NAN32
    return out
