"""Engine logprobs files as vLLM's ``/v1/completions`` writes them (echo=true, logprobs=K), made in
tests from any model's logits (transformers' reload of a checkpoint stands in for the engine)."""

from __future__ import annotations

import json
from pathlib import Path

import torch


def engine_choices(logits: torch.Tensor, ids: torch.Tensor, k: int, name) -> list[dict]:
    """One choice per row of ``ids`` [B, T]: tokens ``name(id)``, a null first logprob, per later
    position the top ``k`` entries plus the token itself (vLLM's K + 1), from torch's float64
    log-softmax of ``logits`` [B, T, V]."""
    lp = torch.log_softmax(logits.to(torch.float64), dim=-1)
    choices = []
    for b in range(ids.shape[0]):
        row = ids[b].tolist()
        own = [None] + [lp[b, t - 1, row[t]].item() for t in range(1, len(row))]
        tops = [None]
        for t in range(1, len(row)):
            values, top = torch.topk(lp[b, t - 1], k)
            entry = {name(i): v for i, v in zip(top.tolist(), values.tolist())}
            entry[name(row[t])] = own[t]
            tops.append(entry)
        choices.append({"index": b, "text": "", "finish_reason": "length",
                        "logprobs": {"tokens": [name(i) for i in row], "token_logprobs": own, "top_logprobs": tops,
                                     "text_offset": [0] * len(row)}})
    return choices


def write_response(path: Path, choices: list[dict]) -> Path:
    path.write_text(json.dumps({"id": "cmpl-test", "object": "text_completion", "model": "m", "choices": choices}))
    return path


def token_id(i: int) -> str:
    return f"token_id:{i}"
