"""The field types of a suite's ``operations`` entries: each checker takes (document, key path,
value), returns the typed value or raises SpecError naming ``FILE:LINE: key.path``.

An operation declares its fields as ``{name: (checker, default)}`` (default None: required).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

from ..io.yaml import YamlDocument

LEVELS = (1, 2)

Checker = Callable[[YamlDocument, tuple, object], object]


def check_str(doc: YamlDocument, path: tuple, value) -> str:
    if not isinstance(value, str) or not value:
        raise doc.error(path, f"expected a non-empty string, got {value!r}")
    return value


def check_level(doc: YamlDocument, path: tuple, value) -> int:
    if value not in LEVELS or type(value) is not int:
        raise doc.error(path, f"expected a level in {list(LEVELS)}, got {value!r}")
    return value


def choices(options: tuple, *, allow_all: bool = True, kind: type = str, allow_empty: bool = False) -> Checker:
    """A list drawn from ``options`` (or the word ``all``), kept in the written order."""

    def check(doc: YamlDocument, path: tuple, value):
        if allow_all and value == "all":
            return tuple(options)
        if not isinstance(value, list) or not (value or allow_empty):
            raise doc.error(path, f"expected a {'' if allow_empty else 'non-empty '}list from {list(options)}"
                            + (" or 'all'" if allow_all else "") + f", got {value!r}")
        for i, v in enumerate(value):
            if type(v) is not kind or v not in options:
                raise doc.error(path + (i,), f"expected one of {list(options)}, got {v!r}")
        if len(set(value)) != len(value):
            raise doc.error(path, f"duplicate entries in {value!r}")
        return tuple(value)

    return check


def per_level(item: Checker) -> Checker:
    """``{level: value}``; the value for level L is the one under the largest key <= L."""

    def check(doc: YamlDocument, path: tuple, value):
        if not isinstance(value, dict) or not value:
            raise doc.error(path, f"expected a mapping from level {list(LEVELS)} to a value, got {value!r}")
        out = {}
        for key, v in value.items():
            out[check_level(doc, path + (key,), key)] = item(doc, path + (key,), v)
        if min(out) != 1:
            raise doc.error(path, "level 1 must be given (higher levels inherit from lower ones)")
        return out

    return check


def count(limit: int) -> Checker:
    def check(doc: YamlDocument, path: tuple, value):
        if type(value) is not int or not 0 <= value <= limit:
            raise doc.error(path, f"expected an integer count in [0, {limit}], got {value!r}")
        return value

    return check


def shapes(rank: int, limit: int = 4096) -> Checker:
    """A list of shapes, each a list of ``rank`` positive integers."""

    def check(doc: YamlDocument, path: tuple, value):
        if not isinstance(value, list) or not value:
            raise doc.error(path, f"expected a non-empty list of shapes [{', '.join('d' * rank)}], got {value!r}")
        for i, s in enumerate(value):
            if (not isinstance(s, list) or len(s) != rank
                    or any(type(d) is not int or not 1 <= d <= limit for d in s)):
                raise doc.error(path + (i,), f"expected {rank} integers in [1, {limit}], got {s!r}")
        return tuple(tuple(s) for s in value)

    return check


def at_level(table: Mapping[int, object], level: int):
    return table[max(k for k in table if k <= level)]


def bit_patterns(limit: int = 1 << 16) -> Checker:
    """Literal inputs: a non-empty list of at most ``limit`` hex strings (``"0x3f800000"``), bit patterns
    of the case's input dtype or codes, as imported peer vectors carry them (fp8ref.golden.onnx_node)."""

    def check(doc: YamlDocument, path: tuple, value):
        if not isinstance(value, list) or not value or len(value) > limit:
            raise doc.error(path, f"expected a list of 1 to {limit} hex strings like '0x3f800000', got {value!r:.80}")
        out = []
        for i, v in enumerate(value):
            digits = v[2:] if isinstance(v, str) and v.startswith("0x") else ""
            if not 1 <= len(digits) <= 16 or any(c not in "0123456789abcdefABCDEF" for c in digits):
                raise doc.error(path + (i,), f"expected a hex string like '0x3f800000', got {v!r}")
            out.append(int(digits, 16))
        return tuple(out)

    return check


def one_of(options: tuple) -> Checker:
    """One string from ``options``."""

    def check(doc: YamlDocument, path: tuple, value):
        if not isinstance(value, str) or value not in options:
            raise doc.error(path, f"expected one of {list(options)}, got {value!r}")
        return value

    return check


def numbers(*, positive: bool = False) -> Checker:
    """A non-empty list of distinct finite numbers (``positive``: each > 0), as floats in the written order."""

    def check(doc: YamlDocument, path: tuple, value):
        kind = "positive " if positive else ""
        if not isinstance(value, list) or not value:
            raise doc.error(path, f"expected a non-empty list of finite {kind}numbers, got {value!r}")
        out = []
        for i, v in enumerate(value):
            if type(v) not in (int, float) or not math.isfinite(v) or (positive and v <= 0):
                raise doc.error(path + (i,), f"expected a finite {kind}number, got {v!r}")
            out.append(float(v))
        if len(set(out)) != len(out):
            raise doc.error(path, f"duplicate entries in {value!r}")
        return tuple(out)

    return check
