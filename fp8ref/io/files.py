"""Plain files: reading text and JSON strictly (regular files only, size-capped, UTF-8, duplicate
JSON keys and deep nesting refused), reading bytes, and writing them by the output rule
(``io.outputs``); every failure a one-line ``Fp8RefError`` that names the file."""

from __future__ import annotations

import json
import math
import os
import stat
from pathlib import Path

from ..errors import CheckpointError, Fp8RefError
from ..limits import MAX_DEPTH
from .atomic import atomic_file
from .outputs import STREAM, output_kind, write_into

MAX_JSON_BYTES = 100_000_000  # the header limit safetensors itself enforces
MAX_TEXT_BYTES = 16 << 20  # specs, suites, xfails and name lists are kilobytes
MAX_INPUT_BYTES = 1 << 30  # compare/eval --text and --tokens
MAX_FILE_BYTES = 1 << 40


def no_duplicates(pairs: list[tuple[str, object]]) -> dict:
    """``object_pairs_hook`` that refuses a key given twice (json keeps the last one silently)."""
    out: dict = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r}")
        out[key] = value
    return out


def open_regular(path: str | os.PathLike, *, error: type[Fp8RefError] = CheckpointError, what: str = "file"):
    """``path`` opened for binary reading, refused unless it is a regular file: a FIFO would block
    the open, /dev/zero never ends, a folder reads as an error. Opened non-blocking (which a FIFO
    needs to open at all), checked with fstat, so nothing is swapped in between."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except (OSError, ValueError) as exc:  # ValueError: a NUL byte in the name
        raise error(f"{path}: cannot read {what}: {getattr(exc, 'strerror', None) or exc}") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        kind = "a folder" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode) else \
            "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "a socket" if stat.S_ISSOCK(mode) else \
            "not a regular file"
        raise error(f"{path}: cannot read {what}: {kind}, expected a regular file")
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")


def read_range(path, what: str, name: str, offset: int, nbytes: int):
    """``nbytes`` bytes of tensor ``name`` at ``offset`` of a regular file, as a fresh uint8 array;
    an OS error or a file that shrank while read is one ``CheckpointError`` naming both."""
    import numpy as np

    out = np.empty(nbytes, np.uint8)
    try:
        with open_regular(path, what=what) as fh:  # swapped for a FIFO since: refused
            fh.seek(offset)
            got = fh.readinto(memoryview(out))
    except OSError as exc:
        raise CheckpointError(f"{path}: tensor {name!r}: cannot read: {exc.strerror or exc}") from None
    if got != nbytes:
        raise CheckpointError(f"{path}: tensor {name!r}: file changed while reading (got {got} of {nbytes} bytes)")
    return out


def read_bytes(path: str | os.PathLike, *, error: type[Fp8RefError], limit: int = MAX_FILE_BYTES,
               what: str = "file") -> bytes:
    """The bytes of a regular file of at most ``limit`` bytes."""
    path = Path(path)
    with open_regular(path, error=error, what=what) as f:
        size = os.fstat(f.fileno()).st_size
        chunks, total = [], 0
        try:  # the stat size first, then on to EOF (a /proc file says 0), never past the limit
            while total <= limit:
                chunk = f.read(min(max(size + 1 - total, 1 << 16), limit + 1 - total))
                if not chunk:
                    break
                chunks.append(chunk)
                total += len(chunk)
        except OSError as exc:
            raise error(f"{path}: cannot read {what}: {exc.strerror or exc}") from None
    if total > limit:
        raise error(f"{path}: {what} is more than the {limit} bytes fp8ref reads")
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def read_text(path: str | os.PathLike, *, error: type[Fp8RefError], limit: int = MAX_TEXT_BYTES,
              what: str = "file") -> str:
    path = Path(path)
    data = read_bytes(path, error=error, limit=limit, what=what)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise error(f"{path}: cannot read {what}: not UTF-8 text: {exc}") from None


def parse_json(text: str | bytes, where: str, what: str = "JSON", *,
               error: type[Fp8RefError] = CheckpointError) -> object:
    """JSON text -> data: duplicate keys and containers nested deeper than ``limits.MAX_DEPTH``
    are errors (the parser recurses; so do the printers and walkers of its result)."""
    try:
        data = json.loads(text, object_pairs_hook=no_duplicates)
    except RecursionError:
        raise error(f"{where}: {what} is nested deeper than {MAX_DEPTH} levels") from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, a 5,000-digit integer
        raise error(f"{where}: {what} is not valid JSON: {exc}") from None
    if _depth(data) > MAX_DEPTH:
        raise error(f"{where}: {what} is nested deeper than {MAX_DEPTH} levels")
    return data


def json_safe(v):
    """inf / NaN as the strings "inf", "-inf", "nan" (JSON has no such numbers)."""
    if isinstance(v, float) and not math.isfinite(v):
        return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")
    if isinstance(v, dict):
        return {k: json_safe(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [json_safe(x) for x in v]
    return v


def _depth(data: object) -> int:
    """How deep lists and objects nest (iteratively: the data may be deep)."""
    deepest, stack = 0, [(data, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, dict):
            value = value.values()
        elif not isinstance(value, list):
            continue
        deepest = max(deepest, depth)
        if deepest > MAX_DEPTH:
            break
        stack.extend((v, depth + 1) for v in value if isinstance(v, (dict, list)))
    return deepest


def read_json(path: str | os.PathLike, what: str = "JSON file", *,
              error: type[Fp8RefError] = CheckpointError) -> object:
    path = Path(path)
    data = read_bytes(path, error=error, limit=MAX_JSON_BYTES, what=what)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise error(f"{path}: {what} is not valid JSON: {exc}") from None
    return parse_json(text, str(path), what, error=error)


def write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` by the output rule (``io.outputs``): into a FIFO or a character
    device; atomically (a temporary file beside it, fsync, rename) into a regular file, a link's
    target or a new path. A write error names ``path``."""
    if output_kind(path) == STREAM:
        write_into(path, data)
        return
    with atomic_file(Path(path)) as tmp:
        tmp.write_bytes(data)
