"""The sign, exponent and mantissa fields of a code, as bit strings: how the CLI, mismatch
lines and reports show a code (pure; formats only)."""

from __future__ import annotations

from .formats import FloatFormat, get_format


def code_fields(code: int, fmt: FloatFormat | str) -> tuple[str, str, str]:
    """(sign bit, exponent bits, mantissa bits) of ``code``; the sign is "" for an unsigned
    format and the mantissa "" for a format without mantissa bits (e8m0)."""
    fmt = get_format(fmt)
    code, m = int(code), fmt.mantissa_bits
    sign = str(int(bool(code & fmt.sign_mask))) if fmt.signed else ""
    e = (code & fmt.magnitude_mask) >> m
    return sign, f"{e:0{fmt.exponent_bits}b}", f"{code & ((1 << m) - 1):0{m}b}" if m else ""


def fields_text(code: int, fmt: FloatFormat | str, *, sign: str = "bit") -> str:
    """The fields joined by dots. ``sign="bit"``: ``0.1111.110`` (no sign field when unsigned);
    ``sign="symbol"``: ``+.1111.110``, the sign field always shown (empty when unsigned: ``.11111111``)."""
    s, e, m = code_fields(code, fmt)
    if sign == "symbol":
        parts = [{"0": "+", "1": "-", "": ""}[s], e]
    else:
        parts = [s, e] if s else [e]
    return ".".join(parts + ([m] if m else []))
