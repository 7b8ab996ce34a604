"""``fp8ref compare``: one checkpoint run in several modes (per-layer teacher-forced and
free-running errors, the first divergent layer, end-to-end logit agreement)."""

from __future__ import annotations

from ..checkpoint import load_checkpoint
from ..errors import ModelError
from ..limits import MAX_RANDOM_IDS, MAX_SEQUENCE, int_in
from .argtypes import int_range, random_shape
from .logprobs import add_engine_args, cmd_engine_logprobs
from .output import add_progress_flags, backends_for, declare_paths, progress_enabled, write_json, write_out

INPUT_HELP = ("token ids: --tokens FILE (integer ids, one sequence per line), --text FILE (the checkpoint's "
              "tokenizer.json, or --tokenizer DIR; --byte-tokens: bytes -> ids modulo the vocabulary) or "
              "--random BxT (default 2x16, seed 0)")


def add_input_args(p, *, random: bool = True) -> None:
    g = p.add_mutually_exclusive_group()
    g.add_argument("--tokens", metavar="FILE", help="whitespace-separated token ids, one sequence per line")
    g.add_argument("--text", metavar="FILE", help="UTF-8 text, tokenized by the checkpoint's tokenizer.json "
                                                  "into lm-eval's rolling windows of --seq-len")
    if random:
        g.add_argument("--random", metavar="BxT", type=random_shape,
                       help=f"B random sequences of T ids (seed 0; T <= {MAX_SEQUENCE}, B x T <= {MAX_RANDOM_IDS}); "
                            "the default, 2x16")
    p.add_argument("--seq-len", type=int_range(2, MAX_SEQUENCE), default=128, metavar="T",
                   help=f"--text: ids per window, 2..{MAX_SEQUENCE} (default 128)")
    t = p.add_mutually_exclusive_group()
    t.add_argument("--tokenizer", metavar="DIR", help="--text: the folder whose tokenizer.json to use (default: "
                                                      "the checkpoint's)")
    t.add_argument("--byte-tokens", action="store_true",
                   help="--text: each byte b -> id b %% vocab instead of a tokenizer (compares modes of one "
                        "checkpoint; not comparable to published numbers)")


def register(sub) -> None:
    p = sub.add_parser("compare", help="run a checkpoint's model in several modes and compare them layer by layer",
                       description=f"The first mode is the baseline. Needs transformers (fp8ref[hf]). {INPUT_HELP}.")
    p.add_argument("checkpoint", metavar="CKPT", help="checkpoint folder (config.json + safetensors)")
    p.add_argument("--original", metavar="SRC", help="original (unquantized) weights, for mode 'original'")
    p.add_argument("--modes", help="comma-separated: reference[:ACCUMULATION], producer, original, backend:NAME "
                                   "(default reference,producer)")
    add_input_args(p)
    p.add_argument("--executor", choices=("local", "ray"), default="local",
                   help="teacher-forced layers here (default) or as Ray tasks (RAY_ADDRESS, else a local cluster)")
    add_keep_decoded(p)
    p.add_argument("--json", metavar="OUT", help="write the full report as JSON to OUT ('-': stdout)")
    p.add_argument("--html", metavar="OUT", help="write a self-contained HTML report (needs matplotlib: "
                                                 "fp8ref[report])")
    add_engine_args(p)
    add_progress_flags(p)
    declare_paths(p, inputs=("tokens", "text", "tokenizer", "engine_logprobs"), checkpoints=("checkpoint", "original"),
                  files=("json", "html"))
    p.set_defaults(handler=cmd_compare)


def add_keep_decoded(p) -> None:
    p.add_argument("--keep-decoded", action="store_true",
                   help="each quantized layer keeps its float64 weight between exact forwards (faster on many "
                        "batches; 8 bytes of memory per weight element more); default: only its codes are held "
                        "(1 byte each), decoded on each call of more than 8 rows")


def early_token_ids(args, ckpt):
    """The token ids read before the model is built (a bad --text fails in a second, not after a
    model build), with the vocabulary config.json declares; None when it declares none that
    ``fp8ref.nn.config_check`` would accept (the ids are then read with the built model's)."""
    from ..nn.config_check import BOUNDS

    vocab = ckpt.config.get("vocab_size")
    return token_ids(args, vocab) if int_in(vocab, 1, BOUNDS["vocab_size"]) else None


def token_ids(args, vocab: int):
    """(ids, source, tokenizer): ids a tensor [B, T], or for tokenized text ``nn.tokenizer.Windows``;
    tokenizer what the JSON result names under "tokenizer" (None for --tokens and --random)."""
    from ..nn.tokens import random_tokens, read_tokens, text_tokens

    if not args.text and (args.tokenizer or args.byte_tokens):
        raise ModelError(f"{'--tokenizer' if args.tokenizer else '--byte-tokens'} applies to --text FILE; "
                         f"give --text, or leave it out")
    if args.tokens:
        return read_tokens(args.tokens, vocab), f"tokens {args.tokens}", None
    if args.text and args.byte_tokens:
        return text_tokens(args.text, vocab, args.seq_len), f"text {args.text} (bytes mod {vocab})", \
            f"bytes mod {vocab}"
    if args.text:
        return tokenized_text(args, vocab)
    spec = getattr(args, "random", None) or "2x16"
    return random_tokens(spec, vocab), f"random {spec} (seed 0)", None


