"""argparse ``type=`` functions for numeric options: each checks its range while the command line is
parsed, so an out-of-range number is argparse's one-line usage error (exit 2) before any file is
read, never a value that reaches torch (``--batch -3`` used to give "perplexity nan", exit 0)."""

from __future__ import annotations

import argparse

from ..errors import ModelError


def int_range(lo: int, hi: int, what: str = "an integer"):
    """A ``type=`` accepting decimal integers in ``lo..hi``."""

    def parse(text: str) -> int:
        shown = text if len(text) <= 40 else text[:37] + "..."
        try:
            value = int(text, 10) if len(text) <= 40 else None
        except ValueError:
            value = None
        if value is None or not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"expected {what} in {lo}..{hi}, got {shown!r}")
        return value

    parse.__name__ = "integer"  # argparse names the type in its own messages
    return parse


def random_shape(text: str) -> str:
    """``--random BxT``, checked for form and bounds (``fp8ref.nn.tokens.parse_random``)."""
    from ..nn.tokens import parse_random

    try:
        parse_random(text)
    except ModelError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--random: ")) from None
    return text.strip()
