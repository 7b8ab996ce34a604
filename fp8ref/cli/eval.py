"""``fp8ref eval``: perplexity of a checkpoint's model under one mode (the seed's "load an FP8
static model from disk and evaluate its accuracy")."""

from __future__ import annotations

import os

from ..checkpoint import load_checkpoint
from ..errors import ModelError
from ..limits import MAX_BATCH
from .argtypes import int_range
from .compare import (
    add_input_args,
    add_keep_decoded,
    backends_for,
    early_token_ids,
    token_ids,
    write_json,
)
from .output import add_progress_flags, declare_paths, progress_enabled


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
    res = {"checkpoint": str(args.checkpoint),
           **run_tasks(args.checkpoint, tasks, mode=args.mode, original=args.original, tokenizer=args.tokenizer,
                       include_path=args.include_path, limit=args.limit, batch_size=args.batch,
                       keep_decoded=args.keep_decoded,
                       softmax_dtype=None if args.softmax_dtype == "model" else args.softmax_dtype)}
    if not (args.json and write_json(res, args.json)):
        print(f"{res['checkpoint']}: mode {res['mode']}, tokenizer {res['tokenizer']}, lm-eval {res['lm_eval']}")
        for task, metrics in res["results"].items():
            shown = ", ".join(f"{k} {v:.6g}" for k, v in metrics.items() if isinstance(v, float))
            print(f"  {task}: {shown}")
    return 0


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
