"""Atomic writes: everything fp8ref writes appears complete or not at all.

A file or folder is built under a temporary name beside its destination and renamed into place,
so an interrupted run never leaves a half-written checkpoint or golden file behind.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from ..errors import CheckpointError


def is_inside(child: Path, root: Path) -> bool:
    try:
        child.relative_to(root)
        return True
    except ValueError:
        return False


@contextmanager
def atomic_file(path: Path) -> Iterator[Path]:
    """Yield a temporary path next to ``path``; rename it over ``path`` on success, delete it on failure."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        yield Path(tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_text(path: Path, text: str) -> None:
    with atomic_file(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


@contextmanager
def atomic_folder(dest: str | os.PathLike, *, force: bool = False,
                  protect: Iterable[str | os.PathLike] = ()) -> Iterator[Path]:
    """Yield an empty temporary folder beside ``dest``; on success it replaces ``dest``.

    Refuses an existing ``dest`` unless ``force``, and any ``dest`` that is, contains or lies
    inside a protected path (the source checkpoint). On any failure, interrupts included, the
    temporary folder is removed and ``dest`` is left as it was.
    """
    dest = Path(dest)
    real = dest.resolve()
    for p in protect:
        src = Path(p).resolve()
        if real == src or is_inside(real, src) or is_inside(src, real):
            raise CheckpointError(f"{dest}: output must not be, contain or lie inside the source {p}")
    if dest.exists() or dest.is_symlink():
        if not force:
            raise CheckpointError(f"{dest}: already exists; pass force=True (CLI: --force) to replace it")
        if not dest.is_dir() or dest.is_symlink():
            raise CheckpointError(f"{dest}: exists and is not a folder; refusing to replace it")
    if not dest.parent.is_dir():
        raise CheckpointError(f"{dest}: parent folder {dest.parent} does not exist")
    tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".partial"))
    try:
        yield tmp
        if dest.exists():
            old = Path(tempfile.mkdtemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".old"))
            os.replace(dest, old / "x")
            os.replace(tmp, dest)
            shutil.rmtree(old)
        else:
            os.replace(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
