"""``fp8ref eval``: perplexity of a checkpoint's model under one mode (the seed's "load an FP8
static model from disk and evaluate its accuracy")."""

from __future__ import annotations

import os

from ..checkpoint import load_checkpoint
from ..errors import ModelError
from ..limits import MAX_BATCH
from .argtypes import int_range
from .compare import add_input_args, add_keep_decoded, early_token_ids, token_ids
from .output import add_progress_flags, backends_for, declare_paths, progress_enabled, write_json


def register(sub) -> None:
    p = sub.add_parser("eval", help="perplexity of a checkpoint's model under a mode",
                       description="Needs transformers (fp8ref[hf]). token ids: --tokens FILE (integer ids, one "
                                   "sequence per line) or --text FILE (tokenized by the checkpoint's tokenizer.json "
                                   "or --tokenizer DIR into lm-eval's rolling windows; --byte-tokens: bytes -> ids "
                                   "modulo the vocabulary).")
    p.add_argument("checkpoint", metavar="CKPT", help="checkpoint folder (config.json + safetensors)")
    p.add_argument("--mode", default="reference",
                   help="reference[:ACCUMULATION] (default), producer, original, backend:NAME")
    p.add_argument("--original", metavar="SRC", help="original (unquantized) weights, for mode 'original'")
    add_input_args(p, random=False)
    p.add_argument("--batch", type=int_range(1, MAX_BATCH), default=8,
                   help=f"sequences per forward pass, 1..{MAX_BATCH} (default 8)")
    p.add_argument("--executor", choices=("local", "ray"), default="local",
                   help="batches here (default) or as Ray tasks, each worker building the model once "
                        "(RAY_ADDRESS, else a local cluster)")
    add_keep_decoded(p)
    add_task_args(p)
    p.add_argument("--json", metavar="OUT", help="write the result as JSON to OUT ('-': stdout)")
    add_progress_flags(p)
    declare_paths(p, inputs=("tokens", "text", "tokenizer", "include_path"), checkpoints=("checkpoint", "original"),
                  files=("json",))
    p.set_defaults(handler=cmd_eval)


def add_task_args(p) -> None:
    p.add_argument("--tasks", metavar="NAMES", help="comma-separated lm-eval tasks, run in process on fp8ref's model "
                                                    "(needs lm-eval: fp8ref[eval]); offline: local data only")
    p.add_argument("--include-path", metavar="DIR", help="--tasks: a folder of task YAMLs (lm-eval's --include_path)")
    p.add_argument("--limit", type=int_range(1, 2**31 - 1), metavar="N", help="--tasks: at most N documents per task")
    p.add_argument("--softmax-dtype", choices=("model", "float32", "float64"), default="float32",
                   help="--tasks: dtype of lm-eval's log-softmax (default float32; 'model': lm-eval's own default, "
                        "the model's dtype, which rounds each log-likelihood to bf16)")


def cmd_tasks(args) -> int:
    if args.text or args.tokens or args.byte_tokens:
        raise ModelError("eval: --tasks runs lm-eval's tasks through the tokenizer; give it without --text, "
                         "--tokens or --byte-tokens")

    for key in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):  # read when the hub
        os.environ[key] = "1"  # libraries are first imported, so set before lm-eval imports them
    try:
        from ..eval import run_tasks
    except ImportError as exc:
        raise ModelError(f"eval --tasks needs lm-eval with its hf extra (pip install fp8ref[eval]): {exc}") from None
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if not tasks:
        raise ModelError("--tasks: expected comma-separated task names")
    modes = [m.strip() for m in args.mode.split(",") if m.strip()]
    if not modes or len(set(modes)) != len(modes):
        raise ModelError(f"--mode: expected distinct comma-separated modes, got {args.mode!r}")
    runs = {}
    for mode in modes:
        runs[mode] = run_tasks(args.checkpoint, tasks, mode=mode, original=args.original, tokenizer=args.tokenizer,
                               include_path=args.include_path, limit=args.limit, batch_size=args.batch,
                               keep_decoded=args.keep_decoded, log_samples=mode == "original" and len(modes) > 1,
                               softmax_dtype=None if args.softmax_dtype == "model" else args.softmax_dtype)
    if len(modes) == 1:
        res = {"checkpoint": str(args.checkpoint), **runs[modes[0]]}
        res.pop("higher_is_better")
        if not (args.json and write_json(res, args.json)):
            print(f"{res['checkpoint']}: mode {res['mode']}, tokenizer {res['tokenizer']}, lm-eval {res['lm_eval']}")
            for task, metrics in res["results"].items():
                shown = ", ".join(f"{k} {v:.6g}" for k, v in metrics.items() if isinstance(v, float))
                print(f"  {task}: {shown}")
        return 0
    res = tasks_table(args, runs)
    if not (args.json and write_json(res, args.json)):
        print_tasks_table(res)
    return 0


