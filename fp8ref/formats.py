"""Small floating-point formats, described by their parameters.

A ``FloatFormat`` is pure data: exponent bits, mantissa bits, bias, sign, whether code 0 is
zero, and how the format spends codes on Inf/NaN. Every other constant (max, min normal,
the NaN code, ...) is derived from those, so a user-defined ExMy format works everywhere.

Special-value styles (``specials``), following the naming of LLVM/ml_dtypes:

``ieee``  exponent all ones is Inf (mantissa 0) or NaN (mantissa != 0): float8_e5m2.
``fn``    no Inf; only the all-ones magnitude code is NaN (0x7F/0xFF): float8_e4m3fn,
          and the unsigned float8_e8m0fnu (0xFF).
``fnuz``  no Inf, no negative zero; the single NaN is the negative-zero code (0x80).
``none``  no Inf and no NaN at all: the MX element formats fp4/fp6.
``p3109`` IEEE P3109's extended domain: no negative zero; the single NaN is the negative-zero
          code (0x80), +-Inf are the all-ones magnitude codes (0x7F/0xFF): binary8p1..binary8p7.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from fractions import Fraction
from functools import cached_property

from .errors import FormatError, UnknownFormatError, did_you_mean

SPECIALS = ("ieee", "fn", "fnuz", "none", "p3109")


@dataclass(frozen=True)
class FloatFormat:
    """An ExMy floating-point format with at most 8 bits (codes are uint8)."""

    name: str
    exponent_bits: int
    mantissa_bits: int
    bias: int
    specials: str = "fn"
    signed: bool = True
    has_zero: bool = True
    safetensors_dtype: str | None = None
    torch_dtype_name: str | None = None

    def __post_init__(self) -> None:
        e, m = self.exponent_bits, self.mantissa_bits
        where = f"FloatFormat {self.name!r}"
        for field in ("exponent_bits", "mantissa_bits", "bias"):
            if type(getattr(self, field)) is not int:
                raise FormatError(f"{where}: {field} must be an int, got {getattr(self, field)!r}")
        if e < 1:
            raise FormatError(f"{where}: exponent_bits must be >= 1, got {e}")
        if m < 0:
            raise FormatError(f"{where}: mantissa_bits must be >= 0, got {m}")
        if self.bits > 8:
            raise FormatError(f"{where}: at most 8 bits fit a uint8 code, got {self.bits} "
                              f"(sign {int(self.signed)} + E{e} + M{m})")
        if self.specials not in SPECIALS:
            raise FormatError(f"{where}: specials must be one of {SPECIALS}, got {self.specials!r}")
        if self.specials == "ieee" and (e < 2 or m < 1):
            raise FormatError(f"{where}: 'ieee' specials need exponent_bits >= 2 and "
                              f"mantissa_bits >= 1 to hold both Inf and NaN, got E{e}M{m}")
        if self.specials in ("fnuz", "p3109") and not self.signed:
            raise FormatError(f"{where}: {self.specials!r} puts NaN at the negative-zero code, so it needs a sign bit")
        if not self.has_zero and (self.signed or self.specials in ("fnuz", "p3109")):
            raise FormatError(f"{where}: a format without zero must be unsigned with 'fn' or 'ieee' specials "
                              f"(like float8_e8m0fnu); got signed={self.signed}, specials={self.specials!r}")
        if self.max_code_magnitude < 1:
            raise FormatError(f"{where}: no finite nonzero value is left after the special codes")
        if abs(self.bias) > 900 or abs(self.emax) > 900:
            raise FormatError(f"{where}: exponent range must stay inside float64, got bias {self.bias}")

    # --- layout -------------------------------------------------------------------------
    @property
    def bits(self) -> int:
        return int(self.signed) + self.exponent_bits + self.mantissa_bits

    @property
    def n_codes(self) -> int:
        return 1 << self.bits

    @property
    def sign_mask(self) -> int:
        """The sign bit of a code, 0 for unsigned formats."""
        return (1 << (self.exponent_bits + self.mantissa_bits)) if self.signed else 0

    @property
    def magnitude_mask(self) -> int:
        return (1 << (self.exponent_bits + self.mantissa_bits)) - 1

    @property
    def has_subnormals(self) -> bool:
        """Exponent field 0 holds zero and subnormals unless the format has no zero."""
        return self.has_zero

    @property
    def has_inf(self) -> bool:
        return self.specials in ("ieee", "p3109")

    @property
    def has_nan(self) -> bool:
        return self.specials != "none"

    @property
    def has_negative_zero(self) -> bool:
        return self.signed and self.has_zero and self.specials not in ("fnuz", "p3109")

    # --- special codes ------------------------------------------------------------------
    @property
    def max_code_magnitude(self) -> int:
        """Code (without sign) of the largest finite value."""
        top = self.magnitude_mask
        if self.specials == "ieee":
            return top - (1 << self.mantissa_bits)  # exponent all ones is reserved
        if self.specials in ("fn", "p3109"):
            return top - 1  # only the all-ones code is NaN (fn) or Inf (p3109)
        return top

    @property
    def max_code(self) -> int:
        return self.max_code_magnitude

    @property
    def inf_code(self) -> int | None:
        """Code of +Inf (OR ``sign_mask`` for -Inf), or None."""
        if self.specials == "p3109":
            return self.magnitude_mask
        return (self.magnitude_mask >> self.mantissa_bits) << self.mantissa_bits if self.has_inf else None

    @property
    def nan_code(self) -> int | None:
        """The canonical NaN code fp8ref writes for a positive NaN (see ``nan_codes``)."""
        if self.specials == "ieee":  # quiet NaN: exponent all ones, mantissa MSB set
            return self.inf_code | (1 << (self.mantissa_bits - 1))
        if self.specials == "fn":
            return self.magnitude_mask
        if self.specials in ("fnuz", "p3109"):
            return self.sign_mask
        return None

    @cached_property
    def nan_codes(self) -> frozenset[int]:
        """Every code that decodes to NaN."""
        codes = [c for c in range(self.n_codes) if self._is_nan_code(c)]
        return frozenset(codes)

    def _is_nan_code(self, code: int) -> bool:
        mag = code & self.magnitude_mask
        if self.specials == "ieee":
            return mag > self.inf_code
        if self.specials == "fn":
            return mag == self.magnitude_mask
        if self.specials in ("fnuz", "p3109"):
            return code == self.sign_mask
        return False

    # --- values -------------------------------------------------------------------------
    @property
    def emin(self) -> int:
        """Unbiased exponent of the smallest normal value."""
        return (1 if self.has_subnormals else 0) - self.bias

    @property
    def emax(self) -> int:
        return (self.max_code_magnitude >> self.mantissa_bits) - self.bias

    def exact_value(self, code: int) -> Fraction | None:
        """Exact value of a finite code from the definition; None for NaN/Inf codes."""
        if not 0 <= code < self.n_codes:
            raise FormatError(f"{self.name}: code {code:#x} is outside 0..{self.n_codes - 1:#x}")
        if self._is_nan_code(code) or (self.has_inf and code & self.magnitude_mask == self.inf_code):
            return None
        m = self.mantissa_bits
        field_e = (code & self.magnitude_mask) >> m
        frac = code & ((1 << m) - 1)
        if field_e == 0 and self.has_subnormals:
            mag = Fraction(frac, 1 << m) * Fraction(2) ** (1 - self.bias)
        else:
            mag = (1 + Fraction(frac, 1 << m)) * Fraction(2) ** (field_e - self.bias)
        return -mag if code & self.sign_mask else mag

    @property
    def max(self) -> float:
        return float(self.exact_value(self.max_code_magnitude))

    @property
    def min_normal(self) -> float:
        return float(Fraction(2) ** self.emin)

    @property
    def min_subnormal(self) -> float | None:
        """Smallest positive value, if the format has subnormals."""
        if not self.has_subnormals or self.mantissa_bits == 0:
            return None
        return float(Fraction(2) ** (self.emin - self.mantissa_bits))

    @property
    def min_positive(self) -> float:
        return self.min_subnormal if self.min_subnormal is not None else self.min_normal

    @property
    def eps(self) -> float:
        """Distance from 1.0 to the next larger value: 2**-mantissa_bits."""
        return 2.0 ** -self.mantissa_bits

    # --- numpy.finfo-style names (ml_dtypes keeps them for its formats) ------------------
    @property
    def nmant(self) -> int:
        return self.mantissa_bits

    @property
    def nexp(self) -> int:
        return self.exponent_bits

    @property
    def machep(self) -> int:
        """The exponent of ``eps``: eps == 2**machep."""
        return -self.mantissa_bits

    @cached_property
    def epsneg(self) -> float:
        """Distance from 1.0 down to the next smaller value (subnormal spacing where 1.0 is the
        smallest normal, as in float4_e2m1fn)."""
        below = [v for c in range(self.magnitude_mask + 1) if (v := self.exact_value(c)) is not None and v < 1]
        return float(1 - max(below)) if below else 2.0 ** -(self.mantissa_bits + 1)  # (numpy's formula)

    @property
    def minexp(self) -> int:
        return self.emin

    @property
    def maxexp(self) -> int:
        """The smallest power of two that overflows (numpy's maxexp): emax + 1."""
        return self.emax + 1

    @property
    def tiny(self) -> float:
        return self.min_normal

    @property
    def smallest_normal(self) -> float:
        return self.min_normal

    @property
    def smallest_subnormal(self) -> float:
        """The smallest positive value (the smallest normal where there are no subnormals, as in
        ml_dtypes' finfo of float8_e8m0fnu)."""
        return self.min_positive

    # --- gfloat-style code names (None where the format has no such code) ----------------
    @property
    def code_of_nan(self) -> int | None:
        return self.nan_code

    @property
    def code_of_posinf(self) -> int | None:
        return self.inf_code

    @property
    def code_of_neginf(self) -> int | None:
        return None if self.inf_code is None else self.inf_code | self.sign_mask

    @property
    def code_of_zero(self) -> int | None:
        return 0 if self.has_zero else None

    @property
    def code_of_negzero(self) -> int | None:
        return self.sign_mask if self.has_negative_zero else None

    @property
    def code_of_max(self) -> int:
        return self.max_code_magnitude

    @property
    def code_of_min(self) -> int | None:
        """Code of the most negative finite value (-max), None for unsigned formats."""
        return self.max_code_magnitude | self.sign_mask if self.signed else None

    @property
    def code_of_smallest_normal(self) -> int:
        return (1 << self.mantissa_bits) if self.has_subnormals else 0

    @property
    def code_of_smallest_subnormal(self) -> int | None:
        return 1 if self.has_subnormals and self.mantissa_bits else None

    @property
    def decode_dtype(self) -> str:
        """``float32`` when every value is exact in float32, else ``float64``."""
        fits = self.emax <= 127 and self.emin - self.mantissa_bits >= -149 and self.mantissa_bits <= 23
        return "float32" if fits else "float64"

    def describe(self) -> dict:
        """The format's parameters and derived constants, for tables and JSON."""
        hexcode = lambda c: None if c is None else f"{c:#04x}"  # noqa: E731
        return {
            "name": self.name, "bits": self.bits, "E": self.exponent_bits, "M": self.mantissa_bits,
            "bias": self.bias, "specials": self.specials, "signed": self.signed,
            "max": self.max, "max_code": hexcode(self.max_code), "min_normal": self.min_normal,
            "min_subnormal": self.min_subnormal, "eps": self.eps, "inf_code": hexcode(self.inf_code),
            "nan_code": hexcode(self.nan_code), "negative_zero": self.has_negative_zero,
            "safetensors": self.safetensors_dtype,
        }


def _registry() -> dict[str, FloatFormat]:
    f = FloatFormat
    formats = [
        f("float8_e4m3fn", 4, 3, 7, "fn", safetensors_dtype="F8_E4M3", torch_dtype_name="float8_e4m3fn"),
        f("float8_e5m2", 5, 2, 15, "ieee", safetensors_dtype="F8_E5M2", torch_dtype_name="float8_e5m2"),
        f("float8_e4m3fnuz", 4, 3, 8, "fnuz", safetensors_dtype="F8_E4M3FNUZ",
          torch_dtype_name="float8_e4m3fnuz"),
        f("float8_e5m2fnuz", 5, 2, 16, "fnuz", safetensors_dtype="F8_E5M2FNUZ",
          torch_dtype_name="float8_e5m2fnuz"),
        f("float8_e4m3b11fnuz", 4, 3, 11, "fnuz"),
        f("float8_e8m0fnu", 8, 0, 127, "fn", signed=False, has_zero=False, safetensors_dtype="F8_E8M0",
          torch_dtype_name="float8_e8m0fnu"),
        f("float4_e2m1fn", 2, 1, 1, "none", safetensors_dtype="F4"),
        f("float6_e2m3fn", 2, 3, 1, "none", safetensors_dtype="F6_E2M3"),
        f("float6_e3m2fn", 3, 2, 3, "none", safetensors_dtype="F6_E3M2"),
        *(p3109_binary8(p) for p in range(1, 8)),
    ]
    return {fmt.name: fmt for fmt in formats}


def p3109_binary8(precision: int) -> FloatFormat:
    """IEEE P3109 binary8p{precision}, signed, extended domain: precision P significand bits (the
    hidden one included), so 8 - P exponent bits, P - 1 stored mantissa bits and bias 2**(7 - P)
    (the interim report's 2**(K - P - 1) for K = 8)."""
    if type(precision) is not int or not 1 <= precision <= 7:
        raise FormatError(f"binary8p: the signed P3109 binary8 formats have precision 1..7, got {precision!r}")
    return FloatFormat(f"binary8p{precision}", 8 - precision, precision - 1, 2 ** (7 - precision), "p3109")


# Other spellings of the P3109 names: ``p3109_p3`` and gfloat's ``p3109_k8p3se``.
_ALIASES = {alias.format(p=p): f"binary8p{p}" for p in range(1, 8) for alias in ("p3109_p{p}", "p3109_k8p{p}se")}


class _Registry(Mapping):
    """Read-only name -> FloatFormat mapping whose misses suggest close names."""

    def __init__(self, formats: dict[str, FloatFormat]):
        self._formats = formats

    def __getitem__(self, name: str) -> FloatFormat:
        try:
            return self._formats[_ALIASES.get(name, name)]
        except (KeyError, TypeError):
            hint = did_you_mean(name, self._formats, n=3, clause=True)
            raise UnknownFormatError(
                f"unknown format {name!r}{hint} (known: {', '.join(self._formats)})") from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._formats)

    def __len__(self) -> int:
        return len(self._formats)


