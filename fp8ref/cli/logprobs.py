"""``fp8ref compare CKPT --engine-logprobs FILE``: an engine's prompt logprobs judged against
fp8ref's model, with a noise floor; and ``fp8ref golden generate --model CKPT --tokens FILE``:
fp8ref's own logprobs in the same format (``fp8ref.nn.engine_logprobs``)."""

from __future__ import annotations

import argparse
import json
import math

from .argtypes import int_range


def add_engine_args(p) -> None:
    p.add_argument("--engine-logprobs", metavar="FILE",
                   help="judge an engine's prompt logprobs (OpenAI completions responses made with echo=true, "
                        "logprobs=K: one JSON response, a list, or JSONL) against --against; the token ids come "
                        "from the file")
    p.add_argument("--against", metavar="MODE", help="--engine-logprobs: the mode the engine is judged against "
                                                     "(default reference)")
    p.add_argument("--noise-floor", metavar="MODE",
                   help="--engine-logprobs: the mode judged against --against the same way, as the size of a "
                        "numerics-only difference (default reference:fp32 against reference, else reference; "
                        "'none': skip)")
    p.add_argument("--worst", type=int_range(0, 1000), default=10, metavar="N",
                   help="--engine-logprobs: positions listed, largest KL first (0..1000, default 10)")


def _tokenizer_loader(args):
    def load():
        from ..errors import ModelError
        from ..nn.tokenizer import has_tokenizer, load_tokenizer

        folder = args.tokenizer or args.checkpoint
        if not args.tokenizer and not has_tokenizer(folder):
            raise ModelError(f"{folder}: no tokenizer.json to map the engine's token strings to ids; pass "
                             f"--tokenizer DIR, or ask the engine for ids (vLLM: return_tokens_as_token_ids=true)")
        return load_tokenizer(folder)
    return load


def cmd_engine_logprobs(args) -> int:
    from ..checkpoint import load_checkpoint
    from ..errors import ModelError
    from ..limits import int_in
    from ..nn import build_model, parse_mode
    from ..nn.config_check import BOUNDS
    from ..nn.engine_compare import ModeView, default_noise_floor, judge_engine, judge_modes
    from ..nn.engine_logprobs import read_engine_logprobs
    from .output import backends_for, write_json

    given = [flag for flag, on in (("--tokens", args.tokens), ("--text", args.text), ("--random", args.random),
                                   ("--byte-tokens", args.byte_tokens), ("--modes", args.modes),
                                   ("--html", args.html), ("--executor ray", args.executor != "local")) if on]
    if given:
        raise ModelError(f"compare --engine-logprobs: {given[0]} does not apply (the token ids are the engine's; "
                         f"--against and --noise-floor name the modes)")
    against = parse_mode(args.against or "reference")
    floor = args.noise_floor or default_noise_floor(str(against))
    modes = [against] + ([] if floor == "none" else [parse_mode(floor)])
    if len(modes) == 2 and str(modes[0]) == str(modes[1]):
        raise ModelError(f"--noise-floor {modes[1]}: the same mode as --against; name another, or 'none'")
    ckpt = load_checkpoint(args.checkpoint)
    vocab = ckpt.config.get("vocab_size")
    if not int_in(vocab, 1, BOUNDS["vocab_size"]):
        raise ModelError(f"{ckpt.path}: config.json declares no vocab_size; the engine's token ids need one")
    seqs, tokens = read_engine_logprobs(args.engine_logprobs, vocab=vocab, tokenizer_loader=_tokenizer_loader(args))
    model = build_model(ckpt, mode=modes[0], original=args.original, backend=backends_for(modes),
                        keep_decoded=args.keep_decoded)
    ref = ModeView(model, modes[0], seqs)
    report = judge_engine(seqs, ref, tokens.name, worst=args.worst)
    noise = judge_modes(seqs, ref, ModeView(model, modes[1], seqs)) if len(modes) == 2 else None
    report = {"checkpoint": str(ckpt.path), "format": ckpt.format, "engine_logprobs": str(args.engine_logprobs),
              "tokenizer": tokens.tokenizer.describe() if tokens.tokenizer is not None else None,
              "against": str(against), **report, "noise_floor": noise,
              "kl_over_noise_floor": _ratio(report["overall"]["kl_mean"], noise["kl_mean"]) if noise else None}
    report.update({k: report["overall"][k] for k in ("kl_mean", "top1_agreement", "dnll_mean")})
    if not (args.json and write_json(report, args.json)):
        _print(report)
    return 0


def _ratio(a: float, b: float):
    if b > 0:
        return a / b
    return None if a == 0 else math.inf


