"""Error metrics between a mode's tensors and the baseline's, computed in float64 from the exact
stored values (torch in, Python floats out; JSON-safe: inf/NaN become strings at the report)."""

from __future__ import annotations

import math
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from .._native import threads
from ..io.files import json_safe  # noqa: F401  (the report's JSON rule, here for the nn callers)

# dtype -> (fraction bits, smallest normal exponent)
_GRID = {torch.bfloat16: (7, -126), torch.float16: (10, -14), torch.float32: (23, -126)}


def _f64(t: torch.Tensor) -> np.ndarray:
    return t.detach().to(torch.float64).numpy()


def ulp(values: np.ndarray, dtype) -> np.ndarray:
    """The spacing of ``dtype``'s grid at each value (its binade's; the subnormal spacing below)."""
    bits, emin = _GRID[dtype]
    _, e = np.frexp(np.abs(values))
    e = np.where(values == 0, emin, np.maximum(e - 1, emin))
    return np.ldexp(1.0, (e - bits).astype(np.int64))


def layer_metrics(y: torch.Tensor, ref: torch.Tensor) -> dict:
    """relative RMS, max ULP (|y - ref| in units of ref's spacing in the output dtype), SNR in dB,
    share of differing elements and NaN counts."""
    a, b = _f64(y), _f64(ref)
    finite = np.isfinite(a) & np.isfinite(b)
    err = np.where(finite, a - b, 0.0)
    sig = float(np.sum(np.where(finite, b, 0.0) ** 2))
    noise = float(np.sum(err ** 2))
    ulps = np.abs(err) / ulp(np.where(finite, b, 0.0), ref.dtype)
    return {"rel_rms": math.sqrt(noise / sig) if sig else (0.0 if noise == 0 else math.inf),
            "max_ulp": float(ulps.max()) if ulps.size else 0.0,
            "snr_db": 10 * math.log10(sig / noise) if noise else math.inf,
            "differ": float(np.mean(a != b)) if a.size else 0.0,
            "nan": int(np.isnan(a).sum()), "nan_baseline": int(np.isnan(b).sum())}


def logit_metrics(logits: torch.Tensor, ref: torch.Tensor) -> dict:
    """KL(baseline || mode) per token averaged (nats), top-1 agreement, max |difference|."""
    a, b = _f64(logits), _f64(ref)
    la = a - a.max(-1, keepdims=True)
    la = la - np.log(np.exp(la).sum(-1, keepdims=True))
    lb = b - b.max(-1, keepdims=True)
    lb = lb - np.log(np.exp(lb).sum(-1, keepdims=True))
    with np.errstate(invalid="ignore"):
        kl = float(np.mean(np.sum(np.exp(lb) * (lb - la), axis=-1)))
    return {"kl": kl, "top1_agree": float(np.mean(a.argmax(-1) == b.argmax(-1))),
            "max_abs_diff": float(np.max(np.abs(a - b))) if a.size else 0.0}


_ROWS = 16  # positions per float64 log-softmax: its temporaries stay small beside the logits (128k vocab: 16 MB)


def perplexity(logits: torch.Tensor, ids: torch.Tensor) -> float:
    """exp(mean next-token negative log-likelihood): logits[:, t] predicts ids[:, t + 1]. The
    log-softmax runs on _ROWS positions at a time (each position's is its own: the same values as
    on the whole array), so its float64 temporaries do not grow with the tokens; the pieces run on
    the cores (numpy's ufuncs release the GIL; each piece's values do not depend on the thread)."""
    target = ids[:, 1:].numpy()
    B, T = target.shape
    nll = np.empty((B, T, 1))
    mine = threading.local()

    def piece(b: int, t0: int) -> None:
        rows = logits[b, t0:min(t0 + _ROWS, T)]
        if not hasattr(mine, "a"):  # each thread's two buffers, reused by its pieces: fresh 16 MB arrays
            mine.a, mine.e = np.empty((_ROWS, rows.shape[-1])), np.empty((_ROWS, rows.shape[-1]))  # per piece
        a, e = mine.a[:rows.shape[0]], mine.e[:rows.shape[0]]  # stayed in the threads' malloc arenas (+0.4 GB)
        torch.from_numpy(a).copy_(rows)  # the exact float64 values
        np.subtract(a, a.max(-1, keepdims=True), out=a)
        np.exp(a, out=e)
        np.subtract(a, np.log(e.sum(-1, keepdims=True)), out=a)
        nll[b, t0:t0 + a.shape[0]] = -np.take_along_axis(a, target[b, t0:t0 + a.shape[0], None], axis=-1)

    pieces = [(b, t0) for b in range(B) for t0 in range(0, T, _ROWS)]
    workers = min(threads(), len(pieces))
    if workers > 1:
        with ThreadPoolExecutor(workers) as pool:
            list(pool.map(lambda p: piece(*p), pieces))
    else:
        for p in pieces:
            piece(*p)
    return float(np.exp(nll.mean())) if nll.size else math.nan
