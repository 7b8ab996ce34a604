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
from ..executor import run_all
from ..io.spill import SpillStore
from ..limits import MAX_RANDOM_IDS
from .experts import Fp8RefExperts
from .linear import Fp8RefLinear, fp8ref_layers, set_mode
from .metrics import layer_metrics, logit_metrics, perplexity
from .model import build_model
from .modes import parse_mode, quantize_input
from .tokens import as_model_ids
from .verify import worker_checkpoint


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
        sink(module.name, args[0].detach(), out.detach(), getattr(module, "routed_tokens", None))

    handles = [m.register_forward_hook(hook) for m in fp8ref_layers(model).values()]
    try:
        with torch.no_grad():
            logits = _logits(model(ids))
    finally:
        for h in handles:
            h.remove()
    return logits, order


def _spiller(store, tag: str, inputs: bool = True):
    """A capture sink that writes each call's input and output to ``store`` at once, and for an
    MoE expert the batch rows routed to it (call number in the high 32 bits)."""
    calls: dict[str, int] = {}

    def sink(name, x, y, tokens=None):
        if inputs:
            store.append(f"{tag}/in/{name}", numpy_of(x))
        store.append(f"{tag}/out/{name}", numpy_of(y))
        if tokens is not None:
            n = calls[name] = calls.get(name, -1) + 1
            store.append(f"{tag}/tok/{name}", tokens.numpy().astype(np.int64) + (n << 32))
    return sink


def _routed_rows(store, key: str, name: str) -> tuple[np.ndarray, np.ndarray, float] | None:
    """For an expert: the rows of the mode's and the baseline's captures that hold the same tokens
    (routed to the expert in both runs), and the share of its tokens routed to it in one run only;
    None for a layer every token runs through."""
    tok0 = store.get(f"base/tok/{name}")
    if not tok0:
        return None
    a = np.concatenate(store.get(f"{key}/tok/{name}") or [np.zeros(0, np.int64)])
    b = np.concatenate(tok0)
    both, ia, ib = np.intersect1d(a, b, return_indices=True)
    union = np.union1d(a, b).size
    return ia, ib, (1 - both.size / union) if union else 0.0


def _rows(ts: list[torch.Tensor], idx: np.ndarray) -> list[torch.Tensor]:
    if not ts or not idx.size:
        return []
    flat = torch.cat([t.reshape(-1, t.shape[-1]) for t in ts])
    return [flat[torch.from_numpy(idx)]]


def _load(store, key: str) -> list[torch.Tensor]:
    return [torch_of(a) for a in store.get(key)]


def _cat(ts: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in ts]) if ts else torch.zeros(0)


def _code_differ(layer, xs: list, xs0: list) -> float | None:
    if layer.quant.input is None or not xs or not xs0:  # not xs: an expert no token reached in both runs
        return None
    a = [quantize_input(layer, numpy_of(x.reshape(-1, x.shape[-1])))[0] for x in xs]
    b = [quantize_input(layer, numpy_of(x.reshape(-1, x.shape[-1])))[0] for x in xs0]
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
    """``_teacher_forced`` from the checkpoint folder (a task of ``fp8ref.executor``)."""
    lin = Fp8RefLinear(worker_checkpoint(ckpt_path)[name], "reference", accumulate=accumulate, backend=backends,
                       original_weight=original_weight, original_bias=original_bias)
    return _teacher_forced(lin, mode, xs, ys)


def compare(model, ids: torch.Tensor, modes: list, *, with_perplexity: bool = False, progress: bool = False,
            executor: str = "local", checkpoint_path=None) -> dict:
    """Compare ``modes`` (the first is the baseline) on token ids ``ids`` [B, T]; a JSON-able dict.
    executor ``ray`` runs the teacher-forced layers as tasks (``checkpoint_path``: the folder the
    workers read the layers from); the free-running passes run here. Captured activations are spilled
    to a temporary folder and read back one layer at a time (``fp8ref.io.spill``)."""
    modes = [parse_mode(m) for m in modes]
    if ids.numel() > MAX_RANDOM_IDS:
        raise ModelError(f"compare: {ids.numel()} token ids ({ids.shape[0]} x {ids.shape[1]}); compare runs at most "
                         f"{MAX_RANDOM_IDS} in its one pass (eval takes longer inputs batch by batch)")
    ids = as_model_ids(ids)
    layers = fp8ref_layers(model)
    for mode in modes:  # what a mode needs (original weights, a backend) is checked before any run
        for lin in layers.values():
            lin.check_mode(mode)
    if executor != "local" and checkpoint_path is None:
        raise ModelError(f"compare: executor {executor!r} needs checkpoint_path (the workers read the layers)")
    with SpillStore() as store:  # activations on disk: at most one layer's are held at a time
        return _compare(model, ids, modes, layers, store, with_perplexity, progress, executor, checkpoint_path)


