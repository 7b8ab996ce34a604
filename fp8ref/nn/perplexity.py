"""Rolling perplexity of tokenized text (``fp8ref.nn.tokenizer.Windows``) under one mode: the
negative log-likelihood of every token of the text exactly once, as lm-eval's
``loglikelihood_rolling`` scores it (float64 log-softmax)."""

from __future__ import annotations

import math

import torch
from tqdm import tqdm

from ..errors import ModelError
from .compare import _logits, refuse_nonfinite
from .linear import set_mode
from .modes import parse_mode
from .tokenizer import Windows


def window_loglikelihoods(logits: torch.Tensor, targets: torch.Tensor, scored: torch.Tensor) -> list[float]:
    """Per window, the summed log-likelihood of its last ``scored`` targets, computed as lm-eval's
    HFLM does with ``softmax_dtype=float64``: ``log_softmax(logits, dtype=float64)``, gathered, one
    ``sum()`` per window."""
    lp = torch.nn.functional.log_softmax(logits, dim=-1, dtype=torch.float64)
    picked = torch.gather(lp, 2, targets.unsqueeze(-1)).squeeze(-1)
    width = picked.shape[1]
    return [float(picked[w, width - k:].sum()) for w, k in enumerate(scored.tolist())]


def evaluate_windows(model, windows: Windows, mode, *, batch: int = 8, progress: bool = False) -> dict:
    """Perplexity ``exp(total NLL / tokens)`` of the windows' scored tokens under ``mode``."""
    if type(batch) is not int or batch < 1:
        raise ModelError(f"eval: batch: expected a positive integer, got {batch!r}")
    set_mode(model, mode)
    loglikelihood, count = 0.0, int(windows.scored.sum())
    with torch.no_grad():
        for i in tqdm(range(0, windows.inputs.shape[0], batch), desc="eval", unit="batch", disable=not progress):
            logits = _logits(model(windows.inputs[i:i + batch]))
            refuse_nonfinite(logits, f"eval: mode {parse_mode(mode)}, windows {i}..{i + logits.shape[0] - 1}")
            for ll in window_loglikelihoods(logits, windows.targets[i:i + batch], windows.scored[i:i + batch]):
                loglikelihood += ll  # window by window, in order: lm-eval's sum over a document's windows
    nll = -loglikelihood
    return {"mode": str(parse_mode(mode)), "sequences": int(windows.inputs.shape[0]), "tokens": count,
            "nll": nll, "perplexity": math.exp(nll / count) if count else float("nan")}
