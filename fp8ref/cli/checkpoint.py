"""``fp8ref quantize`` (export an FP8 checkpoint), ``fp8ref convert`` (between formats, with the exact
requantization cost), ``fp8ref inspect`` (what a checkpoint holds and, given the original, how far
each layer is from it) and ``fp8ref explain`` (what a serving engine does to it at load)."""

from __future__ import annotations

import math
import sys
from dataclasses import asdict

from ..checkpoint import base as checkpoint_formats
from ..checkpoint import load_checkpoint
from ..checkpoint.convert import convert_checkpoint
from ..checkpoint.engine import TARGETS, explain
from ..checkpoint.export import export_checkpoint
from ..checkpoint.inspect import describe, quantization_error
from .output import add_json, add_progress_flags, declare_paths, emit_json, progress_enabled, warn

FORCE_HELP = "replace OUT if it is an output folder fp8ref wrote (and holds nothing else)"


def register(sub) -> None:
    q = sub.add_parser("quantize", help="write an FP8 checkpoint from an original safetensors checkpoint")
    q.add_argument("source", metavar="SRC", help="original checkpoint: a .safetensors file or a folder")
    q.add_argument("output", metavar="OUT", help="output folder (written atomically)")
    q.add_argument("--spec", required=True, metavar="SPEC.yaml", help="which layers get which scheme/recipe")
    q.add_argument("--format", choices=checkpoint_formats.names(), default="compressed-tensors",
                   help="checkpoint format (default: compressed-tensors)")
    q.add_argument("--calibration", metavar="FILE",
                   help="per-layer activation amax (JSON or safetensors), needed for static inputs")
    q.add_argument("--recipe", help="override every scheme's producer recipe")
    _add_ct_version(q)
    q.add_argument("--force", action="store_true", help=FORCE_HELP)
    q.add_argument("--symlinks-out", action="store_true",
                   help="accept source files that are symlinks out of SRC (a Hugging Face cache snapshot)")
    add_progress_flags(q)
    add_json(q, "a summary")
    declare_paths(q, inputs=("spec", "calibration"), checkpoints=("source",), files=("json",), folders=("output",))
    q.set_defaults(handler=cmd_quantize)

    c = sub.add_parser("convert", help="write a checkpoint in another format: exact where the target holds its "
                                       "numbers, else requantized with the exact cost")
    c.add_argument("source", metavar="SRC", help="quantized checkpoint: a folder or a .safetensors file")
    c.add_argument("output", metavar="OUT", help="output folder (written atomically)")
    c.add_argument("--format", required=True, choices=checkpoint_formats.names(), help="the target format")
    c.add_argument("--exact-only", action="store_true",
                   help="refuse (exit 1, nothing written) if any layer or KV scale would change")
    _add_ct_version(c)
    c.add_argument("--force", action="store_true", help=FORCE_HELP)
    c.add_argument("--symlinks-out", action="store_true",
                   help="accept shard files that are symlinks out of SRC (a Hugging Face cache snapshot)")
    add_progress_flags(c)
    add_json(c, "the per-layer report")
    declare_paths(c, checkpoints=("source",), files=("json",), folders=("output",))
    c.set_defaults(handler=cmd_convert)

    i = sub.add_parser("inspect", help="format, per-layer schemes and scale statistics of a checkpoint")
    i.add_argument("checkpoint", metavar="CKPT", help="checkpoint folder or .safetensors file")
    i.add_argument("--original", metavar="SRC", help="original weights: add per-layer quantization error")
    i.add_argument("--headers-only", action="store_true", help="read headers and config only (no scales)")
    i.add_argument("--executor", choices=("local", "ray"), default="local",
                   help="--original's layers here (default) or as Ray tasks (RAY_ADDRESS, else a local cluster)")
    i.add_argument("--symlinks-out", action="store_true",
                   help="accept shard files that are symlinks out of CKPT (a Hugging Face cache snapshot)")
    add_json(i, "the description")
    declare_paths(i, checkpoints=("checkpoint", "original"), files=("json",))
    i.set_defaults(handler=cmd_inspect)

    e = sub.add_parser("explain", help="the load-time steps a serving engine applies to each layer, and how many "
                                       "codes and values each changes")
    e.add_argument("checkpoint", help="checkpoint folder or .safetensors file")
    e.add_argument("--engine", default="vllm",
                   help="an engine of specs/engines/: vllm (default), sglang, transformers")
    e.add_argument("--target", default=None, choices=TARGETS,
                   help="the device (default: the one most of the engine's steps name: vllm and sglang cuda, "
                        "transformers cpu); hopper and blackwell run the cuda steps and their own (DeepGEMM's "
                        "UE8M0 requantization)")
    add_json(e, "the steps and their effects")
    declare_paths(e, checkpoints=("checkpoint",), files=("json",))
    e.set_defaults(handler=cmd_explain)


