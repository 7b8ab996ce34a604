"""Path arguments of the public API: a ``str`` or ``os.PathLike``, anything else one typed line."""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import InputTypeError


def path_arg(value, what: str = "path") -> Path:
    """``value`` as a Path, or InputTypeError naming the argument (``load_checkpoint(5)`` would
    otherwise end in pathlib's bare TypeError). bytes are refused: every name fp8ref prints is text."""
    if isinstance(value, (str, os.PathLike)) and not isinstance(value, bytes):
        path = os.fspath(value)
        if isinstance(path, str):
            if not path:
                raise InputTypeError(f"{what}: expected a file or folder path, got ''")
            return Path(path)
    raise InputTypeError(f"{what}: expected a file or folder path (str or os.PathLike), got {type(value).__name__}")