def _compare(model, ids, modes, layers, store, with_perplexity, progress, executor, checkpoint_path) -> dict:
    base = modes[0]
    logits0, order = capture(model, ids, base, _spiller(store, "base"))
    refuse_nonfinite(logits0, f"compare: baseline mode {base}")
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
            ys, ys0 = _load(store, f"{key}/out/{name}"), _load(store, f"base/out/{name}")
            xs, xs0 = _load(store, f"{key}/in/{name}"), _load(store, f"base/in/{name}")
            routed = _routed_rows(store, key, name)
            if routed is not None:  # an expert: the tokens routed to it in both runs, row by row
                ia, ib, routed_differ = routed
                ys, ys0, xs, xs0 = _rows(ys, ia), _rows(ys0, ib), _rows(xs, ia), _rows(xs0, ib)
            fr = layer_metrics(_cat(ys), _cat(ys0))
            fr["code_differ"] = _code_differ(layers[name].layer, xs, xs0)
            if routed is not None:
                fr["routed_differ"] = routed_differ
            per_layer[name]["free_running"][key] = fr
            for part in ("in", "out", "tok"):
                store.drop(f"{key}/{part}/{name}")
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
    else:  # a worker builds the layer from the checkpoint by name; gpt-oss's per-expert rows have none: here
        from .gptoss import ExpertSlice

        here = [type(layers[n].layer) is ExpertSlice for _, n in jobs]
        items = ((str(checkpoint_path), n, m, layers[n].accumulate, layers[n].backends,
                  *(layers[n].original_tensors() if m == "original" else (None, None)), *baseline(n))
                 for (m, n), local in zip(jobs, here) if not local)
        remote = iter(run_all(_teacher_forced_task, items, executor=executor, progress=progress,
                              desc="teacher-forced", total=len(jobs) - sum(here)))
        results = [_teacher_forced(layers[n], m, *baseline(n)) if local else next(remote)
                   for (m, n), local in zip(jobs, here)]
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
            "end_to_end": end, "first_divergent": first, "layers": [per_layer[n] for n in order],
            "expert_groups": expert_groups(model, per_layer, [str(m) for m in modes[1:]])}


def expert_groups(model, per_layer: dict, modes: list[str]) -> list[dict]:
    """One summary per MoE block (its experts' projection rows grouped, so a 256-expert model's
    report stays readable): how many experts ran, and per mode the worst and mean teacher-forced
    relative RMS over its projections, the worst free-running one, and the share of tokens routed
    otherwise than in the baseline (free-running, mean over the experts that ran)."""
    from .gptoss import GptOssExperts

    groups = []
    for m in model.modules():
        if not isinstance(m, (Fp8RefExperts, GptOssExperts)):
            continue
        names = [lin.name for p in m.projections for lin in p.values()]
        ran = [n for n in names if n in per_layer]
        g = {"experts": m.name, "count": m.num_experts, "projections": len(names), "ran": len(ran), "modes": {}}
        for mode in modes:
            tf = {n: per_layer[n]["teacher_forced"][mode]["rel_rms"] for n in ran}
            fr = {n: per_layer[n]["free_running"][mode] for n in ran}
            worst_tf = max(tf, key=tf.get, default=None)
            worst_fr = max(fr, key=lambda n: fr[n]["rel_rms"], default=None)
            routed = [f.get("routed_differ", 0.0) for f in fr.values()]
            g["modes"][mode] = {
                "teacher_forced": {"worst": worst_tf, "worst_rel_rms": tf.get(worst_tf),
                                   "mean_rel_rms": float(np.mean(list(tf.values()))) if tf else None},
                "free_running": {"worst": worst_fr, "worst_rel_rms": fr[worst_fr]["rel_rms"] if worst_fr else None,
                                 "routed_differ": float(np.mean(routed)) if routed else None}}
        groups.append(g)
    return groups


def refuse_nonfinite(logits: torch.Tensor, what: str) -> None:
    """A mode whose logits hold NaN or Inf has no next-token distribution: every metric against it
    (KL, top-1 agreement, perplexity) would be NaN or, worse, look perfect (argmax of NaN rows agrees)."""
    if _all_finite(logits):
        return
    bad = ~torch.isfinite(logits)
    if bad.any():
        raise ModelError(f"{what}: {int(bad.sum())} of {logits.numel()} logits are not finite (NaN or Inf); "
                         f"nothing to compare or evaluate (check the model's config.json and weights)")


