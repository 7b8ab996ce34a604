"""The tensor-core datapaths, in integer arithmetic on significands and exponents.

Every operand is split once, by a 256-entry table per format, into a signed integer significand
``sig`` (hidden bit included), its normalised exponent ``e`` (subnormals and zero: the format's
minimum exponent) and the exponent ``lsb = e - mantissa_bits`` of its last bit, so value =
sig * 2**lsb exactly. A product of two codes is then sig_a*sig_b * 2**(lsb_a+lsb_b), with
alignment exponent e_a+e_b. Aligning a term to the block's largest exponent E and truncating it
to F fraction bits is an integer shift: trunc(sig * 2**(lsb - E + F)), in units of 2**(E - F).
The sums are exact integers (below 2**53, so float64 holds them exactly for the final
normalisation, which is done by exact float64 scaling, floor/trunc/rint and comparison).

NaN and infinity follow the published model: a NaN operand or scale, Inf*0, or Infs of both signs
give NaN (canonical 0x7FFFFFFF / 0x7FFF); otherwise an Inf gives that Inf. NVIDIA results are never
-0 (the model adds +0.0 last).
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from ..formats import FloatFormat
from .isa import Datapath

NAN32, NAN16 = np.uint32(0x7FFFFFFF), np.uint16(0x7FFF)
_FLOAT = {"float32": (np.float32, np.uint32, 8, 23), "float16": (np.float16, np.uint16, 5, 10)}
# special classes of an operand
FINITE, NAN, POS_INF, NEG_INF = 0, 1, 2, 3


@lru_cache(maxsize=None)
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


def _align(sig: np.ndarray, shift: np.ndarray, floor: bool = False) -> np.ndarray:
    """sig * 2**shift, truncated toward zero (or floored) to an integer."""
    left = np.clip(shift, 0, 62)
    right = np.clip(-shift, 0, 63)
    if floor:
        return (sig << left) >> right  # arithmetic shift: floor
    mag = (np.abs(sig) << left) >> right
    return np.where(sig < 0, -mag, mag)


def fused_sum(sig: np.ndarray, e: np.ndarray, lsb: np.ndarray, F: int) -> tuple[np.ndarray, np.ndarray]:
    """Terms (last axis) aligned to their largest exponent E, truncated to F fraction bits and
    summed: returns (S, E) with the sum S * 2**(E - F)."""
    E = e.max(axis=-1)
    S = _align(sig, lsb - E[..., None] + F).sum(axis=-1)
    return S, E


def _special_result(nan: np.ndarray, pinf: np.ndarray, ninf: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(is_special, value as float64) for the NaN/Inf rule."""
    nan = nan | (pinf & ninf)
    value = np.where(nan, np.nan, np.where(pinf, np.inf, -np.inf))
    return nan | pinf | ninf, value


def normalise(S: np.ndarray, unit: np.ndarray, output: str) -> np.ndarray:
    """The float64 value of S * 2**unit normalised as ``output`` (exact in float64)."""
    v = np.ldexp(S.astype(np.float64), unit.astype(np.int64))
    a = np.abs(v)
    _, ex = np.frexp(a)
    ev = ex.astype(np.int64) - 1
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
    return np.where(v < 0, -r, r) + 0.0  # +0.0: the model never returns -0


def deliver(values: np.ndarray, special: np.ndarray, special_value: np.ndarray, acc: str) -> np.ndarray:
    """float64 results -> the accumulator dtype, NaN as the canonical code."""
    ftype, uint, _, _ = _FLOAT[acc]
    out = np.where(special, special_value, values).astype(ftype)
    bits = out.view(uint)
    bits[np.isnan(out)] = NAN32 if acc == "float32" else NAN16
    return out


def _operand_fields(codes, fmt):
    sig, e, sp = code_fields(fmt)
    return sig[codes], e[codes], sp[codes], fmt.mantissa_bits


def _product_specials(spa, spb, siga, sigb):
    """Per-product NaN / +Inf / -Inf masks (Inf*0 is NaN)."""
    inf_a, inf_b = spa >= POS_INF, spb >= POS_INF
    nan = (spa == NAN) | (spb == NAN) | (inf_a & (spb == FINITE) & (sigb == 0)) | (inf_b & (spa == FINITE) & (siga == 0))
    inf = (inf_a | inf_b) & ~nan
    neg = ((spa == NEG_INF) | ((spa == FINITE) & (siga < 0))) ^ ((spb == NEG_INF) | ((spb == FINITE) & (sigb < 0)))
    return nan, inf & ~neg, inf & neg


