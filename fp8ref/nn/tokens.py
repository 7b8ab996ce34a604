"""Token ids for ``compare`` and ``eval`` without a hub tokenizer.

- ``--tokens FILE``: whitespace-separated integer ids, one sequence per line (all lines the same
  length), each in [0, vocab).
- ``--text FILE``: the file's bytes, each byte b -> id ``b % vocab``, cut into sequences of
  ``seq_len`` ids (the last partial one dropped; a shorter file is one sequence). This is not the
  model's tokenizer: perplexities are comparable between modes of one checkpoint, not to
  published numbers.
- ``--random BxT``: B sequences of T ids, uniform in [0, vocab), torch generator seed 0.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from ..errors import ModelError


def read_tokens(path, vocab: int) -> torch.Tensor:
    rows = []
    for i, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = [int(t) for t in line.split()]
        except ValueError:
            raise ModelError(f"{path}:{i}: expected whitespace-separated integer token ids") from None
        bad = [t for t in row if not 0 <= t < vocab]
        if bad:
            raise ModelError(f"{path}:{i}: token id {bad[0]} outside [0, {vocab})")
        rows.append(row)
    if not rows or any(len(r) != len(rows[0]) for r in rows) or len(rows[0]) < 2:
        raise ModelError(f"{path}: expected lines of equal length >= 2 ids, one sequence per line")
    return torch.tensor(rows, dtype=torch.long)


def text_tokens(path, vocab: int, seq_len: int = 128) -> torch.Tensor:
    data = Path(path).read_bytes()
    if len(data) < 2:
        raise ModelError(f"{path}: {len(data)} bytes; expected at least 2")
    ids = torch.tensor(list(data), dtype=torch.long) % vocab
    if len(ids) < seq_len:
        return ids.reshape(1, -1)
    n = len(ids) // seq_len
    return ids[: n * seq_len].reshape(n, seq_len)


def random_tokens(spec: str, vocab: int) -> torch.Tensor:
    m = re.fullmatch(r"(\d+)x(\d+)", spec.strip())
    if not m or int(m[1]) < 1 or int(m[2]) < 1:
        raise ModelError(f"--random: expected BxT such as 2x16, got {spec!r}")
    return torch.randint(0, vocab, (int(m[1]), int(m[2])), generator=torch.Generator().manual_seed(0))