def tasks_table(args, runs: dict) -> dict:
    """Several modes: each task's metrics per mode, the recovery of each quantized mode against
    ``original`` (when it ran), and fp8ref's per-layer figures on the worst task's documents."""
    from ..eval import metrics, recovery, worst_task

    first = next(iter(runs.values()))
    table = {mode: metrics(r["results"]) for mode, r in runs.items()}
    res = {"checkpoint": str(args.checkpoint), "modes": list(runs), "tokenizer": first["tokenizer"],
           "lm_eval": first["lm_eval"], "softmax_dtype": first["softmax_dtype"], "limit": first["limit"],
           "metrics": table, "results": {mode: r["results"] for mode, r in runs.items()}}
    if "original" in runs:
        hib = runs["original"]["higher_is_better"]
        res["recovery"] = {mode: recovery(table[mode], table["original"], hib) for mode in runs if mode != "original"}
        quantized = [m for m in runs if m != "original"]
        if quantized and (task := worst_task(res["recovery"][quantized[0]])) is not None:
            res["worst_task"] = {"task": task, "mode": quantized[0],
                                 **worst_task_layers(args, quantized[0], runs["original"]["samples"].get(task, []))}
    return res


def worst_task_layers(args, mode: str, samples: list) -> dict:
    """``compare`` of ``mode`` against ``original`` on the first documents of the worst task."""
    import torch

    from ..eval import hf_tokenizer, sample_texts
    from ..nn import build_model
    from ..nn.compare import compare

    texts = sample_texts(samples, 16)
    _, tok = hf_tokenizer(args.tokenizer or args.checkpoint)
    seq = tok.encode(" ".join(texts))[:256]  # the documents as one sequence: one batched pass
    if len(seq) < 2:
        return {"layers": [], "note": "the task's documents give fewer than two tokens"}
    ids = torch.tensor([seq], dtype=torch.long)
    model = build_model(str(args.checkpoint), mode=mode, original=args.original, keep_decoded=args.keep_decoded)
    r = compare(model, ids, ["original", mode])
    worst = sorted(r["layers"], key=lambda x: -x["teacher_forced"][mode]["rel_rms"])
    return {"documents": len(texts), "tokens": len(seq), "end_to_end": r["end_to_end"][mode],
            "layers": [{"name": x["name"], **x["teacher_forced"][mode]} for x in worst]}


def print_tasks_table(res: dict) -> None:
    modes = res["modes"]
    print(f"{res['checkpoint']}: tokenizer {res['tokenizer']}, lm-eval {res['lm_eval']}, "
          f"log-softmax {res['softmax_dtype']}")
    rec = res.get("recovery", {})
    head = ["task", "metric", *modes, *(f"recovery {m}" for m in rec)]
    rows = []
    for task, ms in res["metrics"][modes[0]].items():
        for name in ms:
            rows.append([task, name, *(f"{res['metrics'][m][task].get(name, float('nan')):.6g}" for m in modes),
                         *("-" if rec[m][task].get(name) is None else f"{rec[m][task][name]:.2f}" for m in rec)])
    widths = [max(len(str(r[i])) for r in [head, *rows]) for i in range(len(head))]
    for r in [head, *rows]:
        print("  " + "  ".join(str(c).ljust(w) for c, w in zip(r, widths)))
    if rec:
        print("  recovery: quantized / original as llm-compressor's CI computes it (>= 0.95 passes); "
              "original / quantized where lower is better")
    if "worst_task" in res:
        w = res["worst_task"]
        shown = ", ".join(f"{x['name']} {x['rel_rms']:.3g}" for x in w["layers"][:3])
        e = w.get("end_to_end", {})
        print(f"  worst task {w['task']} ({w['mode']} vs original on its first {w.get('documents', 0)} documents, "
              f"{w.get('tokens', 0)} tokens): KL {e.get('kl', float('nan')):.3e}, worst teacher-forced relative RMS: "
              f"{shown or 'none'}")


def cmd_eval(args) -> int:
    import torch

    from ..nn import build_model, parse_mode
    from ..nn.compare import evaluate
    from ..nn.perplexity import evaluate_windows

    if args.tasks:
        return cmd_tasks(args)
    if not (args.text or args.tokens):
        raise ModelError("eval: give --text FILE, --tokens FILE or --tasks NAMES")
    mode = parse_mode(args.mode)
    ckpt = load_checkpoint(args.checkpoint)
    early = early_token_ids(args, ckpt)
    model = build_model(ckpt, mode=mode, original=args.original, backend=backends_for([mode]),
                        keep_decoded=args.keep_decoded)  # local batches; vocabulary size for the ids
    ids, source, tokenizer = early or token_ids(args, int(model.config.vocab_size))
    if isinstance(ids, torch.Tensor):
        build = {"checkpoint": str(args.checkpoint), "mode": str(mode), "original": args.original,
                 "backend": backends_for([mode]), "keep_decoded": args.keep_decoded}
        run = evaluate(model, ids, mode, batch=args.batch, progress=progress_enabled(args), executor=args.executor,
                       build=build)
    else:  # tokenized --text windows
        if args.executor != "local":
            raise ModelError("eval --text with a tokenizer runs locally; --executor ray takes --tokens or "
                             "--byte-tokens")
        run = evaluate_windows(model, ids, mode, batch=args.batch, progress=progress_enabled(args))
    res = {"checkpoint": str(args.checkpoint), "input": source, "tokenizer": tokenizer, **run}
    if not (args.json and write_json(res, args.json)):
        print(f"{res['checkpoint']}: mode {res['mode']}, {res['sequences']} sequences, {res['tokens']} predicted "
              f"tokens: perplexity {res['perplexity']:.6g}")
    return 0
