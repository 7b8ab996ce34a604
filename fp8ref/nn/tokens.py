"""Token ids for ``compare`` and ``eval`` without a hub tokenizer.

- ``--tokens FILE``: whitespace-separated integer ids, one sequence per line (all lines the same
  length, 2..``MAX_SEQUENCE`` ids), each in [0, vocab).
- ``--text FILE``: the file's bytes, each byte b -> id ``b % vocab``, cut into sequences of
  ``seq_len`` ids (the last partial one dropped; a shorter file is one sequence). This is not the
  model's tokenizer: perplexities are comparable between modes of one checkpoint, not to
  published numbers.
- ``--random BxT``: B sequences of T ids, uniform in [0, vocab), torch generator seed 0.

Both files are read through ``fp8ref.io.files`` (regular files only, at most ``MAX_INPUT_BYTES``).
Text is read straight into one uint8 array, 1 byte of memory per byte of text (a byte's id is below
256 whatever the vocabulary), and stays uint8 until a batch runs (``as_model_ids``); token files
parse line by line into an int64 array (8 bytes per id), never into Python lists of the whole file.
"""

from __future__ import annotations

import array
import os
import re

import numpy as np
import torch

from ..errors import ModelError
from ..io.files import MAX_INPUT_BYTES, open_regular
from ..limits import MAX_RANDOM_IDS, MAX_SEQUENCE

MAX_LINE_BYTES = 16 * MAX_SEQUENCE
"""Longest --tokens line read (16 bytes per id: digits and whitespace)."""


def _size_checked(f, path) -> int:
    size = os.fstat(f.fileno()).st_size
    if size > MAX_INPUT_BYTES:
        raise ModelError(f"{path}: {size} bytes, more than the {MAX_INPUT_BYTES} bytes fp8ref reads as input")
    return size


def read_tokens(path, vocab: int) -> torch.Tensor:
    """[lines, ids] int64 token ids of a --tokens file."""
    ids = array.array("q")
    width = None
    lines = 0
    with open_regular(path, error=ModelError, what="token ids") as f:
        _size_checked(f, path)
        read, i = 0, 0
        while raw := f.readline(MAX_LINE_BYTES + 1):
            i += 1
            read += len(raw)
            if read > MAX_INPUT_BYTES:  # the file grew while being read
                raise ModelError(f"{path}: more than the {MAX_INPUT_BYTES} bytes fp8ref reads as input")
            if len(raw) > MAX_LINE_BYTES:
                raise ModelError(f"{path}:{i}: line longer than {MAX_LINE_BYTES} bytes; expected at most "
                                 f"{MAX_SEQUENCE} ids per line")
            try:
                row = [int(t) for t in raw.split()]
            except ValueError:
                raise ModelError(f"{path}:{i}: expected whitespace-separated integer token ids") from None
            if not row:
                continue
            bad = [t for t in row if not 0 <= t < vocab]
            if bad:
                raise ModelError(f"{path}:{i}: token id {bad[0]} outside [0, {vocab})")
            if width is None:
                width = len(row)
            if len(row) != width or not 2 <= width <= MAX_SEQUENCE:
                raise ModelError(f"{path}:{i}: {len(row)} ids; expected lines of equal length, 2..{MAX_SEQUENCE} "
                                 f"ids, one sequence per line")
            ids.extend(row)
            lines += 1
    if not lines:
        raise ModelError(f"{path}: no token ids; expected lines of equal length >= 2 ids, one sequence per line")
    return torch.frombuffer(ids, dtype=torch.int64).reshape(lines, width).clone()


def text_tokens(path, vocab: int, seq_len: int = 128) -> torch.Tensor:
    """[n, seq_len] uint8 ids ``b % vocab`` of a --text file (see ``as_model_ids``)."""
    if not 2 <= seq_len <= MAX_SEQUENCE:
        raise ModelError(f"--seq-len: expected an integer in 2..{MAX_SEQUENCE}, got {seq_len}")
    with open_regular(path, error=ModelError, what="text") as f:
        size = _size_checked(f, path)
        data = np.empty(size, np.uint8)
        view, got = memoryview(data), 0
        try:
            while got < size:
                n = f.readinto(view[got:])
                if not n:
                    break
                got += n
        except OSError as exc:
            raise ModelError(f"{path}: cannot read text: {exc.strerror or exc}") from None
    data = data[:got]  # a file that shrank while read: what was there
    if got < 2:
        raise ModelError(f"{path}: {got} bytes; expected at least 2")
    if vocab < 256:
        np.remainder(data, vocab, out=data)
    ids = torch.from_numpy(data)
    if got < seq_len:
        return ids.reshape(1, -1)
    n = got // seq_len
    return ids[: n * seq_len].reshape(n, seq_len)


def random_tokens(spec: str, vocab: int) -> torch.Tensor:
    b, t = parse_random(spec)
    return torch.randint(0, vocab, (b, t), generator=torch.Generator().manual_seed(0))


def parse_random(spec: str) -> tuple[int, int]:
    """``BxT`` -> (B, T), each at least 1, T at most ``MAX_SEQUENCE``, B * T at most ``MAX_RANDOM_IDS``
    (so nothing proportional to an absurd B or T is allocated)."""
    m = re.fullmatch(r"(\d{1,12})x(\d{1,12})", str(spec).strip())
    if not m or int(m[1]) < 1 or int(m[2]) < 1:
        raise ModelError(f"--random: expected BxT such as 2x16 (B, T >= 1), got {str(spec)[:40]!r}")
    b, t = int(m[1]), int(m[2])
    if t > MAX_SEQUENCE or b * t > MAX_RANDOM_IDS:
        raise ModelError(f"--random: {b}x{t} is {b * t} ids; expected T <= {MAX_SEQUENCE} and B x T <= "
                         f"{MAX_RANDOM_IDS}")
    return b, t


def as_model_ids(ids: torch.Tensor) -> torch.Tensor:
    """Ids as a model's embedding takes them (int64); text stays uint8 until then."""
    return ids if ids.dtype == torch.int64 else ids.to(torch.int64)
