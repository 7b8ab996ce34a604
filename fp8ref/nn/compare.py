"""The engines behind ``fp8ref compare`` and ``fp8ref eval``: one model, its Fp8RefLinear layers
switched between modes.

The first mode is the baseline. Per layer, two views:
- teacher-forced: every mode is fed the baseline's captured input of that layer, so each layer's
  own error shows;
- free-running: the whole model runs in the mode, so errors accumulate; here the share of the
  layer's FP8 activation codes that differ from the baseline's is also reported.
End to end: KL(baseline || mode) of the next-token distributions, top-1 agreement, the largest
|logit difference|, and perplexity when the tokens are real text.
"""

from __future__ import annotations

import numpy as np
import torch
from tqdm import tqdm

from .._arrays import numpy_of
from .linear import fp8ref_layers, set_mode
from .metrics import layer_metrics, logit_metrics, perplexity
from .modes import parse_mode, quantize_input


def _logits(out) -> torch.Tensor:
    return out.logits if hasattr(out, "logits") else out


def capture(model, ids: torch.Tensor, mode) -> tuple[torch.Tensor, dict, dict, list[str]]:
    """Run ``model`` in ``mode``; returns logits, layer -> [inputs], layer -> [outputs] and the
    layers in the order they first ran."""
    set_mode(model, mode)
    inputs: dict[str, list] = {}
    outputs: dict[str, list] = {}
    order: list[str] = []

    def hook(module, args, out):
        if module.name not in inputs:
            order.append(module.name)
        inputs.setdefault(module.name, []).append(args[0].detach())
        outputs.setdefault(module.name, []).append(out.detach())

    handles = [m.register_forward_hook(hook) for m in fp8ref_layers(model).values()]
    try:
        with torch.no_grad():
            logits = _logits(model(ids))
    finally:
        for h in handles:
            h.remove()
    return logits, inputs, outputs, order


def _cat(ts: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in ts])


def _code_differ(layer, xs: list, xs0: list) -> float | None:
    if layer.quant.input is None:
        return None
    a = [quantize_input(layer, numpy_of(x.reshape(-1, x.shape[-1])).astype(np.float32))[0] for x in xs]
    b = [quantize_input(layer, numpy_of(x.reshape(-1, x.shape[-1])).astype(np.float32))[0] for x in xs0]
    a, b = np.concatenate([c.reshape(-1) for c in a]), np.concatenate([c.reshape(-1) for c in b])
    return float(np.mean(a != b)) if a.size else 0.0


def compare(model, ids: torch.Tensor, modes: list, *, with_perplexity: bool = False, progress: bool = False) -> dict:
    """Compare ``modes`` (the first is the baseline) on token ids ``ids`` [B, T]; a JSON-able dict."""
    modes = [parse_mode(m) for m in modes]
    base = modes[0]
    layers = fp8ref_layers(model)
    for mode in modes:  # what a mode needs (original weights, a backend) is checked before any run
        for lin in layers.values():
            lin.check_mode(mode)
    logits0, in0, out0, order = capture(model, ids, base)
    end = {str(base): {"perplexity": perplexity(logits0, ids)} if with_perplexity else {}}
    per_layer = {name: {"name": name, "teacher_forced": {}, "free_running": {}} for name in order}
    first: dict[str, dict] = {}
    bar = tqdm(total=(len(modes) - 1) * 2 * len(order), desc="compare", unit="layer", disable=not progress)
    for mode in modes[1:]:
        key = str(mode)
        logits, ins, outs, _ = capture(model, ids, mode)
        end[key] = logit_metrics(logits, logits0)
        if with_perplexity:
            end[key]["perplexity"] = perplexity(logits, ids)
        first[key] = {"teacher_forced": None, "free_running": None}
        for name in order:
            lin = layers[name]
            tf = layer_metrics(_cat([lin.run(x, mode) for x in in0[name]]), _cat(out0[name]))
            if mode.kind == "backend":  # the declared scaled_mm parameters the backend ran with
                tf["scaled_mm"] = dict(lin.last_backend_params)
            bar.update()
            fr = layer_metrics(_cat(outs[name]), _cat(out0[name]))
            fr["code_differ"] = _code_differ(lin.layer, ins[name], in0[name])
            bar.update()
            per_layer[name]["teacher_forced"][key] = tf
            per_layer[name]["free_running"][key] = fr
            for view, m in (("teacher_forced", tf), ("free_running", fr)):
                if first[key][view] is None and m["differ"] > 0:
                    first[key][view] = name
    bar.close()
    set_mode(model, base)
    return {"baseline": str(base), "modes": [str(m) for m in modes],
            "tokens": {"batch": int(ids.shape[0]), "length": int(ids.shape[1])},
            "end_to_end": end, "first_divergent": first, "layers": [per_layer[n] for n in order]}


def evaluate(model, ids: torch.Tensor, mode, *, batch: int = 8, progress: bool = False) -> dict:
    """Perplexity of ``ids`` [B, T] under ``mode`` (batches of ``batch`` sequences)."""
    set_mode(model, mode)
    nll, count = 0.0, 0
    with torch.no_grad():
        for i in tqdm(range(0, ids.shape[0], batch), desc="eval", unit="batch", disable=not progress):
            chunk = ids[i:i + batch]
            logits = _logits(model(chunk))
            n = chunk.shape[0] * (chunk.shape[1] - 1)
            nll += float(np.log(perplexity(logits, chunk))) * n
            count += n
    return {"mode": str(parse_mode(mode)), "sequences": int(ids.shape[0]), "tokens": count,
            "perplexity": float(np.exp(nll / count)) if count else float("nan")}