def fused_step(dp: Datapath, acc: str, a, b, fa, fb, c, sa=None, sb=None, fs=None, ignore_sign=False, block=None):
    """One ``fused``/``grouped`` step: a, b (..., L) codes, c (...) accumulator values, optional
    block-scale codes sa, sb (..., L // block). Returns the new accumulator (acc dtype)."""
    siga, ea, spa, mba = _operand_fields(a, fa)
    sigb, eb, spb, mbb = _operand_fields(b, fb)
    sigc, ec, spc, mbc = float_fields(c, acc)
    nan, pinf, ninf = _product_specials(spa, spb, siga, sigb)
    nan, pinf, ninf = nan.any(-1), pinf.any(-1), ninf.any(-1)
    nan |= spc == NAN
    pinf |= spc == POS_INF
    ninf |= spc == NEG_INF
    if dp.family == "grouped":
        sig, e, lsb, scale_nan = _groups(dp, siga, ea, mba, sigb, eb, mbb, sa, sb, fs, ignore_sign, block)
        nan |= scale_nan
    else:
        sig = siga * sigb
        e = ea + eb
        lsb = e - mba - mbb
        if sa is not None:  # one E8M0 scale pair per step: exponents add, significands are 1
            ssig, se, ssp = code_fields(fs)
            nan |= (ssp[sa] == NAN).any(-1) | (ssp[sb] == NAN).any(-1)
            shift = np.repeat(se[sa] + se[sb], block, axis=-1)
            e = e + shift
            lsb = lsb + shift
        e = np.where(sig == 0, dp.e_zero, e)
    sig = np.concatenate([sig, sigc[..., None]], axis=-1)
    e = np.concatenate([e, np.where(sigc == 0, dp.e_zero, ec)[..., None]], axis=-1)
    lsb = np.concatenate([lsb, (ec - mbc)[..., None]], axis=-1)
    S, E = fused_sum(sig, e, lsb, dp.F)
    special, sval = _special_result(nan, pinf, ninf)
    return deliver(normalise(S, E - dp.F, dp.output), special, sval, acc)


def _groups(dp, siga, ea, mba, sigb, eb, mbb, sa, sb, fs, ignore_sign, block):
    """Group sums of G products (exact integers in units 2**pmin) times their scales, as terms."""
    lsb = ea - mba + eb - mbb
    pmin = int(lsb.min()) if lsb.size else 0
    prod = siga * sigb
    G = dp.G
    shape = prod.shape[:-1] + (prod.shape[-1] // G, G)
    P = (prod << (lsb - pmin)).reshape(shape).sum(-1)
    all_zero = (prod == 0).reshape(shape).all(-1)
    ssig, se, ssp = code_fields(fs, ignore_sign)
    rep = block // G
    sga, sgb = np.repeat(ssig[sa], rep, -1), np.repeat(ssig[sb], rep, -1)
    sea, seb = np.repeat(se[sa], rep, -1), np.repeat(se[sb], rep, -1)
    scale_nan = (ssp[sa] == NAN).any(-1) | (ssp[sb] == NAN).any(-1)
    sig = P * sga * sgb
    e_scale = sea + seb
    e = np.where(all_zero | (sga * sgb == 0), dp.e_zero, e_scale)
    lsb_t = e_scale + pmin - 2 * fs.mantissa_bits
    return sig, e, lsb_t, scale_nan


def pairwise_step(dp: Datapath, a, b, fa, fb, c):
    """One CDNA3 FP8 MFMA step (``pairwise`` datapath): a, b (..., L) codes, c (...) float32."""
    siga, ea, spa, mba = _operand_fields(a, fa)
    sigb, eb, spb, mbb = _operand_fields(b, fb)
    sigc, ec, spc, mbc = float_fields(c, "float32")
    nan = ((spa == NAN) | (spb == NAN)).any(-1)
    sig = np.where((spa == FINITE) & (spb == FINITE), siga * sigb, 0)
    e = np.where(sig == 0, -999, ea + eb)
    lsb = ea + eb - mba - mbb
    F, F2 = dp.F, dp.F2
    S0, E0 = fused_sum(sig[..., 0::2], e[..., 0::2], lsb[..., 0::2], F)
    S1, E1 = fused_sum(sig[..., 1::2], e[..., 1::2], lsb[..., 1::2], F)
    e_dot = np.maximum(E0, E1)
    Sd = _align(S0, E0 - e_dot, floor=True) + _align(S1, E1 - e_dot, floor=True)
    # C: a NaN/Inf C counts with exponent -1 (frexp of a non-finite value), like any other C
    ec = np.where(spc != FINITE, -1, ec)
    e_max = np.maximum(e_dot, ec)
    T = _align(Sd, e_dot - e_max + (F2 + 1 - F), floor=True)
    Sc = _align(sigc, ec - e_max + F - mbc, floor=True)
    dropped = ec < e_max - F - 1
    Sc = np.where(dropped, 0, Sc)
    T = T + (Sc << (F2 + 1 - F))
    v = np.ldexp(T.astype(np.float64), (e_max - F2 - 1).astype(np.int64))
    _, ex = np.frexp(np.abs(v))
    q = np.maximum(ex.astype(np.int64) - 1, -126) - F2
    v = np.ldexp(np.floor(np.ldexp(v, -q)), q) + 0.0
    keep_c = (spc != FINITE) & ~dropped
    nan = nan | (keep_c & (spc == NAN))
    special, sval = _special_result(nan, keep_c & (spc == POS_INF), keep_c & (spc == NEG_INF))
    out = np.where(special, sval, v).astype(np.float32)
    out.view(np.uint32)[np.isnan(out)] = NAN32
    return out
