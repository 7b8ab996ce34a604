"""An engine's prompt logprobs in the OpenAI completions format, read and checked; fp8ref's own
logprobs written in the same format.

What vLLM and SGLang serve for ``POST /v1/completions`` with ``echo: true, logprobs: K``: per choice,
``logprobs`` holds ``tokens`` (one string per token of prompt + completion, concatenated in that
order), ``token_logprobs`` (the log-probability of each token given the ones before it; ``null`` for
the first, which has no context) and ``top_logprobs`` (per position ``null`` or an object token ->
log-probability: the engine's top K, and with vLLM also the token itself). A token is a string as the
tokenizer decodes that one id, or with vLLM's ``return_tokens_as_token_ids`` ``"token_id:N"``; vLLM
clamps -inf to -9999.0. vLLM's ``return_token_ids`` adds ``prompt_token_ids`` and ``token_ids``.

A file is one JSON response, a JSON list of responses, or JSONL (a response per line). Each
choice is one sequence. Everything is checked before any model runs: a missing ``logprobs``
object, lists of different lengths, a value that is not a finite number <= 0 (JSON's NaN and
Infinity included), a first token with a logprob (not an echo), a token the tokenizer does not
have, ids that disagree with the token strings: one ``ModelError`` naming the file, the line or
choice, and the position.

Token strings map to ids through the checkpoint's tokenizer (``nn.tokenizer``): each id's
``decode([id])`` (what vLLM and SGLang print), its vocabulary piece (older vLLM), and a
SentencePiece piece's leading space restored (newer vLLM). A string several ids give resolves to
the one whose ``decode`` it is, if that is one id; otherwise the position's own token is an error
(ask the engine for ids), and a top-K entry is left out of the comparison and counted.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import numpy as np

from ..errors import ModelError
from ..io.files import MAX_JSON_BYTES, parse_json, read_bytes
from ..limits import MAX_RANDOM_IDS, MAX_SEQUENCE, shown

TOKEN_ID = re.compile(r"token_id:(\d{1,12})")
SPIECE_SPACE = "\u2581"  # SentencePiece's word-start marker


@dataclass
class EngineSequence:
    """One choice of an engine's response: ``ids`` int64 [T]; ``logprobs`` float64 [T] (NaN at
    position 0); ``top[t]``: (ids int64 [k], logprobs float64 [k]) of the engine's top entries at
    position t (None at 0); ``tokens`` the strings as the file gives them."""

    where: str
    ids: np.ndarray
    tokens: list[str]
    logprobs: np.ndarray
    top: list
    top1: list  # per position, the ids the engine's top-1 may be (None at 0)
    dropped: int = 0  # top entries whose string several ids decode to (left out)
    uncertain: int = 0  # positions where such an entry may hide the engine's top-1


class TokenMap:
    """Token strings -> ids (``token_id:N`` directly; other strings through the tokenizer, built
    the first time one is met: a file of ids needs no tokenizer)."""

    def __init__(self, vocab: int, tokenizer_loader):
        self.vocab = vocab
        self._load = tokenizer_loader
        self._forms: dict[str, list[int]] | None = None
        self._decoded: dict[str, list[int]] = {}
        self.tokenizer = None

    def _build(self) -> None:
        tok = self.tokenizer = self._load()
        backend = tok.backend
        forms: dict[str, set[int]] = {}
        decoded: dict[str, list[int]] = {}
        size = backend.get_vocab_size(with_added_tokens=True)
        for i in range(size):
            text = backend.decode([i], skip_special_tokens=False)
            piece = backend.id_to_token(i)
            decoded.setdefault(text, []).append(i)
            for form in {text, piece, _restored_space(piece, text)} - {None}:
                forms.setdefault(form, set()).add(i)
        for i in range(size, self.vocab):  # the model's padding ids: the engines print "" for them
            decoded.setdefault("", []).append(i)
            forms.setdefault("", set()).add(i)
        self._forms = {k: sorted(v) for k, v in forms.items()}
        self._decoded = decoded

    def candidates(self, token: str) -> list[int]:
        """The ids ``token`` may stand for (empty: none)."""
        m = TOKEN_ID.fullmatch(token)
        if m:
            return [int(m[1])]
        if self._forms is None:
            self._build()
        return self._forms.get(token, [])

    def resolve(self, token: str) -> list[int]:
        """``candidates`` narrowed to the one id whose decode ``token`` is, where that is unique."""
        ids = self.candidates(token)
        if len(ids) > 1 and len(self._decoded.get(token, ())) == 1:
            return self._decoded[token]
        return ids

    def name(self, i: int) -> str:
        """How a report shows id ``i``: its decoded string when a tokenizer was read, else token_id:N."""
        if self.tokenizer is not None:
            return self.tokenizer.backend.decode([int(i)], skip_special_tokens=False)
        return f"token_id:{int(i)}"


def _restored_space(piece, text: str):
    """A SentencePiece piece ``▁word`` decodes to ``word`` alone; newer vLLM prints `` word``."""
    if isinstance(piece, str) and piece.startswith(SPIECE_SPACE) and not text.startswith(" "):
        return " " + text
    return None


def read_engine_logprobs(path, *, vocab: int, tokenizer_loader) -> tuple[list[EngineSequence], TokenMap]:
    """The sequences of an engine's logprobs file, checked; ``tokenizer_loader()`` gives the
    checkpoint's tokenizer (called only when a token is a string)."""
    tokens = TokenMap(vocab, tokenizer_loader)
    seqs: list[EngineSequence] = []
    total = 0
    for where, doc in _documents(path):
        for cwhere, choice in _choices(where, doc):
            seq = _sequence(cwhere, choice, tokens)
            total += len(seq.ids)
            if total > MAX_RANDOM_IDS:
                raise ModelError(f"{path}: more than {MAX_RANDOM_IDS} tokens in all; fp8ref compares at most as many")
            seqs.append(seq)
    if not seqs:
        raise ModelError(f"{path}: no choices; expected an OpenAI completions response (or JSONL of them) made "
                         f"with echo=true and logprobs=K")
    return seqs, tokens


