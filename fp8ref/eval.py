"""lm-eval-harness on fp8ref's model. ``import fp8ref.eval`` registers lm-eval's model ``"fp8ref"``:

    import fp8ref.eval, lm_eval
    lm_eval.simple_evaluate(model="fp8ref", model_args="checkpoint=DIR,mode=producer", tasks=[...])

``Fp8RefLM`` is lm-eval's own ``HFLM`` given the module ``fp8ref.nn.build_model`` returns and the
checkpoint's tokenizer (``fp8ref.nn.tokenizer``: tokenizer.json read as data, wrapped in
transformers' ``PreTrainedTokenizerFast``), so requests are batched, windowed and scored by
lm-eval's code exactly as for its ``hf`` model; only the layers are fp8ref's. Nothing is
downloaded (``HF_HUB_OFFLINE`` / ``HF_DATASETS_OFFLINE`` are set while tasks run) and
``trust_remote_code`` is refused. Needs lm-eval (``pip install fp8ref[eval]``).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM

from .conformance.backend import load_backend
from .errors import ModelError
from .nn import build_model, parse_mode
from .nn.tokenizer import load_tokenizer, special_tokens

LOCAL_BUILDERS = ("json", "csv", "parquet", "text", "arrow")
"""``dataset_path`` values that read only the task's ``data_files`` (datasets' packaged builders)."""


def hf_tokenizer(folder):
    """transformers' fast tokenizer over the tokenizer.json fp8ref read from ``folder`` (same ids,
    same BOS/EOS as ``AutoTokenizer`` reading the folder; no class imported, nothing fetched)."""
    import transformers


    tok = load_tokenizer(folder)
    return tok, transformers.PreTrainedTokenizerFast(tokenizer_object=tok.backend, **special_tokens(Path(folder)))


@register_model("fp8ref")
class Fp8RefLM(HFLM):
    """lm-eval's ``hf`` model on ``build_model(checkpoint, mode=...)``.

    model_args: ``checkpoint`` (folder), ``mode`` (reference[:ACC], producer, original,
    backend:NAME; default reference), ``original`` (for mode original), ``tokenizer`` (a folder
    with tokenizer.json; default the checkpoint), ``max_length`` (default the config's
    ``max_position_embeddings``, as HFLM), ``batch_size``; ``keep_decoded`` (default true)."""

    def __init__(self, checkpoint=None, mode: str = "reference", original=None, tokenizer=None,
                 keep_decoded: bool = True, trust_remote_code: bool = False, **kwargs):
        if trust_remote_code:
            raise ModelError("fp8ref lm-eval model: trust_remote_code is refused; fp8ref runs no code from a "
                             "checkpoint")
        if not checkpoint:
            raise ModelError("fp8ref lm-eval model: give model_args checkpoint=DIR")
        parsed = parse_mode(str(mode))
        backend = {parsed.arg: load_backend(parsed.arg)} if parsed.kind == "backend" else None
        model = build_model(str(checkpoint), mode=parsed, original=original, backend=backend,
                            keep_decoded=bool(keep_decoded))
        self.fp8ref_tokenizer, hf_tok = hf_tokenizer(tokenizer or checkpoint)
        self.fp8ref_mode = str(parsed)
        kwargs.pop("device", None)  # the model is on the CPU, where fp8ref runs
        kwargs.pop("pretrained", None)
        super().__init__(pretrained=model, tokenizer=hf_tok, backend="causal", **kwargs)


@contextlib.contextmanager
def offline():
    """No hub access while lm-eval and datasets run (restored after)."""
    keys = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")
    saved = {k: os.environ.get(k) for k in keys}
    os.environ.update({k: "1" for k in keys})
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def refuse_remote_datasets(manager, tasks: list[str]) -> None:
    """Before any data loads: every task's YAML reads local files, ``dataset_path`` one of
    ``LOCAL_BUILDERS`` with ``dataset_kwargs.data_files``, or an existing local folder; a hub
    dataset name is refused in one line."""
    from lm_eval.tasks._index import Kind
    from lm_eval.tasks._yaml_loader import load_yaml

    for name in tasks:
        entry = manager.task_index[name]
        if entry.kind is not Kind.TASK or entry.yaml_path is None:
            raise ModelError(f"--tasks: {name} is a {entry.kind.name.lower()}; fp8ref eval takes task names (each "
                             f"checked to read local files)")
        cfg = load_yaml(entry.yaml_path, resolve_func=False)
        path = cfg.get("dataset_path")
        if path in LOCAL_BUILDERS:
            if not (cfg.get("dataset_kwargs") or {}).get("data_files"):
                raise ModelError(f"{entry.yaml_path}: task {name}: dataset_path {path} without "
                                 f"dataset_kwargs.data_files; expected local files")
            continue
        if path and Path(str(path)).is_dir():
            continue
        raise ModelError(f"{entry.yaml_path}: task {name}: dataset_path {path!r} is not a local dataset; "
                         f"fp8ref eval runs offline: use dataset_path: json with dataset_kwargs: {{data_files: ...}}")


def run_tasks(checkpoint, tasks: list[str], *, mode: str = "reference", original=None, tokenizer=None,
              include_path=None, limit=None, batch_size: int = 8, keep_decoded: bool = True,
              softmax_dtype: str | None = "float32", log_samples: bool = False) -> dict:
    """lm-eval's ``simple_evaluate`` on the ``fp8ref`` model, offline; its results per task (and with
    ``log_samples`` lm-eval's per-document samples, under ``samples``: not JSON-able)."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    with offline():
        manager = TaskManager(include_path=str(include_path) if include_path else None)
        unknown = [t for t in tasks if t not in manager.all_tasks]
        if unknown:
            raise ModelError(f"--tasks: unknown task {unknown[0]!r}" +
                             (f" (not in lm-eval's tasks or {include_path})" if include_path else
                              "; give --include-path DIR with its YAML"))
        refuse_remote_datasets(manager, tasks)
        lm = Fp8RefLM(checkpoint=checkpoint, mode=mode, original=original, tokenizer=tokenizer,
                      keep_decoded=keep_decoded, batch_size=batch_size, softmax_dtype=softmax_dtype)
        out = lm_eval.simple_evaluate(model=lm, tasks=tasks, task_manager=manager,
                                      limit=limit, log_samples=log_samples)
    res = {"mode": lm.fp8ref_mode, "tokenizer": lm.fp8ref_tokenizer.describe(), "lm_eval": lm_eval.__version__,
           "softmax_dtype": softmax_dtype or "model", "limit": limit, "results": out["results"],
           "higher_is_better": out.get("higher_is_better") or {}}
    if log_samples:
        res["samples"] = out.get("samples") or {}
    return res