def _print(r: dict) -> None:
    o = r["overall"]
    print(f"{r['engine_logprobs']}: {len(r['sequences'])} sequences, {o['positions']} positions, against "
          f"{r['against']} of {r['checkpoint']} ({r['format']})")
    print(f"  engine        KL {o['kl_mean']:.3e} (max {o['kl_max']:.3e})  top-1 {o['top1_agreement']:.4f}  "
          f"|dNLL| {o['dnll_mean']:.3e}")
    n = r["noise_floor"]
    if n:
        ratio = r["kl_over_noise_floor"]
        shown = "n/a (both 0)" if ratio is None else "inf (the floor is 0)" if math.isinf(ratio) else f"{ratio:.3g}x"
        print(f"  noise floor   KL {n['kl_mean']:.3e} (max {n['kl_max']:.3e})  top-1 {n['top1_agreement']:.4f}  "
              f"|dNLL| {n['dnll_mean']:.3e}  ({n['mode']} vs {r['against']}); engine KL / floor: {shown}")
    left = sum(s["top_entries_left_out"] for s in r["sequences"])
    if left:
        unsure = sum(s["top1_uncertain"] for s in r["sequences"])
        print(f"  {left} top entries left out: their strings are several ids alike; {unsure} positions' top-1 "
              f"counts any of those ids (ask the engine for ids: token_id:N)")
    if len(r["sequences"]) > 1:
        for s in r["sequences"]:
            print(f"  {s['sequence']}: KL {s['kl_mean']:.3e}  top-1 {s['top1_agreement']:.4f}  "
                  f"|dNLL| {s['dnll_mean']:.3e}")
    if r["worst"]:
        print("  worst positions (KL):")
    for w in r["worst"]:
        print(f"    {w['sequence']} position {w['position']} token {w['token']!r}: KL {w['kl']:.3e}, logprob "
              f"engine {w['engine_logprob']:.4f} reference {w['reference_logprob']:.4f}, top-1 engine "
              f"{w['engine_top1']!r} reference {w['reference_top1']!r}")


class ModelOutput(argparse.Action):
    """``golden generate --model CKPT``: OUTPUT becomes a file (not a golden folder), so the
    paths the command declares (``output.declare_paths``) switch when the option is parsed
    (argparse sets the defaults first, then runs the actions)."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        namespace.paths_read = ("tokens",)
        namespace.checkpoints_read = ("model", "original")
        namespace.files_written = ("output", "logits")
        namespace.folders_written = ()


def add_golden_model_args(p) -> None:
    p.add_argument("--model", metavar="CKPT", action=ModelOutput,
                   help="instead of a suite: write the checkpoint's per-position top-K logprobs for --tokens, as an "
                        "OpenAI completions response (what compare --engine-logprobs reads) to the file OUTPUT")
    p.add_argument("--tokens", metavar="FILE", help="--model: token ids, one sequence per line")
    p.add_argument("--mode", default="reference", help="--model: the mode (default reference)")
    p.add_argument("--top-k", type=int_range(1, 1024), default=20, metavar="K",
                   help="--model: top entries per position, 1..1024 (default 20; the position's own token is added "
                        "when outside them, as vLLM does)")
    p.add_argument("--original", metavar="SRC", help="--model: original weights, for --mode original")
    p.add_argument("--logits", metavar="OUT", help="--model: also the full logits, bit for bit in the model dtype, "
                                                   "to a safetensors file (tensors 'logits' [B, T, V], 'input_ids')")


def cmd_golden_logprobs(args) -> int:
    from ..checkpoint import load_checkpoint
    from ..errors import ModelError
    from ..nn import build_model, parse_mode
    from ..nn.engine_compare import reference_logprobs
    from ..nn.engine_logprobs import choice, response
    from ..nn.tokens import read_tokens
    from .output import write_out

    if args.suite is not None:
        raise ModelError("golden generate: give a SUITE or --model CKPT, not both")
    if not args.tokens:
        raise ModelError("golden generate --model: give --tokens FILE (token ids, one sequence per line)")
    mode = parse_mode(args.mode)
    ckpt = load_checkpoint(args.model)
    model = build_model(ckpt, mode=mode, original=args.original)
    ids = read_tokens(args.tokens, int(model.config.vocab_size))
    rows, logits = reference_logprobs(model, mode, ids, args.top_k)
    choices = [choice(i, ids[i].numpy(), own, tops) for i, (own, tops) in enumerate(rows)]
    doc = response(choices, f"fp8ref {mode} {ckpt.path}")
    write_out(str(args.output), json.dumps(doc, indent=None) + "\n")
    if args.logits:
        from .._arrays import numpy_of
        from ..io.safetensors import save

        save(args.logits, {"logits": numpy_of(logits), "input_ids": ids.numpy()},
             {"fp8ref_mode": str(mode), "checkpoint": str(ckpt.path)})
    print(f"golden: {len(choices)} sequences of {ids.shape[1]} tokens, top {args.top_k} logprobs of mode {mode} "
          f"-> {args.output}")
    return 0