FORMATS: Mapping[str, FloatFormat] = _Registry(_registry())


def get_format(fmt: FloatFormat | str) -> FloatFormat:
    """Accept a FloatFormat, a registered name, or a torch or ml_dtypes/numpy dtype of that name
    (``torch.float8_e4m3fn``, ``ml_dtypes.float8_e5m2``): the names follow ml_dtypes/LLVM, so
    the dtype names the format; nothing of the other library is used."""
    if isinstance(fmt, FloatFormat):
        return fmt
    if not isinstance(fmt, str):
        name = _dtype_name(fmt)
        if name is None:
            raise UnknownFormatError(f"fmt must be a FloatFormat, a format name or a torch/ml_dtypes dtype, got "
                                     f"{type(fmt).__name__}")
        fmt = name
    return FORMATS[fmt]


def _dtype_name(obj) -> str | None:
    """'float8_e4m3fn' for torch.float8_e4m3fn, numpy/ml_dtypes dtypes and their scalar types."""
    import numpy as np

    if type(obj).__module__ == "torch" and type(obj).__name__ == "dtype":
        return str(obj).removeprefix("torch.")
    if isinstance(obj, np.dtype):
        return obj.name
    if isinstance(obj, type) and issubclass(obj, np.generic):
        return np.dtype(obj).name
    return None


