"""Rolling perplexity of tokenized text (``fp8ref.nn.tokenizer.Windows``) under one mode: the
negative log-likelihood of every token of the text exactly once, as lm-eval's
``loglikelihood_rolling`` scores it, in float64."""

from __future__ import annotations

import numpy as np
import torch
from tqdm import tqdm

from ..errors import ModelError
from .compare import _logits, refuse_nonfinite
from .linear import set_mode
from .modes import parse_mode
from .tokenizer import Windows


def window_nll(logits: torch.Tensor, targets: torch.Tensor, scored: torch.Tensor) -> np.ndarray:
    """float64 NLL per window: log-softmax of each position, summed over its last ``scored`` positions."""
    a = logits.detach().to(torch.float64).numpy()
    la = a - a.max(-1, keepdims=True)
    la = la - np.log(np.exp(la).sum(-1, keepdims=True))
    picked = -np.take_along_axis(la, targets.numpy()[..., None], axis=-1)[..., 0]
    width = picked.shape[1]
    mask = np.arange(width)[None, :] >= (width - scored.numpy())[:, None]
    return (picked * mask).sum(-1)


def evaluate_windows(model, windows: Windows, mode, *, batch: int = 8, progress: bool = False) -> dict:
    """Perplexity ``exp(total NLL / tokens)`` of the windows' scored tokens under ``mode``."""
    if type(batch) is not int or batch < 1:
        raise ModelError(f"eval: batch: expected a positive integer, got {batch!r}")
    set_mode(model, mode)
    nll, count = 0.0, int(windows.scored.sum())
    with torch.no_grad():
        for i in tqdm(range(0, windows.inputs.shape[0], batch), desc="eval", unit="batch", disable=not progress):
            logits = _logits(model(windows.inputs[i:i + batch]))
            refuse_nonfinite(logits, f"eval: mode {parse_mode(mode)}, windows {i}..{i + logits.shape[0] - 1}")
            nll += float(window_nll(logits, windows.targets[i:i + batch], windows.scored[i:i + batch]).sum())
    return {"mode": str(parse_mode(mode)), "sequences": int(windows.inputs.shape[0]), "tokens": count,
            "nll": nll, "perplexity": float(np.exp(nll / count)) if count else float("nan")}
