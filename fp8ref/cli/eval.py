"""``fp8ref eval``: perplexity of a checkpoint's model under one mode (the seed's "load an FP8
static model from disk and evaluate its accuracy")."""

from __future__ import annotations

from .compare import INPUT_HELP, add_input_args, add_keep_decoded, backends_for, token_ids, write_json
from .output import add_progress_flags, progress_enabled


def register(sub) -> None:
    p = sub.add_parser("eval", help="perplexity of a checkpoint's model under a mode",
                       description=f"Needs transformers (fp8ref[hf]). {INPUT_HELP}.")
    p.add_argument("checkpoint", metavar="CKPT", help="checkpoint folder (config.json + safetensors)")
    p.add_argument("--mode", default="reference",
                   help="reference[:ACCUMULATION] (default), producer, original, backend:NAME")
    p.add_argument("--original", metavar="SRC", help="original (unquantized) weights, for mode 'original'")
    add_input_args(p, random=False)
    p.add_argument("--batch", type=int, default=8, help="sequences per forward pass (default 8)")
    p.add_argument("--executor", choices=("local", "ray"), default="local",
                   help="batches here (default) or as Ray tasks, each worker building the model once "
                        "(RAY_ADDRESS, else a local cluster)")
    add_keep_decoded(p)
    p.add_argument("--json", metavar="OUT", help="write the result as JSON to OUT ('-': stdout)")
    add_progress_flags(p)
    p.set_defaults(handler=cmd_eval)


def cmd_eval(args) -> int:
    from ..errors import ModelError
    from ..nn import build_model, parse_mode
    from ..nn.compare import evaluate

    if not (args.text or args.tokens):
        raise ModelError("eval: give --text FILE or --tokens FILE")
    mode = parse_mode(args.mode)
    model = build_model(args.checkpoint, mode=mode, original=args.original, backend=backends_for([mode]),
                        keep_decoded=args.keep_decoded)  # local batches; vocabulary size for the ids
    ids, source = token_ids(args, int(model.config.vocab_size))
    build = {"checkpoint": str(args.checkpoint), "mode": str(mode), "original": args.original,
             "backend": backends_for([mode]), "keep_decoded": args.keep_decoded}
    res = {"checkpoint": str(args.checkpoint), "input": source,
           **evaluate(model, ids, mode, batch=args.batch, progress=progress_enabled(args), executor=args.executor,
                      build=build)}
    if args.json:
        write_json(res, args.json)
    if args.json != "-":
        print(f"{res['checkpoint']}: mode {res['mode']}, {res['sequences']} sequences, {res['tokens']} predicted "
              f"tokens: perplexity {res['perplexity']:.6g}")
    return 0
