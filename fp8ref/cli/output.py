"""What every command prints the same way: warning lines."""

from __future__ import annotations

import sys


def warn(text: object) -> None:
    """One ``fp8ref: warning: ...`` line on stderr."""
    print(f"fp8ref: warning: {text}", file=sys.stderr)


def show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """``warnings.showwarning`` for the CLI: a Python warning (fp8ref's or a library's) prints as
    one warning line, without the source line Python would add."""
    warn(message)
