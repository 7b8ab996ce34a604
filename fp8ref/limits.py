"""The declared ranges of what an untrusted file may say: every integer field, name and nesting depth.

A spec, a checkpoint's config or header, a calibration file or a suite is checked against these
when it is validated, so that nothing out of range reaches numpy or the C loops (a block size of
2**64 wraps to 0 in a ``size_t`` and divides by zero there). One table, so the ranges agree.
"""

from __future__ import annotations

MAX_GROUP = 2**31 - 1
"""Group sizes and block dimensions: 1..MAX_GROUP (int32, as every producer's config and kernel
holds them; larger than any tensor dimension a group is cut from)."""

MAX_DIM = 2**63 - 1
"""A tensor dimension, and a tensor's element count: 0..MAX_DIM (numpy's intp, the C loops' int64)."""

MAX_NAME = 1024
"""Characters in a tensor, layer or selector name (real ones are under 200)."""

MAX_PATTERN = 1024
"""Characters in a regular expression from a file (``re:`` selectors, ignore lists, extra_config keys)."""

MAX_DEPTH = 64
"""Nesting of JSON/YAML containers (real configs nest under 10; Python's parsers recurse)."""

MAX_SEQUENCE = 65536
"""Token ids in one sequence of ``compare``/``eval``: --seq-len, --random's T, a --tokens line."""

MAX_RANDOM_IDS = 1 << 22
"""Ids ``--random BxT`` makes (B x T), and the most ``compare`` runs in its one pass: 4,194,304
(32 MiB as int64; every layer's activations of as many tokens are held or spilled)."""

MAX_BATCH = 65536
"""Sequences per forward pass of ``eval --batch``."""


def int_in(value: object, lo: int, hi: int) -> bool:
    """``value`` is an int (not a bool) with ``lo <= value <= hi``."""
    return type(value) is int and lo <= value <= hi


def shown(value: object, width: int = 80) -> str:
    """``repr(value)`` cut to ``width`` characters; a huge int is summarised (repr would raise
    past Python's 4300-digit limit, and a 4000-digit number makes no error message readable)."""
    if type(value) is int and value.bit_length() > 256:
        return f"<an integer of {value.bit_length()} bits>"
    try:
        text = repr(value)
    except (ValueError, RecursionError):
        return f"<{type(value).__name__}>"
    return text if len(text) <= width else text[: width - 3] + "..."
