"""An engine's prompt logprobs judged against fp8ref's model, with a noise floor.

At every position t >= 1 of a sequence (the token ``ids[t]`` predicted from ``ids[:t]``), with S the
ids of the engine's top entries there (its top K, and with vLLM the position's own token):

- ``kl``: KL(P || Q) in nats, where P is the reference's next-token distribution restricted to S
  and renormalised over S, and Q the engine's logprobs over S renormalised the same way:
  ``sum_{i in S} p_i (log p_i - log q_i)``, ``log p_i = r_i - logsumexp_S(r)``,
  ``log q_i = e_i - logsumexp_S(e)``. Zero when the engine's logprobs over S equal the reference's
  up to one common shift (the mass outside S is not seen in the file, so not judged).
- ``top1``: the engine's top-1 meets the reference's (the ids with its largest logit over the
  whole vocabulary); ties count as agreement. The engine's top-1 is the ids of its largest entry,
  and where a string several ids decode to is among the entries, each of those ids too (the
  object keeps one value per string: it may hide a larger one).
- ``dnll``: |engine logprob of ``ids[t]`` - reference log-softmax of ``ids[t]``| (not renormalised).

``kl_mean``, ``top1_agreement`` and ``dnll_mean`` average over positions (per sequence, and over
all positions of all sequences). The noise floor is the same comparison between two of fp8ref's
own modes on the same positions and the same sets S: the second mode's log-softmax stands in for
the engine's. The reference's log-softmax is computed in float64 from the model's logits.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from .compare import _logits, refuse_nonfinite
from .linear import fp8ref_layers, set_mode
from .modes import parse_mode

_ROWS = 16  # positions per float64 log-softmax (a 128k vocabulary: 16 MB of temporaries)


def _log_normalised(a: np.ndarray) -> np.ndarray:
    """``a - logsumexp(a)``, computed from ``a - max(a)``: a common shift of ``a`` that leaves
    those differences exact leaves the result bit for bit."""
    d = a - np.max(a)
    return d - math.log(float(np.sum(np.exp(d))))


def log_softmax_rows(logits: torch.Tensor):
    """Yield (row, float64 log-softmax) of ``logits`` [T, V], ``_ROWS`` rows at a time."""
    for r0 in range(0, logits.shape[0], _ROWS):
        a = logits[r0:r0 + _ROWS].to(torch.float64).numpy()
        a = a - a.max(-1, keepdims=True)
        a = a - np.log(np.exp(a).sum(-1, keepdims=True))
        for i in range(a.shape[0]):
            yield r0 + i, a[i]


class ModeView:
    """What one mode gives at each scored position of each sequence: its logprobs over the
    engine's set S, of the position's own token, and its top-1 ids."""

    def __init__(self, model, mode, seqs):
        self.mode = str(parse_mode(mode))
        for lin in fp8ref_layers(model).values():
            lin.check_mode(parse_mode(mode))
        set_mode(model, mode)
        self.rows = []
        with torch.no_grad():
            for seq in seqs:
                logits = _logits(model(torch.from_numpy(seq.ids).unsqueeze(0)))[0]
                refuse_nonfinite(logits, f"{seq.where}: mode {self.mode}")
                per = [None]
                for r, lp in log_softmax_rows(logits[:-1]):
                    t = r + 1
                    top1 = np.flatnonzero(lp == lp.max())
                    per.append((lp[seq.top[t][0]], float(lp[seq.ids[t]]), top1))
                self.rows.append(per)


def _position(ref_s: np.ndarray, other_s: np.ndarray, ref_top1, other_top1, ref_own: float, other_own: float):
    """(kl, top-1 agreement, |dNLL|) at one position (see the module docstring)."""
    log_p = _log_normalised(ref_s)
    log_q = _log_normalised(other_s)
    p = np.exp(log_p)
    kl = float(np.sum(np.where(p > 0, p * (log_p - log_q), 0.0)))
    agree = bool(np.intersect1d(ref_top1, other_top1).size)
    return max(kl, 0.0), agree, abs(other_own - ref_own)


def _summary(kl: list, agree: list, dnll: list) -> dict:
    n = len(kl)
    return {"positions": n, "kl_mean": float(np.mean(kl)) if n else math.nan,
            "kl_max": float(np.max(kl)) if n else math.nan,
            "top1_agreement": float(np.mean(agree)) if n else math.nan,
            "dnll_mean": float(np.mean(dnll)) if n else math.nan}


def judge_engine(seqs, ref: ModeView, names, *, worst: int = 10) -> dict:
    """The engine's file against ``ref``: per sequence and overall, and the ``worst`` positions by
    KL (``names(id)``: how a token is shown)."""
    per_seq, all_kl, all_agree, all_dnll, points = [], [], [], [], []
    for s, (seq, rows) in enumerate(zip(seqs, ref.rows)):
        kl, agree, dnll = [], [], []
        for t in range(1, len(seq.ids)):
            ids_s, eng_s = seq.top[t]
            ref_s, ref_own, ref_top1 = rows[t]
            if not ids_s.size:  # every entry left out (ambiguous strings)
                continue
            eng_top1 = seq.top1[t]
            k, a, d = _position(ref_s, eng_s, ref_top1, eng_top1, ref_own, float(seq.logprobs[t]))
            kl.append(k)
            agree.append(a)
            dnll.append(d)
            points.append((k, s, t, eng_top1, ref_top1, ref_own))
        per_seq.append({"sequence": seq.where, "tokens": len(seq.ids), **_summary(kl, agree, dnll),
                        "top_entries_left_out": seq.dropped, "top1_uncertain": seq.uncertain})
        all_kl += kl
        all_agree += agree
        all_dnll += dnll
    points.sort(key=lambda p: (-p[0], p[1], p[2]))
    shown = []
    for k, s, t, eng_top1, ref_top1, ref_own in points[:worst]:
        seq = seqs[s]
        both = np.intersect1d(eng_top1, ref_top1)  # agreeing (a tie or an uncertain top-1): show the shared id
        eng_top1, ref_top1 = (both, both) if both.size else (eng_top1, ref_top1)
        shown.append({"sequence": seq.where, "position": t, "token": seq.tokens[t], "kl": k,
                      "engine_logprob": float(seq.logprobs[t]), "reference_logprob": ref_own,
                      "engine_top1": names(int(eng_top1[0])), "reference_top1": names(int(ref_top1[0])),
                      "context": [seq.tokens[i] for i in range(max(0, t - 4), t)]})
    return {"overall": _summary(all_kl, all_agree, all_dnll), "sequences": per_seq, "worst": shown}


def judge_modes(seqs, ref: ModeView, other: ModeView) -> dict:
    """The noise floor: ``other`` judged against ``ref`` as an engine would be, over each position's
    same set S."""
    kl, agree, dnll = [], [], []
    for seq, rows, orows in zip(seqs, ref.rows, other.rows):
        for t in range(1, len(seq.ids)):
            if not seq.top[t][0].size:
                continue
            ref_s, ref_own, ref_top1 = rows[t]
            oth_s, oth_own, oth_top1 = orows[t]
            k, a, d = _position(ref_s, oth_s, ref_top1, oth_top1, ref_own, oth_own)
            kl.append(k)
            agree.append(a)
            dnll.append(d)
    return {"mode": other.mode, **_summary(kl, agree, dnll)}


def default_noise_floor(against: str) -> str:
    """The mode whose difference from ``against`` is numerics only: reference:fp32 (fp32
    accumulation, as GPU kernels sum) for the exact reference, else the exact reference."""
    return "reference:fp32" if str(parse_mode(against)) == "reference" else "reference"


def reference_logprobs(model, mode, ids: torch.Tensor, k: int):
    """(rows, logits): the logits [B, T, V] of ``mode`` on ``ids`` [B, T], and per sequence (the
    log-softmax of each token given the ones before it, NaN first; per position t >= 1 the ``k``
    top entries (ids, logprobs), the token ``ids[t]`` added when outside them) from their float64
    log-softmax."""
    from .engine_logprobs import top_entries

    set_mode(model, mode)
    out = []
    with torch.no_grad():
        logits_all = _logits(model(ids))
    refuse_nonfinite(logits_all, f"golden: mode {parse_mode(mode)}")
    for b in range(ids.shape[0]):
        row_ids = ids[b].numpy()
        own = np.full(len(row_ids), np.nan)
        tops = []
        for r, lp in log_softmax_rows(logits_all[b, :-1]):
            t = r + 1
            own[t] = lp[row_ids[t]]
            top = top_entries(lp, k)
            if row_ids[t] not in top:
                top = np.append(top, row_ids[t])
            tops.append((top, lp[top]))
        out.append((own, tops))
    return out, logits_all
