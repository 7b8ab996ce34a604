"""encode / decode: exact conversions between real numbers and the codes of a FloatFormat.

The rules (rounding modes, overflow, NaN/Inf, signed zero, unsigned formats) are written out in
docs/codec.md. Codes are computed from the format's parameters with integer and exact float
arithmetic; no other library's FP8 cast is ever called.

Three paths give the same codes (tests compare them exhaustively):
* ``_encode_exact``: float64 values, frexp/ldexp scaling (exact), floor and an integer rounding
  decision. Every other path is derived from it or checked against it. A float64 input is
  rounded once.
* 16-bit inputs: a 65,536-entry table built by ``_encode_exact`` over every bit pattern.
* float32: the C loop in ``_csrc/codec.c`` (integer arithmetic on the bit pattern), or, without a
  compiler, the 16-bit table indexed by bfloat16 round-to-odd of x, which is exact for formats with
  at most 5 mantissa bits (rounding to odd with two spare bits, then once more, equals rounding
  once; Boldo & Melquiond 2008).
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from ._arrays import bf16_bits_to_f32, check_torch, float_input, is_torch, numpy_input, output_buffer, torch
from ._native import enc_params as _EncParams
from ._native import kernels as _kernels
from ._native import kernels_available  # noqa: F401 (re-exported for tests and tools)
from ._native import rne_params as _RneParams
from ._native import run_c as _run_c
from .errors import EncodeError, FormatError, InputTypeError
from .formats import FloatFormat, get_format

ROUNDING_MODES = ("rne", "rna", "rtz", "rup", "rdown", "rto", "stochastic")
_DETERMINISTIC = ROUNDING_MODES[:-1]
_RANDOM_BITS_DTYPES = {np.dtype(np.uint8): 8, np.dtype(np.uint16): 16, np.dtype(np.uint32): 32}
_CHUNK = 1 << 16  # elements per numpy step: keeps temporaries in cache and memory O(chunk)


# --------------------------------------------------------------------------------------------
# The exact reference path (numpy, float64)
# --------------------------------------------------------------------------------------------
def _encode_exact(v: np.ndarray, fmt: FloatFormat, saturate: bool, rounding: str,
                  rbits: np.ndarray | None = None, nbits: int = 0) -> np.ndarray:
    """Encode float64 values (exact inputs) to codes. 'none'-format NaN/Inf give code 0 here;
    callers reject them first (see ``_reject_unencodable``)."""
    m_bits, sub = fmt.mantissa_bits, int(fmt.has_subnormals)
    sign = np.signbit(v)
    a = np.abs(v)
    nan, inf = np.isnan(v), np.isinf(v)
    finite_a = np.where(nan | inf, 0.0, a)
    zero = (a == 0)
    e = np.frexp(finite_a)[1].astype(np.int64) - 1  # floor(log2 a) for a > 0
    e = np.where(zero, fmt.emin, np.maximum(e, fmt.emin))
    t = np.ldexp(finite_a, (m_bits - e).astype(np.int32))  # a / quantum, exact (power-of-two scale)
    n = np.floor(t)
    frac = t - n  # exact: t has at most 53 significant bits
    code_lo = ((e + fmt.bias - sub) << m_bits) + n.astype(np.int64) - ((1 - sub) << m_bits)
    inexact = frac != 0
    if rounding == "rne":
        up = (frac > 0.5) | ((frac == 0.5) & (code_lo & 1 == 1))
    elif rounding == "rna":
        up = frac >= 0.5
    elif rounding == "rtz":
        up = np.zeros_like(inexact)
    elif rounding == "rup":
        up = inexact & ~sign
    elif rounding == "rdown":
        up = inexact & sign
    elif rounding == "rto":
        up = inexact & (code_lo & 1 == 0)
    else:  # stochastic: carry out of (discarded fraction truncated to N bits) + r
        scaled = np.floor(np.ldexp(frac, nbits)).astype(np.uint64)
        up = scaled + rbits.astype(np.uint64) >= (1 << nbits)
    mag = code_lo + up
    if not fmt.has_zero:
        mag = np.maximum(mag, 0)  # nothing below the minimum exists: clamp up to it

    max_mag = fmt.max_code_magnitude
    over = mag > max_mag
    codes = mag.astype(np.int64)
    ovf_pos, ovf_neg = _overflow_codes(fmt, saturate, rounding)
    codes = np.where(over, np.where(sign, ovf_neg, ovf_pos), codes | np.where(sign, fmt.sign_mask, 0))
    zero_neg = fmt.sign_mask if fmt.has_negative_zero else 0
    codes = np.where(~over & (mag == 0) & fmt.has_zero, np.where(sign, zero_neg, 0), codes)
    inf_pos, inf_neg = _inf_codes(fmt, saturate)
    nan_pos, nan_neg = _nan_codes(fmt)
    codes = np.where(inf, np.where(sign, inf_neg, inf_pos), codes)
    codes = np.where(nan, np.where(sign, nan_neg, nan_pos), codes)
    if not fmt.signed:  # negative values (and -Inf) have no code: NaN. -0 is zero.
        codes = np.where(sign & ~zero & ~nan, nan_pos, codes)
    if not fmt.has_zero:
        codes = np.where(zero, 0 if saturate else nan_pos, codes)
    return codes.astype(np.uint8)


def _overflow_codes(fmt: FloatFormat, saturate: bool, rounding: str) -> tuple[int, int]:
    """Codes for a finite value whose rounded magnitude exceeds max: (positive, negative)."""
    top = fmt.max_code_magnitude
    sat_pos, sat_neg = top, top | fmt.sign_mask
    if saturate or fmt.specials == "none":
        return sat_pos, sat_neg
    big_pos, big_neg = _inf_codes(fmt, saturate=False)
    # IEEE 754 7.4: directed roundings carry overflow toward zero to the largest finite value.
    to_big_pos = rounding in ("rne", "rna", "stochastic", "rup")
    to_big_neg = rounding in ("rne", "rna", "stochastic", "rdown")
    return (big_pos if to_big_pos else sat_pos), (big_neg if to_big_neg else sat_neg)


def _inf_codes(fmt: FloatFormat, saturate: bool) -> tuple[int, int]:
    if saturate or fmt.specials == "none":
        return fmt.max_code_magnitude, fmt.max_code_magnitude | fmt.sign_mask
    if fmt.has_inf:
        return fmt.inf_code, fmt.inf_code | fmt.sign_mask
    return _nan_codes(fmt)


def _nan_codes(fmt: FloatFormat) -> tuple[int, int]:
    if fmt.nan_code is None:
        return 0, 0  # unreachable after _reject_unencodable
    if fmt.specials in ("fnuz", "p3109") or not fmt.signed:  # one NaN code, no sign
        return fmt.nan_code, fmt.nan_code
    return fmt.nan_code, fmt.nan_code | fmt.sign_mask


# --------------------------------------------------------------------------------------------
# Tables
# --------------------------------------------------------------------------------------------
def _bits_to_f64(bits: np.ndarray, kind: str) -> np.ndarray:
    """Exact float64 values of raw bit patterns of the given input kind."""
    with np.errstate(invalid="ignore"):  # signalling NaN patterns widen to quiet NaNs, sign kept
        return _widen(bits, kind)


def _widen(bits: np.ndarray, kind: str) -> np.ndarray:
    if kind == "f16":
        return bits.view(np.float16).astype(np.float64)
    if kind == "bf16":
        return bf16_bits_to_f32(bits).astype(np.float64)
    if kind == "f32":
        return bits.view(np.float32).astype(np.float64)
    return bits


@lru_cache(maxsize=256)
def _table16(fmt: FloatFormat, kind: str, saturate: bool, rounding: str) -> np.ndarray:
    """Code of every 16-bit pattern of ``kind`` ('f16' or 'bf16')."""
    patterns = np.arange(1 << 16, dtype=np.uint16)
    table = _encode_exact(_bits_to_f64(patterns, kind), fmt, saturate, rounding)
    table.setflags(write=False)
    return table


@lru_cache(maxsize=64)
def _decode_table(fmt: FloatFormat) -> np.ndarray:
    """Value of every code (256 entries; entries past 2**bits are never read)."""
    dtype = np.dtype(fmt.decode_dtype)
    table = np.zeros(256, dtype=dtype)
    for code in range(fmt.n_codes):
        value = fmt.exact_value(code)
        if value is not None:
            table[code] = float(value)
            if value == 0 and code & fmt.sign_mask:
                table[code] = -0.0
        elif fmt.has_inf and code & fmt.magnitude_mask == fmt.inf_code:
            table[code] = -np.inf if code & fmt.sign_mask else np.inf
        else:  # canonical quiet NaN, negative only for signed NaN codes
            negative = bool(code & fmt.sign_mask) and fmt.specials in ("fn", "ieee") and fmt.signed
            table[code] = _canonical_nan(dtype, negative)
    table.setflags(write=False)
    return table


def _canonical_nan(dtype: np.dtype, negative: bool):
    if dtype == np.float32:
        return np.array([0xFFC00000 if negative else 0x7FC00000], np.uint32).view(np.float32)[0]
    return np.array([0xFFF8000000000000 if negative else 0x7FF8000000000000], np.uint64).view(np.float64)[0]


# --------------------------------------------------------------------------------------------
# C loops (optional)
# --------------------------------------------------------------------------------------------
def _c_rne_params(fmt: FloatFormat, saturate: bool) -> _RneParams | None:
    """Parameters for the C round-to-nearest-even float32 loop, or None where it does not apply
    (its subnormal trick needs every float32 subnormal input to round to zero). Shared: read-only."""
    return None if _kernels() is None else _rne_params(fmt, saturate)


def _c_encode_params(fmt: FloatFormat, saturate: bool, rounding: str) -> _EncParams | None:
    """Parameters for the C float32 loop, or None where it does not apply. Shared: read-only."""
    return None if _kernels() is None else _enc_params(fmt, saturate, rounding)


@lru_cache(maxsize=256)  # built once per format and mode: 30 us of every quantize call's fixed cost
def _rne_params(fmt: FloatFormat, saturate: bool) -> _RneParams | None:
    base = _enc_params(fmt, saturate, "rne")
    if base is None or fmt.emin - fmt.mantissa_bits - 1 < -126:
        return None
    m, shift = fmt.mantissa_bits, 23 - fmt.mantissa_bits
    return _RneParams(shift, (1 << (shift - 1)) - 1, (127 - fmt.bias) << m, (127 + fmt.emin) << 23,
                      (127 + fmt.emin - m + 23) << 23, base.maxmag, base.signbit, base.nan_pos, base.nan_neg,
                      base.inf_pos, base.inf_neg, base.ovf_pos, base.ovf_neg, base.zero_neg)


@lru_cache(maxsize=256)
def _enc_params(fmt: FloatFormat, saturate: bool, rounding: str) -> _EncParams | None:
    if (rounding == "stochastic" or not fmt.signed or not fmt.has_zero
            or not 1 <= fmt.mantissa_bits <= 7 or fmt.emin - fmt.mantissa_bits < -140 or fmt.emax > 127):
        return None
    ovf = _overflow_codes(fmt, saturate, rounding)
    inf = _inf_codes(fmt, saturate)
    nan = _nan_codes(fmt)
    return _EncParams(fmt.mantissa_bits, fmt.emin, fmt.bias, _DETERMINISTIC.index(rounding),
                      fmt.max_code_magnitude, fmt.sign_mask, nan[0], nan[1], inf[0], inf[1], ovf[0], ovf[1],
                      fmt.sign_mask if fmt.has_negative_zero else 0)


# --------------------------------------------------------------------------------------------
# Array plumbing: numpy or torch in, same library out, numpy bit views inside
# --------------------------------------------------------------------------------------------
_KIND_BITS = {"f16": np.uint16, "bf16": np.uint16, "f32": np.uint32, "f64": np.float64}
_KIND_OF = {"float16": "f16", "bfloat16": "bf16", "float32": "f32", "float64": "f64"}


def _input_bits(x, what: str = "x") -> tuple[str, np.ndarray, bool]:
    """(kind, flat contiguous numpy bit view, is_torch)."""
    arr, name, as_torch = float_input(x, what)
    kind, flat = _KIND_OF[name], arr.reshape(-1)
    return kind, (flat.view(_KIND_BITS[kind]) if kind != "f64" else flat), as_torch


def _shape(x) -> tuple:
    return tuple(x.shape) if hasattr(x, "shape") else ()


# --------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------
def encode(x, fmt: FloatFormat | str, *, saturate: bool = True, rounding: str = "rne",
           random_bits=None, out=None):
    """Round ``x`` to ``fmt`` and return its codes (uint8, same shape and library as ``x``).

    ``rounding`` is one of ROUNDING_MODES; ``stochastic`` needs ``random_bits``: an unsigned
    integer array (uint8/16/32 = N bits) of x's shape; see docs/codec.md for the exact rule.
    ``out`` is an optional preallocated uint8 array/tensor of x's shape (or a torch tensor of the
    format's own float8 dtype, which holds the codes as its bits).
    """
    fmt = get_format(fmt)
    if rounding not in ROUNDING_MODES:
        raise FormatError(f"rounding: expected one of {', '.join(ROUNDING_MODES)}, got {rounding!r}")
    if not isinstance(saturate, bool):
        raise InputTypeError(f"saturate: expected True or False, got {saturate!r}")
    kind, bits, as_torch = _input_bits(x)
    shape = _shape(x)
    rbits, nbits = _check_random_bits(random_bits, rounding, shape)
    result, flat = output_buffer(out, shape, as_torch, np.uint8, "encode", float8=fmt.torch_dtype_name)
    if fmt.specials == "none":
        _reject_unencodable(bits, kind, fmt, saturate)
    if bits.size == 0:
        return result

    if rounding == "stochastic" or kind == "f64":
        for lo in range(0, bits.size, _CHUNK):
            chunk = _bits_to_f64(bits[lo:lo + _CHUNK], kind)
            rb = None if rbits is None else rbits[lo:lo + _CHUNK]
            flat[lo:lo + _CHUNK] = _encode_exact(chunk, fmt, saturate, rounding, rb, nbits)
    elif kind in ("f16", "bf16"):
        _gather16(bits, flat, _table16(fmt, kind, saturate, rounding))
    else:
        _encode_f32(bits, flat, fmt, saturate, rounding)
    return result


def _encode_f32(bits: np.ndarray, flat: np.ndarray, fmt: FloatFormat, saturate: bool, rounding: str) -> None:
    rne = _c_rne_params(fmt, saturate) if rounding == "rne" else None
    params = rne or _c_encode_params(fmt, saturate, rounding)
    if params is not None:
        _run_c("fp8ref_encode_f32_rne" if rne else "fp8ref_encode_f32", bits, flat, params)
    elif fmt.mantissa_bits <= 5 and fmt.emax <= 127:
        _encode_f32_via_table(bits, flat, fmt, saturate, rounding)
    else:
        for lo in range(0, bits.size, _CHUNK):
            flat[lo:lo + _CHUNK] = _encode_exact(_bits_to_f64(bits[lo:lo + _CHUNK], "f32"), fmt, saturate, rounding)


def _encode_f32_via_table(bits: np.ndarray, flat: np.ndarray, fmt: FloatFormat, saturate: bool,
                          rounding: str, use_c: bool = True) -> None:
    """float32 -> bfloat16 rounded to odd (exact sticky bit) -> 16-bit table."""
    table = _table16(fmt, "bf16", saturate, rounding)
    if use_c and _kernels() is not None:
        _run_c("fp8ref_gather_f32_rto16", bits, flat, table)
        return
    for lo in range(0, bits.size, _CHUNK):
        u = bits[lo:lo + _CHUNK]
        np.take(table, (u | ((u & 0xFFFF) + 0xFFFF)) >> 16, out=flat[lo:lo + _CHUNK])


def _gather16(bits: np.ndarray, flat: np.ndarray, table: np.ndarray) -> None:
    if _kernels() is not None:
        _run_c("fp8ref_gather_u16", bits, flat, table)
        return
    for lo in range(0, bits.size, _CHUNK):
        np.take(table, bits[lo:lo + _CHUNK], out=flat[lo:lo + _CHUNK])


def _reject_unencodable(bits: np.ndarray, kind: str, fmt: FloatFormat, saturate: bool) -> None:
    """Formats without NaN/Inf codes (fp4/fp6) cannot take NaN, nor +-Inf without saturation."""
    values = bits if kind == "f64" else None
    nan = inf = 0
    for lo in range(0, bits.size, _CHUNK):
        chunk = values[lo:lo + _CHUNK] if values is not None else _bits_to_f64(bits[lo:lo + _CHUNK], kind)
        nan += int(np.isnan(chunk).sum())
        inf += int(np.isinf(chunk).sum())
    if nan:
        raise EncodeError(f"{fmt.name} has no NaN code: x holds {nan} NaN value(s)")
    if inf and not saturate:
        raise EncodeError(f"{fmt.name} has no Inf or NaN code: x holds {inf} infinite value(s) and "
                          f"saturate=False (use saturate=True to map them to +-{fmt.max:g})")


def _check_random_bits(random_bits, rounding: str, shape: tuple):
    if rounding != "stochastic":
        if random_bits is not None:
            raise InputTypeError(f"random_bits: only used with rounding='stochastic', got rounding={rounding!r}")
        return None, 0
    if random_bits is None:
        raise InputTypeError("random_bits: rounding='stochastic' needs an unsigned integer array of x's shape")
    if is_torch(random_bits):
        check_torch(random_bits, "random_bits")
    rb = random_bits.numpy() if is_torch(random_bits) else random_bits
    if isinstance(rb, (np.ndarray, np.generic)):
        rb = numpy_input(rb, "random_bits")
    if not isinstance(rb, (np.ndarray, np.generic)) or np.dtype(rb.dtype) not in _RANDOM_BITS_DTYPES:
        got = getattr(random_bits, "dtype", type(random_bits).__name__)
        raise InputTypeError(f"random_bits: expected a uint8, uint16 or uint32 array, got {got}")
    if tuple(rb.shape) != tuple(shape):
        raise InputTypeError(f"random_bits: expected shape {tuple(shape)} (the shape of x), got {tuple(rb.shape)}")
    return np.ascontiguousarray(rb).reshape(-1), _RANDOM_BITS_DTYPES[np.dtype(rb.dtype)]


def decode(codes, fmt: FloatFormat | str, *, out=None):
    """Values of uint8 ``codes`` in ``fmt``: float32 (float64 where ``fmt.decode_dtype`` says),
    same shape and library as ``codes``."""
    fmt = get_format(fmt)
    if is_torch(codes):
        check_torch(codes, "codes")
        if codes.dtype != torch().uint8:
            raise InputTypeError(f"codes: expected torch.uint8 codes, got {codes.dtype} "
                                 "(view float8 tensors with view_as_codes)")
        as_torch, arr = True, codes.detach().contiguous().reshape(-1).numpy()
    elif isinstance(codes, (np.ndarray, np.generic)):
        if codes.dtype != np.uint8:
            raise InputTypeError(f"codes: expected uint8 codes, got numpy {codes.dtype}")
        as_torch, arr = False, np.ascontiguousarray(numpy_input(codes, "codes")).reshape(-1)
    else:
        raise InputTypeError(f"codes: expected a numpy array or torch tensor of uint8, got {type(codes).__name__}")
    if fmt.bits < 8 and arr.size and int(arr.max()) >= fmt.n_codes:
        bad = int(arr[arr >= fmt.n_codes][0])
        raise FormatError(f"codes: {fmt.name} has {fmt.bits}-bit codes (< {fmt.n_codes:#x}), got {bad:#04x}")
    table = _decode_table(fmt)
    result, flat = output_buffer(out, _shape(codes), as_torch, table.dtype, "decode")
    if arr.size and table.dtype == np.float32 and _kernels() is not None:
        _run_c("fp8ref_decode_f32", arr, flat, table)
    elif arr.size:
        np.take(table, arr, out=flat)
    return result


# --------------------------------------------------------------------------------------------
# torch interop: zero-copy views between uint8 codes and torch float8 dtypes
# --------------------------------------------------------------------------------------------
def torch_dtype(fmt: FloatFormat | str):
    """The torch float8 dtype holding ``fmt``'s codes, or None if torch has none."""
    fmt = get_format(fmt)
    return getattr(torch(), fmt.torch_dtype_name, None) if fmt.torch_dtype_name else None


def view_as_float8(codes, fmt: FloatFormat | str):
    """View a torch uint8 code tensor as the torch float8 dtype of ``fmt`` (no copy)."""
    dtype = torch_dtype(fmt)
    if dtype is None:
        raise FormatError(f"torch has no dtype for {get_format(fmt).name}")
    if not is_torch(codes) or codes.dtype != torch().uint8:
        raise InputTypeError(f"codes: expected a torch.uint8 tensor, got {getattr(codes, 'dtype', type(codes))}")
    return codes.view(dtype)


def view_as_codes(tensor):
    """View a torch float8 tensor as its uint8 codes (no copy)."""
    if not is_torch(tensor) or tensor.element_size() != 1 or not tensor.dtype.is_floating_point:
        raise InputTypeError(f"tensor: expected a torch float8 tensor, got {getattr(tensor, 'dtype', type(tensor))}")
    return tensor.view(torch().uint8)
