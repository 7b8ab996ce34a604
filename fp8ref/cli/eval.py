"""``fp8ref eval``: perplexity of a checkpoint's model under one mode (the seed's "load an FP8
static model from disk and evaluate its accuracy")."""

from __future__ import annotations

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
    add_keep_decoded(p)
    p.add_argument("--json", metavar="OUT", help="write the result as JSON to OUT ('-': stdout)")
    add_progress_flags(p)
    declare_paths(p, inputs=("tokens", "text", "tokenizer"), checkpoints=("checkpoint", "original"),
                  files=("json",))
    p.set_defaults(handler=cmd_eval)


def cmd_eval(args) -> int:
    import torch

    from ..checkpoint import load_checkpoint
    from ..errors import ModelError
    from ..nn import build_model, parse_mode
    from ..nn.compare import evaluate
    from ..nn.perplexity import evaluate_windows

    if not (args.text or args.tokens):
        raise ModelError("eval: give --text FILE or --tokens FILE")
    mode = parse_mode(args.mode)
    ckpt = load_checkpoint(args.checkpoint)
    early = early_token_ids(args, ckpt)
    model = build_model(ckpt, mode=mode, original=args.original, backend=backends_for([mode]),
                        keep_decoded=args.keep_decoded)
    ids, source, tokenizer = early or token_ids(args, int(model.config.vocab_size))
    run = evaluate if isinstance(ids, torch.Tensor) else evaluate_windows
    res = {"checkpoint": str(args.checkpoint), "input": source, "tokenizer": tokenizer,
           **run(model, ids, mode, batch=args.batch, progress=progress_enabled(args))}
    if not (args.json and write_json(res, args.json)):
        print(f"{res['checkpoint']}: mode {res['mode']}, {res['sequences']} sequences, {res['tokens']} predicted "
              f"tokens: perplexity {res['perplexity']:.6g}")
    return 0
