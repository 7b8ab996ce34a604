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
from ..errors import ModelError
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


def _teacher_forced(lin, mode, xs: list, ys: list) -> dict:
    """A layer's own error: run in ``mode`` on the baseline's inputs, against the baseline's outputs."""
    m = layer_metrics(_cat([lin.run(x, mode) for x in xs]), _cat(ys))
    if parse_mode(mode).kind == "backend":  # the declared scaled_mm parameters the backend ran with
        m["scaled_mm"] = dict(lin.last_backend_params)
    return m


def _teacher_forced_task(ckpt_path: str, name: str, mode: str, accumulate: str, backends: dict, original_weight,
                         original_bias, xs: list, ys: list) -> dict:
    """``_teacher_forced`` from the checkpoint folder (a task of ``fp8ref.nn.executor``)."""
    from .linear import Fp8RefLinear
    from .verify import _load

    lin = Fp8RefLinear(_load(ckpt_path)[name], "reference", accumulate=accumulate, backend=backends,
                       original_weight=original_weight, original_bias=original_bias)
    return _teacher_forced(lin, mode, xs, ys)


def compare(model, ids: torch.Tensor, modes: list, *, with_perplexity: bool = False, progress: bool = False,
            executor: str = "local", checkpoint_path=None) -> dict:
    """Compare ``modes`` (the first is the baseline) on token ids ``ids`` [B, T]; a JSON-able dict.
    executor ``ray`` runs the teacher-forced layers as tasks (``checkpoint_path``: the folder the
    workers read the layers from); the free-running passes run here."""
    from .executor import run_all

    modes = [parse_mode(m) for m in modes]
    base = modes[0]
    layers = fp8ref_layers(model)
    for mode in modes:  # what a mode needs (original weights, a backend) is checked before any run
        for lin in layers.values():
            lin.check_mode(mode)
    if executor != "local" and checkpoint_path is None:
        raise ModelError(f"compare: executor {executor!r} needs checkpoint_path (the workers read the layers)")
    logits0, in0, out0, order = capture(model, ids, base)
    end = {str(base): {"perplexity": perplexity(logits0, ids)} if with_perplexity else {}}
    per_layer = {name: {"name": name, "teacher_forced": {}, "free_running": {}} for name in order}
    first: dict[str, dict] = {}
    bar = tqdm(total=(len(modes) - 1) * len(order), desc="free-running", unit="layer", disable=not progress)
    for mode in modes[1:]:
        key = str(mode)
        logits, ins, outs, _ = capture(model, ids, mode)
        end[key] = logit_metrics(logits, logits0)
        if with_perplexity:
            end[key]["perplexity"] = perplexity(logits, ids)
        for name in order:
            fr = layer_metrics(_cat(outs[name]), _cat(out0[name]))
            fr["code_differ"] = _code_differ(layers[name].layer, ins[name], in0[name])
            per_layer[name]["free_running"][key] = fr
            bar.update()
    bar.close()
    jobs = [(str(mode), name) for mode in modes[1:] for name in order]
    if executor == "local":
        results = run_all(lambda m, n: _teacher_forced(layers[n], m, in0[n], out0[n]), jobs, progress=progress,
                          desc="teacher-forced")
    else:
        items = [(str(checkpoint_path), n, m, layers[n].accumulate, layers[n].backends, layers[n].original_weight,
                  layers[n].original_bias, in0[n], out0[n]) for m, n in jobs]
        results = run_all(_teacher_forced_task, items, executor=executor, progress=progress, desc="teacher-forced")
    for (key, name), tf in zip(jobs, results):
        per_layer[name]["teacher_forced"][key] = tf
    for mode in modes[1:]:
        key = str(mode)
        first[key] = {view: next((n for n in order if per_layer[n][view][key]["differ"] > 0), None)
                      for view in ("teacher_forced", "free_running")}
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