# --- the one format <-> safetensors dtype map -------------------------------------------------

@dataclass(frozen=True)
class StorageDType:
    """A safetensors dtype string: its width in bits, the numpy dtype string its elements are read
    as (None for sub-byte packed dtypes) and, for the small float formats, the fp8ref format name.
    Small floats are read as their uint8 codes (fp8ref decodes them itself); BF16 as its uint16 bits."""

    name: str
    bits: int
    numpy: str | None
    fmt: str | None = None


def _storage_dtypes() -> dict[str, StorageDType]:
    s = StorageDType
    plain = [s("BOOL", 8, "|b1"), s("U8", 8, "|u1"), s("I8", 8, "|i1"), s("I16", 16, "<i2"), s("U16", 16, "<u2"),
             s("I32", 32, "<i4"), s("U32", 32, "<u4"), s("I64", 64, "<i8"), s("U64", 64, "<u8"),
             s("F16", 16, "<f2"), s("BF16", 16, "<u2"), s("F32", 32, "<f4"), s("F64", 64, "<f8"),
             s("C64", 64, "<c8")]
    small = [s(f.safetensors_dtype, f.bits, "|u1" if f.bits == 8 else None, f.name)
             for f in FORMATS.values() if f.safetensors_dtype]
    return {t.name: t for t in plain + small}


SAFETENSORS_DTYPES: Mapping[str, StorageDType] = _storage_dtypes()
WIDE_FLOAT_DTYPES: Mapping[str, str] = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}
"""The wide float dtypes a model or a scale is stored in, by name -> safetensors dtype string."""