def _add_ct_version(p) -> None:
    from ..producers.compressed_tensors import CT_VERSIONS, DEFAULT_CT_VERSION

    p.add_argument("--ct-version", choices=CT_VERSIONS, help="compressed-tensors format: write config.json as that "
                   f"version's writer does (default {DEFAULT_CT_VERSION}, the newest)")


def cmd_quantize(args) -> int:
    out = export_checkpoint(args.source, args.output, args.spec, format=args.format, calibration=args.calibration,
                            recipe=args.recipe, force=args.force, symlinks_out=args.symlinks_out,
                            progress=progress_enabled(args), config_version=args.ct_version)
    ckpt = load_checkpoint(out)
    recorded = checkpoint_formats.recorded_recipes(ckpt.store)
    recipes = {r: sum(v == r for v in recorded.values()) for r in sorted(set(recorded.values()))}
    if not emit_json(args.json, {"output": str(out), "format": ckpt.format, "layers": sorted(ckpt),
                                 "recipes": recipes, "warnings": ckpt.warnings}):
        used = "; ".join(f"recipe {r!r} for {n} layer{'s' if n != 1 else ''}" for r, n in recipes.items())
        print(f"wrote {out}: {ckpt.format}, {len(ckpt)} quantized layer{'s' if len(ckpt) != 1 else ''}"
              f"{'; ' + used if used else ''}")
        for w in ckpt.warnings:
            warn(w)
    return 0


def cmd_convert(args) -> int:
    report = convert_checkpoint(args.source, args.output, format=args.format, exact_only=args.exact_only,
                                force=args.force, progress=progress_enabled(args), symlinks_out=args.symlinks_out,
                                config_version=args.ct_version)
    t = report.totals()
    if emit_json(args.json, _jsonable(report.as_dict())):
        return 0
    out = sys.stdout
    print(f"{report.source} ({report.source_format}) -> {report.output} ({report.format})", file=out)
    for c in report.layers:
        if c.exact:
            print(f"  {c.layer}: exact ({c.target})", file=out)
        else:
            print(f"  {c.layer}: requantized by {c.recipe} ({c.why}): codes changed {c.codes_changed}/{c.elements} "
                  f"({c.codes_share:.2%}), scales changed {c.scales_changed}/{c.scales}"
                  f"{', input scale changed' if c.input_scale_changed else ''}, max |err| {_fmt(c.max_abs_error)}, "
                  f"max rel err {_fmt(c.max_rel_error)}", file=out)
    for k in report.kv:
        state = "exact" if k["exact"] else f"{k['source_value']!r} -> {k['target_value']!r}"
        print(f"  {k['name']} -> {k['target']}: {state}", file=out)
    if report.exact:
        print(f"result: exact; {t['layers']} layers and {len(report.kv)} KV scales hold the source's numbers", file=out)
    else:
        print(f"result: requant cost: {t['requantized_layers']}/{t['layers']} layers requantized, codes changed "
              f"{t['codes_changed']}/{t['elements']} ({t['codes_share']:.2%}), scales changed {t['scales_changed']}/"
              f"{t['scales']}, input scales changed {t['input_scales_changed']}, KV scales changed "
              f"{t['kv_scales_changed']}, max |err| {_fmt(t['max_abs_error'])}, max rel err "
              f"{_fmt(t['max_rel_error'])}", file=out)
    return 0


