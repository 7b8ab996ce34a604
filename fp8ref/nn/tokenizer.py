"""A checkpoint's own tokenizer, for ``eval``/``compare --text``, and text cut into windows the
way lm-eval's rolling perplexity cuts it.

The tokenizer is ``tokenizer.json`` in the checkpoint folder (or ``--tokenizer DIR``), read through
``fp8ref.io.files`` (a regular file, size-capped, strict JSON) and built by the ``tokenizers``
library from that text: data, never code. transformers' ``AutoTokenizer`` is not used, so no
``tokenizer_class`` or ``auto_map`` is ever imported and nothing is downloaded; a
``tokenizer_config.json`` with ``auto_map`` (Python code to import) is refused outright.

Encoding follows lm-eval's ``HFLM``: the text is one document, encoded without special tokens;
the prefix token of the first window is the tokenizer's BOS, else its EOS (``prefix_token_id``).
Windows (``rolling_windows``) are ``lm_eval.utils.get_rolling_token_windows(ids, prefix, L, 1)``
made disjoint (``make_disjoint_window``), each run as ``(context + continuation)[-(L + 1):][:-1]``
and scored on its continuation (``HFLM._loglikelihood_tokens``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..errors import ModelError
from ..io.files import MAX_INPUT_BYTES, MAX_JSON_BYTES, parse_json, read_bytes, read_json

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILES = ("tokenizer_config.json", "special_tokens_map.json")


@dataclass(frozen=True)
class CheckpointTokenizer:
    backend: object  # tokenizers.Tokenizer
    path: Path  # its tokenizer.json
    prefix_token: str
    prefix_id: int

    def encode(self, text: str) -> np.ndarray:
        """int64 ids of ``text`` without special tokens (lm-eval's HFLM ``tok_encode``)."""
        return np.asarray(self.backend.encode(text, add_special_tokens=False).ids, dtype=np.int64)

    def describe(self) -> str:
        return str(self.path)


def has_tokenizer(folder) -> bool:
    return (Path(folder) / TOKENIZER_FILE).is_file()


def _token_text(value, where: str) -> str | None:
    if value is None:
        return None
    if isinstance(value, dict):
        value = value.get("content")
    if not isinstance(value, str):
        raise ModelError(f"{where}: expected a token string or {{\"content\": ...}}, got {type(value).__name__}")
    return value


SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")


def special_tokens(folder: Path) -> dict:
    """bos/eos/unk/pad token strings from tokenizer_config.json, then special_tokens_map.json."""
    found: dict = {}
    for name in CONFIG_FILES:
        path = folder / name
        if not path.exists():
            continue
        config = read_json(path, "tokenizer config", error=ModelError)
        if not isinstance(config, dict):
            raise ModelError(f"{path}: expected a JSON object")
        if "auto_map" in config:
            raise ModelError(f"{path}: 'auto_map' names Python code to import; fp8ref runs no code from a "
                             f"checkpoint (give --tokenizer DIR with a plain tokenizer.json)")
        for key in SPECIAL_KEYS:
            if key not in found:
                token = _token_text(config.get(key), f"{path}: {key}")
                if token is not None:
                    found[key] = token
    return found


def load_tokenizer(folder) -> CheckpointTokenizer:
    """The tokenizer in ``folder`` (its tokenizer.json); a one-line ``ModelError`` naming the file
    when it is missing or broken."""
    folder = Path(folder)
    path = folder / TOKENIZER_FILE
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise ModelError("reading a tokenizer needs the 'tokenizers' library (installed with transformers: "
                         "pip install fp8ref[hf])") from None
    text = read_bytes(path, error=ModelError, limit=MAX_JSON_BYTES, what="tokenizer")
    parse_json(text, str(path), "tokenizer", error=ModelError)  # duplicate keys, deep nesting: one line
    try:
        backend = Tokenizer.from_str(text.decode("utf-8"))
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # the Rust parser's message (a pyo3 panic is a BaseException)
        raise ModelError(f"{path}: not a tokenizer the tokenizers library reads: "
                         f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from None
    special = special_tokens(folder)
    for key in ("bos_token", "eos_token"):  # lm-eval's prefix_token_id: BOS, else EOS
        token = special.get(key)
        if token is not None:
            token_id = backend.token_to_id(token)
            if token_id is None:
                raise ModelError(f"{folder}: {key} {token!r} is not in {path.name}'s vocabulary")
            return CheckpointTokenizer(backend, path, token, int(token_id))
    raise ModelError(f"{folder}: the tokenizer declares no bos_token or eos_token (tokenizer_config.json); "
                     f"a first window needs one; give --tokens FILE instead")


def read_text_utf8(path) -> str:
    data = read_bytes(path, error=ModelError, limit=MAX_INPUT_BYTES, what="text")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ModelError(f"{path}: cannot read text: not UTF-8 ({exc}); --byte-tokens reads any bytes") from None


@dataclass(frozen=True)
class Windows:
    """``inputs`` and ``targets`` [W, L] int64: row w's logits at position t predict
    ``targets[w, t]``; only the last ``scored[w]`` positions of each row count."""

    inputs: torch.Tensor
    targets: torch.Tensor
    scored: torch.Tensor

    def pairs(self) -> list[tuple[list[int], list[int]]]:
        """(context, continuation) per window, as lm-eval's make_disjoint_window gives them
        (context reconstructed from the run input: ``inputs + last target``, minus the continuation)."""
        out = []
        for inp, tgt, k in zip(self.inputs.tolist(), self.targets.tolist(), self.scored.tolist()):
            full = inp + tgt[-1:]
            out.append((full[: len(full) - k], full[len(full) - k:]))
        return out


def rolling_windows(ids: np.ndarray, prefix_id: int, seq_len: int) -> Windows:
    """Disjoint rolling windows of at most ``seq_len`` predicted-from positions: the first window
    is ``[prefix] + ids[:L - 1]`` predicting ``ids[:L]``; each later one is the ``L`` ids before
    its end, predicting the next up-to-``L`` ids not yet predicted (the last one fewer, with the
    earlier ids as context)."""
    n = len(ids)
    if n < 1:
        raise ModelError("the text encodes to no tokens")
    first = min(seq_len, n)
    rows, targets, scored = [np.concatenate([[prefix_id], ids[: first - 1]])], [ids[:first]], [first]
    predicted = first
    while predicted < n:
        end = min(predicted + seq_len, n)
        rows.append(ids[end - seq_len - 1: end - 1])
        targets.append(ids[end - seq_len: end])
        scored.append(end - predicted)
        predicted = end
    return Windows(torch.from_numpy(np.stack(rows).astype(np.int64)),
                   torch.from_numpy(np.stack(targets).astype(np.int64)), torch.tensor(scored, dtype=torch.int64))


def text_windows(text: str, tokenizer: CheckpointTokenizer, vocab: int, seq_len: int) -> Windows:
    """``text``'s windows under ``tokenizer``; ids the model's vocabulary lacks are refused."""
    ids = tokenizer.encode(text)
    top = max(int(ids.max()) if len(ids) else 0, tokenizer.prefix_id)
    if top >= vocab:
        raise ModelError(f"{tokenizer.path}: gives token id {top}, outside the model's vocabulary [0, {vocab})")
    return rolling_windows(ids, tokenizer.prefix_id, seq_len)