def _documents(path):
    """(where, response) pairs: the whole file as one JSON value (a response or a list of them),
    else one response per non-empty line (JSONL)."""
    data = read_bytes(path, error=ModelError, limit=MAX_JSON_BYTES, what="engine logprobs")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ModelError(f"{path}: engine logprobs are not UTF-8 JSON: {exc}") from None
    lines = [(n, line) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
    if len(lines) <= 1 or not all(line.lstrip().startswith("{") for _, line in lines):
        doc = parse_json(text, str(path), "engine logprobs", error=ModelError)
        if isinstance(doc, list):
            return [(f"{path}: [{i}]", d) for i, d in enumerate(doc)]
        return [(f"{path}:", doc)]
    return [(f"{path}:{n}:", parse_json(line, f"{path}:{n}", "JSONL line", error=ModelError)) for n, line in lines]


def _choices(where: str, doc):
    if isinstance(doc, dict) and "choices" not in doc and ("top_logprobs" in doc or doc.get("skipped") is True):
        yield from _modelopt_record(where, doc)
        return
    if not isinstance(doc, dict) or not isinstance(doc.get("choices"), list):
        raise ModelError(f"{where} expected a completions response, an object with a 'choices' list; got "
                         f"{type(doc).__name__}{' without choices' if isinstance(doc, dict) else ''}")
    for i, choice in enumerate(doc["choices"]):
        cwhere = f"{where} choices[{i}]"
        if not isinstance(choice, dict):
            raise ModelError(f"{cwhere}: expected an object, got {type(choice).__name__}")
        yield cwhere, choice


def _modelopt_record(where: str, doc: dict):
    """A record of ModelOpt's ``fidelity_check.py`` (``collect-base`` / ``collect-quant`` JSONL:
    ``prompt_idx``, ``tokens``, ``top_logprobs`` of one echo call, no ``token_logprobs``) as a
    choice; each token's own logprob is its entry in ``top_logprobs`` (vLLM always includes it).
    A record the tool marked ``skipped`` holds no logprobs and is passed over."""
    if doc.get("skipped") is True:
        return
    where = f"{where} prompt_idx {shown(doc.get('prompt_idx'), 20)}"
    strs, tops = doc.get("tokens"), doc.get("top_logprobs")
    if not isinstance(strs, list) or not isinstance(tops, list) or len(strs) != len(tops):
        raise ModelError(f"{where}: expected 'tokens' and 'top_logprobs' lists of equal length (ModelOpt "
                         f"fidelity_check.py record)")
    own = [None]
    for t in range(1, len(strs)):
        entry = tops[t]
        if not isinstance(entry, dict) or not isinstance(strs[t], str) or strs[t] not in entry:
            raise ModelError(f"{where}: position {t}: the token's own logprob is not among its top_logprobs (the "
                             f"record has no token_logprobs; made by vLLM, it always is)")
        own.append(entry[strs[t]])
    yield where, {"logprobs": {"tokens": strs, "token_logprobs": own, "top_logprobs": tops}}


def _vllm_prompt_logprobs(where: str, choice: dict) -> dict:
    """vLLM's ``prompt_logprobs`` (request field ``prompt_logprobs: K``; per prompt position ``null``
    or an object id -> {"logprob", "rank", "decoded_token"} holding the prompt token and the top K)
    as an echo choice with ``token_id:N`` tokens; the ids are ``prompt_token_ids``
    (``return_token_ids: true``), which say which entry is the prompt token's."""
    entries, ids = choice["prompt_logprobs"], choice.get("prompt_token_ids")
    if not isinstance(ids, list) or not isinstance(entries, list) or len(ids) != len(entries):
        raise ModelError(f"{where}: prompt_logprobs without prompt_token_ids of the same length; request "
                         f"return_token_ids=true (or echo=true with logprobs=K)")
    tokens, own, tops = [], [], []
    for t, (i, entry) in enumerate(zip(ids, entries)):
        tokens.append(f"token_id:{i}")
        if entry is None:
            own.append(None)
            tops.append(None)
            continue
        if not isinstance(entry, dict) or not all(isinstance(v, dict) and "logprob" in v for v in entry.values()):
            raise ModelError(f"{where}: prompt_logprobs[{t}]: expected an object id -> {{\"logprob\": ...}}")
        if str(i) not in entry:
            raise ModelError(f"{where}: prompt_logprobs[{t}]: no entry for the prompt token {i}")
        own.append(entry[str(i)]["logprob"])
        tops.append({f"token_id:{k}": v["logprob"] for k, v in entry.items()})
    return {"prompt_token_ids": ids, "logprobs": {"tokens": tokens, "token_logprobs": own, "top_logprobs": tops}}


def _logprob(value, where: str) -> float:
    if type(value) not in (int, float) or not math.isfinite(value) or value > 0:
        raise ModelError(f"{where}: {shown(value, 40)} is not a log-probability (a finite number <= 0)")
    return float(value)


def _sequence(where: str, choice: dict, tokens: TokenMap) -> EngineSequence:
    if choice.get("logprobs") is None and choice.get("prompt_logprobs") is not None:
        choice = _vllm_prompt_logprobs(where, choice)
    lp = choice.get("logprobs")
    if not isinstance(lp, dict):
        raise ModelError(f"{where}: no 'logprobs' object; request echo=true and logprobs=K (K >= 1)")
    lists = {}
    for key in ("tokens", "token_logprobs", "top_logprobs"):
        value = lp.get(key)
        if not isinstance(value, list):
            raise ModelError(f"{where}: logprobs.{key}: expected a list, got {type(value).__name__}")
        lists[key] = value
    strs, values, tops = lists["tokens"], lists["token_logprobs"], lists["top_logprobs"]
    n = len(strs)
    if len(values) != n or len(tops) != n:
        raise ModelError(f"{where}: logprobs lists of different lengths: tokens {n}, token_logprobs {len(values)}, "
                         f"top_logprobs {len(tops)}")
    if not 2 <= n <= MAX_SEQUENCE:
        raise ModelError(f"{where}: {n} tokens; expected 2..{MAX_SEQUENCE}")
    for t, s in enumerate(strs):
        if not isinstance(s, str):
            raise ModelError(f"{where}: tokens[{t}]: expected a string, got {type(s).__name__}")
    if values[0] is not None or tops[0] not in (None, {}, []):  # SGLang may give an empty first entry
        raise ModelError(f"{where}: position 0 has a logprob; the prompt's first token has none in an echo of the "
                         f"prompt (request echo=true)")
    ids = _ids(where, choice, strs, tokens)
    logprobs = np.full(n, np.nan)
    top, top1, dropped, uncertain = [None], [None], 0, 0
    for t in range(1, n):
        logprobs[t] = _logprob(values[t], f"{where}: token_logprobs[{t}]")
        entries = tops[t]
        if not isinstance(entries, dict) or not entries:
            raise ModelError(f"{where}: top_logprobs[{t}]: expected an object token -> logprob with at least one "
                             f"entry (request logprobs=K, K >= 1), got {shown(entries, 40)}")
        keep_ids, keep_lp, best, best_ids, hidden = [], [], -math.inf, [], []
        for key, value in entries.items():
            v = _logprob(value, f"{where}: top_logprobs[{t}][{shown(key, 40)}]")
            own = key == strs[t] and int(ids[t]) in tokens.candidates(key)
            cand = [int(ids[t])] if own else tokens.resolve(key)  # the position's own token: its id is known
            if not cand:
                raise ModelError(f"{where}: top_logprobs[{t}]: {shown(key, 40)} is not a token of the tokenizer")
            if v >= best:
                best_ids = (best_ids if v == best else []) + cand
                best = v
            if len(cand) > 1:
                dropped += 1
                hidden += cand
                continue
            _check_id(where, f"top_logprobs[{t}][{shown(key, 40)}]", cand[0], tokens.vocab)
            keep_ids.append(cand[0])
            keep_lp.append(v)
        if len(set(keep_ids)) != len(keep_ids):
            raise ModelError(f"{where}: top_logprobs[{t}]: two entries name the same token id")
        top.append((np.asarray(keep_ids, np.int64), np.asarray(keep_lp, np.float64)))
        # an object keeps one value per string: for a string several ids decode to, vLLM keeps its
        # last (lowest) one, so any of those ids may be the engine's real top-1
        top1.append(np.unique(np.asarray(best_ids + hidden, np.int64)))
        uncertain += bool(hidden)
    return EngineSequence(where, ids, list(strs), logprobs, top, top1, dropped, uncertain)


def _check_id(where: str, what: str, i: int, vocab: int) -> None:
    if not 0 <= i < vocab:
        raise ModelError(f"{where}: {what}: token id {i} outside the model's vocabulary [0, {vocab})")


def _ids(where: str, choice: dict, strs: list[str], tokens: TokenMap) -> np.ndarray:
    """The token ids of a choice: ``prompt_token_ids`` + ``token_ids`` where the engine gave them
    (each token string checked against its id), else each string resolved."""
    given = choice.get("prompt_token_ids")
    if given is not None:
        rest = choice.get("token_ids") or []
        if not isinstance(given, list) or not isinstance(rest, list) or \
                not all(type(i) is int for i in given + rest):
            raise ModelError(f"{where}: prompt_token_ids/token_ids: expected lists of integers")
        given = given + rest
        if len(given) != len(strs):
            raise ModelError(f"{where}: {len(given)} token ids (prompt_token_ids + token_ids), {len(strs)} tokens")
    out = np.empty(len(strs), np.int64)
    for t, s in enumerate(strs):
        cand = tokens.candidates(s) if given is not None else tokens.resolve(s)
        if given is not None:
            if given[t] not in cand:
                raise ModelError(f"{where}: position {t}: token {shown(s, 40)} is not what the tokenizer gives for id "
                                 f"{given[t]} (prompt_token_ids)")
            cand = [given[t]]
        if not cand:
            raise ModelError(f"{where}: position {t}: token {shown(s, 40)} is not a token of the tokenizer (a file for "
                             f"another tokenizer or model?)")
        if len(cand) > 1:
            raise ModelError(f"{where}: position {t}: token {shown(s, 40)} is ids {cand[:4]} alike; ask the engine "
                             f"for ids (vLLM: return_tokens_as_token_ids=true)")
        _check_id(where, f"position {t}", cand[0], tokens.vocab)
        out[t] = cand[0]
    return out


def top_entries(logprobs: np.ndarray, k: int) -> np.ndarray:
    """The ids of the ``k`` largest entries, largest first, ties to the lower id."""
    k = min(k, logprobs.shape[0])
    kth = -np.partition(-logprobs, k - 1)[k - 1]
    above = np.flatnonzero(logprobs > kth)
    idx = np.concatenate([above, np.flatnonzero(logprobs == kth)[: k - above.size]])  # ties at the cut: lower ids
    return idx[np.lexsort((idx, -logprobs[idx]))]


def response(choices: list[dict], model: str) -> dict:
    """A completions response around ``choices`` (what ``--engine-logprobs`` reads)."""
    return {"object": "text_completion", "model": model, "choices": choices}


def choice(index: int, ids: np.ndarray, token_logprobs: np.ndarray, tops: list) -> dict:
    """One echo choice in vLLM's layout: tokens as ``token_id:N``, ``null`` first logprob, per
    later position the K top entries and the position's own token (vLLM's K + 1)."""
    names = [f"token_id:{int(i)}" for i in ids]
    top = [None] + [{f"token_id:{int(i)}": float(v) for i, v in zip(*entry)} for entry in tops]
    return {"index": index, "text": "", "finish_reason": "length", "prompt_token_ids": [int(i) for i in ids],
            "logprobs": {"tokens": names, "token_logprobs": [None] + [float(v) for v in token_logprobs[1:]],
                         "top_logprobs": top, "text_offset": [0] * len(names)}}