def metrics(results: dict) -> dict[str, dict[str, float]]:
    """{task: {metric: value}}: lm-eval's numbers, its stderr entries left out."""
    return {task: {k: v for k, v in r.items() if isinstance(v, (int, float)) and not isinstance(v, bool)
                   and "_stderr" not in k and k != "sample_len"}
            for task, r in results.items()}


def recovery(quantized: dict, original: dict, higher_is_better: dict) -> dict[str, dict[str, float | None]]:
    """{task: {metric: recovery}} in llm-compressor's form (tests/lmeval: ``compressed / base``, whose CI
    requires >= 0.95 after rounding to two decimals), for metrics where higher is better; where lower is
    better (perplexities, bits per byte) ``original / quantized``, so that 1.0 is again full recovery and
    less is worse. None where the original's value is 0 (or the quantized one, lower-is-better)."""
    out = {}
    for task, ms in quantized.items():
        hib = higher_is_better.get(task, {})
        out[task] = {}
        for name, q in ms.items():
            base = original.get(task, {}).get(name)
            if base is None:
                continue
            higher = hib.get(name.split(",")[0], True)
            num, den = (q, base) if higher else (base, q)
            out[task][name] = None if den == 0 else num / den
    return out


def worst_task(recoveries: dict) -> str | None:
    """The task with the lowest recovery over its metrics (None when nothing was comparable)."""
    worst = {t: min(v for v in r.values() if v is not None) for t, r in recoveries.items()
             if any(v is not None for v in r.values())}
    return min(worst, key=worst.get) if worst else None


def sample_texts(samples: list, n: int) -> list[str]:
    """The first ``n`` documents' full texts (context + continuation) as lm-eval scored them."""
    texts = []
    for s in samples[:n]:
        args = s.get("arguments") or []
        first = args[0] if args else ()
        if isinstance(first, (list, tuple)):
            texts.append("".join(str(a) for a in first[:2]))
        elif isinstance(first, dict) and "arg_0" in first:  # lm-eval's JSON-friendly form
            texts.append(str(first.get("arg_0", "")) + str(first.get("arg_1", "")))
        else:
            texts.append(str(first))
    return [t for t in texts if t]
