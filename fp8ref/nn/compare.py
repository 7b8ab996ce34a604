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

from .._arrays import numpy_of, torch_of
from ..errors import ModelError
from ..io.spill import SpillStore
from .linear import fp8ref_layers, set_mode
from .metrics import layer_metrics, logit_metrics, perplexity
from .modes import parse_mode, quantize_input


def _logits(out) -> torch.Tensor:
    return out.logits if hasattr(out, "logits") else out


def capture(model, ids: torch.Tensor, mode, sink) -> tuple[torch.Tensor, list[str]]:
    """Run ``model`` in ``mode``, handing every Fp8RefLinear call to ``sink(name, input, output)``;
    returns the logits and the layers in the order they first ran."""
    set_mode(model, mode)
    order: list[str] = []
    seen: set[str] = set()

    def hook(module, args, out):
        if module.name not in seen:
            seen.add(module.name)
            order.append(module.name)
        sink(module.name, args[0].detach(), out.detach())

    handles = [m.register_forward_hook(hook) for m in fp8ref_layers(model).values()]
    try:
        with torch.no_grad():
            logits = _logits(model(ids))
    finally:
        for h in handles:
            h.remove()
    return logits, order


def _spiller(store, tag: str, inputs: bool = True):
    """A capture sink that writes each call's input and output to ``store`` at once."""
    def sink(name, x, y):
        if inputs:
            store.append(f"{tag}/in/{name}", numpy_of(x))
        store.append(f"{tag}/out/{name}", numpy_of(y))
    return sink


def _load(store, key: str) -> list[torch.Tensor]:
    return [torch_of(a) for a in store.get(key)]


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
    if parse_mode(mode).kind == "backend":  # the operation (linear or scaled_mm) and the parameters it ran with
        params = dict(lin.last_backend_params)
        m[params.pop("op", "scaled_mm")] = params
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
    workers read the layers from); the free-running passes run here. Captured activations are spilled
    to a temporary folder and read back one layer at a time (``fp8ref.io.spill``)."""
    modes = [parse_mode(m) for m in modes]
    layers = fp8ref_layers(model)
    for mode in modes:  # what a mode needs (original weights, a backend) is checked before any run
        for lin in layers.values():
            lin.check_mode(mode)
    if executor != "local" and checkpoint_path is None:
        raise ModelError(f"compare: executor {executor!r} needs checkpoint_path (the workers read the layers)")
    with SpillStore() as store:  # activations on disk: at most one layer's are held at a time
        return _compare(model, ids, modes, layers, store, with_perplexity, progress, executor, checkpoint_path)


def _compare(model, ids, modes, layers, store, with_perplexity, progress, executor, checkpoint_path) -> dict:
    from .executor import run_all

    base = modes[0]
    logits0, order = capture(model, ids, base, _spiller(store, "base"))
    end = {str(base): {"perplexity": perplexity(logits0, ids)} if with_perplexity else {}}
    per_layer = {name: {"name": name, "teacher_forced": {}, "free_running": {}} for name in order}
    first: dict[str, dict] = {}
    bar = tqdm(total=(len(modes) - 1) * len(order), desc="free-running", unit="layer", disable=not progress)
    for mode in modes[1:]:
        key = str(mode)
        logits, _ = capture(model, ids, mode, _spiller(store, key))
        end[key] = logit_metrics(logits, logits0)
        if with_perplexity:
            end[key]["perplexity"] = perplexity(logits, ids)
        for name in order:
            fr = layer_metrics(_cat(_load(store, f"{key}/out/{name}")), _cat(_load(store, f"base/out/{name}")))
            fr["code_differ"] = _code_differ(layers[name].layer, _load(store, f"{key}/in/{name}"),
                                             _load(store, f"base/in/{name}"))
            per_layer[name]["free_running"][key] = fr
            store.drop(f"{key}/in/{name}")
            store.drop(f"{key}/out/{name}")
            bar.update()
    bar.close()
    jobs = [(str(mode), name) for name in order for mode in modes[1:]]  # layer by layer: each loaded once
    cache: dict[str, tuple] = {}

    def baseline(name):  # the one layer whose captured input and output are held
        if name not in cache:
            cache.clear()
            cache[name] = (_load(store, f"base/in/{name}"), _load(store, f"base/out/{name}"))
        return cache[name]

    if executor == "local":
        results = run_all(lambda m, n: _teacher_forced(layers[n], m, *baseline(n)),
                          ((m, n) for m, n in jobs), progress=progress, desc="teacher-forced", total=len(jobs))
    else:
        items = ((str(checkpoint_path), n, m, layers[n].accumulate, layers[n].backends,
                  *(layers[n].original_tensors() if m == "original" else (None, None)), *baseline(n))
                 for m, n in jobs)
        results = run_all(_teacher_forced_task, items, executor=executor, progress=progress, desc="teacher-forced",
                          total=len(jobs))
    cache.clear()
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


def evaluate(model, ids: torch.Tensor, mode, *, batch: int = 8, progress: bool = False, executor: str = "local",
             build: dict | None = None) -> dict:
    """Perplexity of ``ids`` [B, T] under ``mode`` (batches of ``batch`` sequences). executor ``ray``
    runs each batch as a task that builds the model itself with ``build_model(**build)`` (``build``:
    picklable arguments: the checkpoint folder, original folder, ...); the batches' results are
    added here in order, as locally, so the report is byte-identical."""
    from .executor import run_all

    mode = parse_mode(mode)
    chunks = [ids[i:i + batch] for i in range(0, ids.shape[0], batch)]
    if executor == "local":
        set_mode(model, mode)
        parts = run_all(lambda chunk: _batch_nll(model, chunk), ((c,) for c in chunks), progress=progress,
                        desc="eval", total=len(chunks))
    else:
        if build is None:
            raise ModelError(f"evaluate: executor {executor!r} needs build (what the workers build the model from)")
        parts = run_all(_eval_task, ((build, str(mode), c) for c in chunks), executor=executor, progress=progress,
                        desc="eval", total=len(chunks))
    nll, count = 0.0, 0
    for log_ppl, n in parts:
        nll += log_ppl * n
        count += n
    return {"mode": str(mode), "sequences": int(ids.shape[0]), "tokens": count,
            "perplexity": float(np.exp(nll / count)) if count else float("nan")}


def _batch_nll(model, chunk: torch.Tensor) -> tuple[float, int]:
    """(log perplexity, predicted tokens) of one batch."""
    with torch.no_grad():
        logits = _logits(model(chunk))
    return float(np.log(perplexity(logits, chunk))), chunk.shape[0] * (chunk.shape[1] - 1)


_BUILT: dict = {}  # a worker's model, built once for its tasks


def _eval_task(build: dict, mode: str, chunk: torch.Tensor) -> tuple[float, int]:
    """``_batch_nll`` on a worker (a task of ``fp8ref.nn.executor``), the model built there once."""
    from .model import build_model

    key = repr(sorted((k, v) for k, v in build.items() if k != "backend"))
    if key not in _BUILT:
        _BUILT.clear()
        _BUILT[key] = build_model(**build)
    model = _BUILT[key]
    set_mode(model, mode)
    return _batch_nll(model, chunk)
