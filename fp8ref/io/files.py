"""Plain files: reading text and JSON strictly (size-capped JSON, UTF-8, duplicate JSON keys
refused), reading and writing bytes; every failure a one-line ``Fp8RefError`` that names the file."""

from __future__ import annotations

import json
import os
from pathlib import Path

from ..errors import CheckpointError, Fp8RefError

MAX_JSON_BYTES = 100_000_000  # the header limit safetensors itself enforces


def no_duplicates(pairs: list[tuple[str, object]]) -> dict:
    """``object_pairs_hook`` that refuses a key given twice (json keeps the last one silently)."""
    out: dict = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r}")
        out[key] = value
    return out


def read_json(path: str | os.PathLike, what: str = "JSON file", *,
              error: type[Fp8RefError] = CheckpointError) -> object:
    path = Path(path)
    try:
        size = path.stat().st_size
        text = None if size > MAX_JSON_BYTES else path.read_text(encoding="utf-8")
    except OSError as exc:
        raise error(f"{path}: cannot read {what}: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise error(f"{path}: {what} is not valid JSON: {exc}") from None
    if text is None:
        raise error(f"{path}: {what} is {size} bytes, more than the {MAX_JSON_BYTES} limit")
    try:
        return json.loads(text, object_pairs_hook=no_duplicates)
    except ValueError as exc:
        raise error(f"{path}: {what} is not valid JSON: {exc}") from None



def read_text(path: str | os.PathLike, *, error: type[Fp8RefError]) -> str:
    path = Path(path)
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise error(f"{path}: cannot read: {exc}") from None


def read_bytes(path: str | os.PathLike, *, error: type[Fp8RefError]) -> bytes:
    path = Path(path)
    try:
        return path.read_bytes()
    except OSError as exc:
        raise error(f"{path}: cannot read: {exc.strerror or exc}") from None


def write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` atomically (a temporary file beside ``path``, then renamed)."""
    from .atomic import atomic_file

    with atomic_file(Path(path)) as tmp:
        tmp.write_bytes(data)