# dtype -> (the integer type of its bits, the magnitude mask, the magnitude of +Inf)
_MAGNITUDE = {torch.bfloat16: (torch.int16, 0x7FFF, 0x7F80), torch.float16: (torch.int16, 0x7FFF, 0x7C00),
              torch.float32: (torch.int32, 0x7FFFFFFF, 0x7F800000)}


_FINITE_PIECE = 1 << 24  # elements per piece of the check: its magnitudes' buffer (32 MB in bfloat16), not a
# second array the size of the logits (263 MB at 4 x 256 tokens of a 128k vocabulary: eval's peak RSS)


def _all_finite(t: torch.Tensor) -> bool:
    """No NaN or Inf in ``t``: for bfloat16, float16 and float32 the largest magnitude bit pattern
    is below +Inf's (NaNs lie above it), an integer max per piece (torch's isfinite on bfloat16 logits
    takes 4x longer)."""
    spec = _MAGNITUDE.get(t.dtype)
    if spec is None or t.numel() == 0:
        return bool(torch.isfinite(t).all())
    itype, mask, inf = spec
    bits = t.contiguous().view(itype).reshape(-1)
    buf = torch.empty(min(bits.numel(), _FINITE_PIECE), dtype=itype)
    for lo in range(0, bits.numel(), _FINITE_PIECE):
        piece = bits[lo:lo + _FINITE_PIECE]
        magnitudes = buf[:piece.numel()]
        torch.bitwise_and(piece, mask, out=magnitudes)
        if int(magnitudes.amax()) >= inf:
            return False
    return True


def evaluate(model, ids: torch.Tensor, mode, *, batch: int = 8, progress: bool = False, executor: str = "local",
             build: dict | None = None) -> dict:
    """Perplexity of ``ids`` [B, T] under ``mode`` (batches of ``batch`` sequences). executor ``ray``
    runs each batch as a task that builds the model itself with ``build_model(**build)`` (``build``:
    picklable arguments: the checkpoint folder, original folder, ...); the batches' results are
    added here in order, as locally, so the report is byte-identical. Non-finite logits are refused,
    naming the mode and the batch's sequences."""
    if type(batch) is not int or batch < 1:
        raise ModelError(f"eval: batch: expected a positive integer, got {batch!r}")
    mode = parse_mode(mode)
    chunks = [(i, as_model_ids(ids[i:i + batch])) for i in range(0, ids.shape[0], batch)]
    if executor == "local":
        set_mode(model, mode)
        parts = run_all(lambda i, chunk: _batch_nll(model, chunk, mode, i), chunks, progress=progress,
                        desc="eval", total=len(chunks))
    else:
        if build is None:
            raise ModelError(f"evaluate: executor {executor!r} needs build (what the workers build the model from)")
        parts = run_all(_eval_task, ((build, str(mode), c, i) for i, c in chunks), executor=executor,
                        progress=progress, desc="eval", total=len(chunks))
    nll, count = 0.0, 0
    for log_ppl, n in parts:
        nll += log_ppl * n
        count += n
    return {"mode": str(mode), "sequences": int(ids.shape[0]), "tokens": count,
            "perplexity": float(np.exp(nll / count)) if count else float("nan")}


def _batch_nll(model, chunk: torch.Tensor, mode, first: int) -> tuple[float, int]:
    """(log perplexity, predicted tokens) of one batch, its first sequence ``first``."""
    with torch.no_grad():
        logits = _logits(model(chunk))
    refuse_nonfinite(logits, f"eval: mode {mode}, sequences {first}..{first + chunk.shape[0] - 1}")
    return float(np.log(perplexity(logits, chunk))), chunk.shape[0] * (chunk.shape[1] - 1)


_BUILT: dict = {}  # a worker's model, built once for its tasks


def _eval_task(build: dict, mode: str, chunk: torch.Tensor, first: int) -> tuple[float, int]:
    """``_batch_nll`` on a worker (a task of ``fp8ref.executor``), the model built there once."""
    key = repr(sorted((k, v) for k, v in build.items() if k != "backend"))
    if key not in _BUILT:
        _BUILT.clear()
        _BUILT[key] = build_model(**build)
    model = _BUILT[key]
    set_mode(model, mode)
    return _batch_nll(model, chunk, mode, first)
