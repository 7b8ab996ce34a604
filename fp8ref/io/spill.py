"""A scratch store of arrays on disk: ``fp8ref compare`` spills each layer's captured activations
here, so that it holds one layer's at a time, not the whole model's (a model whose activations do
not fit in memory is compared layer by layer). Raw bytes, one file per array (no pickle); the
folder is a private temporary directory removed on ``close``."""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np

from .._arrays import bits_view, numpy_bf16


class SpillStore:
    def __init__(self, where: str | None = None):
        self._dir = tempfile.TemporaryDirectory(prefix="fp8ref-spill-", dir=where)
        self._meta: dict[str, list[tuple[str, str, tuple]]] = {}  # key -> [(file, dtype, shape)]
        self._files = 0

    def append(self, key: str, array: np.ndarray) -> None:
        """Add ``array`` to the list under ``key`` (written to disk at once)."""
        a = np.ascontiguousarray(array)
        items = self._meta.setdefault(key, [])
        self._files += 1
        path = Path(self._dir.name) / f"{self._files}.bin"
        try:  # not ndarray.tofile: its short-write error ("32768 requested and 12288 written") names no file
            with open(path, "wb") as f:
                f.write(bits_view(a).reshape(-1).view(np.uint8).data)
        except OSError as exc:
            raise OSError(exc.errno, f"{exc.strerror or exc} (spilling activations {key!r}; the spill folder is "
                                     f"under {Path(self._dir.name).parent}: set TMPDIR to a larger disk)",
                          str(path)) from None
        items.append((str(path), a.dtype.name, a.shape))

    def get(self, key: str) -> list[np.ndarray]:
        """The arrays appended under ``key``, read back (fresh arrays)."""
        out = []
        for path, dtype, shape in self._meta.get(key, []):
            uint = np.uint16 if dtype == "bfloat16" else bits_view(np.empty(0, dtype)).dtype
            bits = np.fromfile(path, dtype=uint).reshape(shape)
            out.append(numpy_bf16(bits) if dtype == "bfloat16" else bits.view(dtype))
        return out

    def drop(self, key: str) -> None:
        for path, _, _ in self._meta.pop(key, []):
            Path(path).unlink(missing_ok=True)

    def close(self) -> None:
        self._meta.clear()
        self._dir.cleanup()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