def tokenized_text(args, vocab: int):
    from ..nn.tokenizer import has_tokenizer, load_tokenizer, read_text_utf8, text_windows

    text = read_text_utf8(args.text)  # a bad --text file (FIFO, device, not UTF-8) is named first
    folder = args.tokenizer or args.checkpoint
    if not args.tokenizer and not has_tokenizer(folder):
        raise ModelError(f"{folder}: no tokenizer.json for --text; pass --tokenizer DIR (a folder with "
                         f"tokenizer.json) or --byte-tokens (bytes mod the vocabulary)")
    tok = load_tokenizer(folder)
    windows = text_windows(text, tok, vocab, args.seq_len)
    return windows, f"text {args.text} ({tok.describe()}, windows of {args.seq_len})", tok.describe()


def cmd_compare(args) -> int:
    from ..nn import build_model, parse_modes
    from ..nn.compare import compare

    if args.engine_logprobs:
        return cmd_engine_logprobs(args)
    if args.against or args.noise_floor:
        from ..errors import ModelError

        raise ModelError(f"{'--against' if args.against else '--noise-floor'} applies to --engine-logprobs FILE")
    modes = parse_modes(args.modes or "reference,producer")
    if args.html:
        from ..nn.html import _pyplot

        _pyplot()  # a missing matplotlib fails before the model runs
    ckpt = load_checkpoint(args.checkpoint)
    early = early_token_ids(args, ckpt)
    model = build_model(ckpt, mode=modes[0], original=args.original, backend=backends_for(modes),
                        keep_decoded=args.keep_decoded)
    ids, source, tokenizer = early or token_ids(args, int(model.config.vocab_size))
    ids = getattr(ids, "inputs", ids)  # tokenized text: compare runs the windows' inputs
    progress = progress_enabled(args)
    report = compare(model, ids, modes, with_perplexity=bool(args.tokens or args.text), progress=progress,
                     executor=args.executor, checkpoint_path=ckpt.path)
    report = {"checkpoint": str(ckpt.path), "format": ckpt.format, "input": source, "tokenizer": tokenizer,
              **report}
    json_on_stdout = bool(args.json) and write_json(report, args.json)
    if args.html:
        from ..io.files import json_safe
        from ..nn.html import render

        write_out(args.html, render(json_safe(report), ckpt))
    if not json_on_stdout:
        _print_summary(report)
    return 0


def _print_summary(r: dict) -> None:
    print(f"{r['checkpoint']}: {r['format']}, {len(r['layers'])} layers, input {r['input']}, "
          f"baseline {r['baseline']}")
    for mode, e in r["end_to_end"].items():
        ppl = f"  perplexity {e['perplexity']:.4f}" if "perplexity" in e else ""
        if mode == r["baseline"]:
            print(f"  {mode:<16} (baseline){ppl}")
            continue
        first = r["first_divergent"][mode]
        print(f"  {mode:<16} KL {e['kl']:.3e}  top-1 {e['top1_agree']:.4f}  max|diff| {e['max_abs_diff']:.4g}{ppl}  "
              f"first divergent: {first['teacher_forced'] or 'none'} (teacher-forced), "
              f"{first['free_running'] or 'none'} (free-running)")
    for mode in r["modes"][1:]:
        worst = sorted(r["layers"], key=lambda x: -x["teacher_forced"][mode]["rel_rms"])[:3]
        shown = ", ".join(f"{x['name']} {x['teacher_forced'][mode]['rel_rms']:.3g}" for x in worst)
        print(f"  {mode}: worst teacher-forced relative RMS: {shown}")
    groups = r.get("expert_groups") or []
    if groups:
        print("  MoE experts, one line per block (per-expert rows: --json):")
    for g in groups:
        for mode in r["modes"][1:]:
            tf, fr = g["modes"][mode]["teacher_forced"], g["modes"][mode]["free_running"]
            if tf["worst"] is None:
                print(f"    {g['experts']} {mode}: no expert ran")
                continue
            short = "experts." + tf["worst"].rpartition(".experts.")[2]
            print(f"    {g['experts']} ({g['ran']} of {g['projections']} projections ran) {mode}: teacher-forced "
                  f"relative RMS mean {tf['mean_rel_rms']:.3g}, worst {short} {tf['worst_rel_rms']:.3g}; "
                  f"free-running worst {fr['worst_rel_rms']:.3g}, tokens routed otherwise "
                  f"{fr['routed_differ']:.1%}")
