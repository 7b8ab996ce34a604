"""``fp8ref formats``, ``fp8ref encode`` and ``fp8ref decode``: the codec from the shell."""

from __future__ import annotations

import numpy as np

from ..codec import ROUNDING_MODES, decode, encode
from ..codefields import fields_text
from ..errors import InputTypeError
from ..formats import FORMATS, get_format
from .output import add_json, emit_json


def register(sub) -> None:
    p = sub.add_parser("formats", help="table of the registered formats and their constants")
    add_json(p, "the formats")
    p.set_defaults(handler=cmd_formats)

    p = sub.add_parser("encode", help="encode decimal or hex-float values, e.g. 464 0x1.cp8 -- -nan "
                       "(-- before values that look like options)")
    p.add_argument("values", nargs="+", help="values parsed as float64 (Python float() or float.fromhex)")
    _common(p)
    p.add_argument("--rounding", default="rne", choices=ROUNDING_MODES, help="rounding mode (default rne)")
    p.add_argument("--random-bits", nargs="+", metavar="BITS", help="stochastic rounding: the random bits, one "
                   "integer per value (or one for all), e.g. 0x80000000")
    p.add_argument("--random-bits-dtype", choices=("uint8", "uint16", "uint32"), default="uint32",
                   help="width of --random-bits (default uint32)")
    p.add_argument("--no-saturate", dest="saturate", action="store_false", help="OCP non-saturating overflow")
    p.set_defaults(handler=cmd_encode)

    p = sub.add_parser("decode", help="decode codes given in hex (0x7e) or decimal")
    p.add_argument("codes", nargs="+")
    _common(p)
    p.set_defaults(handler=cmd_decode)


def _common(p) -> None:
    p.add_argument("--format", "-f", default="float8_e4m3fn", help="format name (default float8_e4m3fn)")
    add_json(p, "the rows")


def _parse_value(text: str) -> float:
    """float64 parse: float() (a decimal past float64's range is inf, as strtod makes it) or
    float.fromhex, whose overflow is a one-line error rather than an OverflowError traceback."""
    try:
        return float.fromhex(text) if "0x" in text.lower() and "p" in text.lower() else float(text)
    except OverflowError:
        raise InputTypeError(f"value {text!r}: a hex float beyond float64's range (largest "
                             f"0x1.fffffffffffffp+1023)") from None
    except ValueError:
        raise InputTypeError(f"value {text!r}: expected a decimal or hex float such as 464, 1e-3, 0x1.cp8") from None


def _parse_code(text: str) -> int:
    try:
        code = int(text, 0)
    except ValueError:
        raise InputTypeError(f"code {text!r}: expected an integer such as 0x7e or 126") from None
    if not 0 <= code <= 255:
        raise InputTypeError(f"code {text!r}: expected 0..255")
    return code


def _rows(codes: np.ndarray, fmt) -> list[dict]:
    values = decode(codes, fmt)
    return [{"code": f"{int(c):#04x}", "fields": fields_text(int(c), fmt), "value": float(v)}
            for c, v in zip(codes, values)]


def cmd_formats(args) -> int:
    rows = [fmt.describe() for fmt in FORMATS.values()]
    if emit_json(args.json, rows):
        return 0
    cols = ["name", "E", "M", "bias", "specials", "max", "max_code", "min_normal", "min_subnormal", "nan_code",
            "inf_code", "safetensors"]
    table = [[str(r[c]) if r[c] is not None else "-" for c in cols] for r in rows]
    widths = [max(len(c), *(len(t[i]) for t in table)) for i, c in enumerate(cols)]
    print("  ".join(c.ljust(w) for c, w in zip(cols, widths)))
    for t in table:
        print("  ".join(v.ljust(w) for v, w in zip(t, widths)))
    return 0


def cmd_encode(args) -> int:
    fmt = get_format(args.format)
    values = np.array([_parse_value(v) for v in args.values], dtype=np.float64)
    rows = _rows(encode(values, fmt, saturate=args.saturate, rounding=args.rounding,
                        random_bits=_random_bits(args, len(values))), fmt)
    for text, row in zip(args.values, rows):
        row["input"] = text
    _print(rows, args.json, ["input", "code", "fields", "value"])
    return 0


def _random_bits(args, n: int):
    if args.random_bits is None:
        if args.rounding == "stochastic":
            raise InputTypeError("--rounding stochastic needs --random-bits (one integer per value, or one for all)")
        return None
    if args.rounding != "stochastic":
        raise InputTypeError(f"--random-bits is only used with --rounding stochastic, not {args.rounding!r}")
    if len(args.random_bits) not in (1, n):
        raise InputTypeError(f"--random-bits: expected 1 or {n} integers (one per value), got {len(args.random_bits)}")
    limit = np.iinfo(args.random_bits_dtype).max
    bits = []
    for text in args.random_bits:
        try:
            b = int(text, 0)
        except ValueError:
            raise InputTypeError(f"--random-bits {text!r}: expected an integer such as 0x80000000") from None
        if not 0 <= b <= limit:
            raise InputTypeError(f"--random-bits {text!r}: expected 0..{limit:#x} ({args.random_bits_dtype})")
        bits.append(b)
    return np.array(bits * (n if len(bits) == 1 else 1), dtype=args.random_bits_dtype)


def cmd_decode(args) -> int:
    fmt = get_format(args.format)
    codes = np.array([_parse_code(c) for c in args.codes], dtype=np.uint8)
    _print(_rows(codes, fmt), args.json, ["code", "fields", "value"])
    return 0


def _print(rows: list[dict], as_json: str | None, cols: list[str]) -> None:
    if emit_json(as_json, rows):
        return
    for row in rows:
        print("  ".join(f"{c}={row[c]!r}" if c == "value" else f"{c}={row[c]}" for c in cols))