def _jsonable(v):
    """JSON has no Infinity: an error-free layer's SNR prints as the string "inf"."""
    if isinstance(v, float) and math.isinf(v):
        return "inf" if v > 0 else "-inf"
    if isinstance(v, dict):
        return {k: _jsonable(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_jsonable(x) for x in v]
    return v


def _fmt(v: float) -> str:
    return "inf" if math.isinf(v) else f"{v:.4g}"


def cmd_explain(args) -> int:
    ckpt = load_checkpoint(args.checkpoint)
    meta, steps, effects = explain(ckpt, args.engine, target=args.target)
    if emit_json(args.json, {**meta, "format": ckpt.format,
                             "steps": [asdict(s) for s in steps], "effects": [asdict(e) for e in effects]}):
        return 0
    print(f"{ckpt.path}: {ckpt.format}; {meta['engine']} on {meta['target']} (from source, verified: "
          f"{str(meta['verified']).lower()})")
    for s in steps:
        rows = [e for e in effects if e.step == s.name]
        print(f"{s.name}: {s.summary}")
        if not rows:
            print("  (applies to no layer)")
        for e in rows:
            print(f"  {e.layer}: codes changed {e.codes_changed}/{e.elements}, values changed "
                  f"{e.values_changed}/{e.elements}, max |change| "
                  f"{'n/a' if e.max_abs_change is None else format(e.max_abs_change, '.3g')}; {e.note}")
    return 0


def cmd_inspect(args) -> int:
    ckpt = load_checkpoint(args.checkpoint, check_values=not args.headers_only, symlinks_out=args.symlinks_out)
    info = describe(ckpt, values=not args.headers_only)
    if args.original:
        info["error"] = quantization_error(ckpt, args.original, executor=args.executor)
    if emit_json(args.json, _jsonable(info)):
        return 0
    print(f"{info['path']}: {info['format']}, model dtype {info['dtype']}, {len(info['layers'])} quantized layers, "
          f"{info['unquantized_tensors']} other tensors")
    for name, layer in info["layers"].items():
        ws = layer["weight_scale"]
        line = f"  {name}  {layer['shape']}  {layer['layout']}  scale {ws['dtype']}{ws['shape']}"
        if "min" in ws:
            line += f" [{_fmt(ws['min'])}, {_fmt(ws['max'])}]"
        if "global_scale" in layer:  # nvfp4: a divisor (compressed-tensors) or a multiplier (ModelOpt)
            line += f"  global {layer['global_scale']['meaning']} {_fmt(layer['global_scale']['weight'])}"
        if "input_scale" in layer:
            kind = f"input global {layer['global_scale']['meaning']}" if "global_scale" in layer else "input_scale"
            line += f"  {kind} {_fmt(layer['input_scale'])}"
        print(line)
    if info["kv_scale_values"]:
        print(f"  KV-cache scales ({len(info['kv_scale_values'])}):")
    for name, s in info["kv_scale_values"].items():
        shown = "" if "min" not in s else f" {_fmt(s['min'])}" if s["min"] == s["max"] else \
            f" [{_fmt(s['min'])}, {_fmt(s['max'])}]"
        print(f"    {name}  {s['dtype']}{s['shape']}{shown}")
    if "error" in info:
        print("quantization error vs original (worst first):")
        print(f"  {'layer':<48} {'max_abs':>10} {'rel_rms':>10} {'snr_db':>8}")
        for r in info["error"]:
            print(f"  {r['layer']:<48} {_fmt(r['max_abs']):>10} {_fmt(r['rel_rms']):>10} {_fmt(r['snr_db']):>8}")
    for w in info["warnings"]:
        warn(w)
    return 0
