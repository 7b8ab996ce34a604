"""``fp8ref verify``: was this checkpoint produced faithfully? Every weight code and weight scale
re-derived from the original weights and the producer's recipe; exit 1 on any mismatch."""

from __future__ import annotations

from ..checkpoint import load_calibration, load_checkpoint
from .output import add_progress_flags, declare_paths, progress_enabled, write_json


def register(sub) -> None:
    p = sub.add_parser("verify", help="re-derive a checkpoint's codes and scales from its original weights")
    p.add_argument("checkpoint", metavar="CKPT", help="checkpoint folder or .safetensors file")
    p.add_argument("--original", metavar="SRC", required=True, help="the original (unquantized) weights")
    p.add_argument("--recipe", help="producer recipe to re-derive with (default: the one the checkpoint records, "
                                    "else the first of its format's known recipes that reproduces the bytes)")
    p.add_argument("--calibration", metavar="FILE", help="per-layer activation amax (JSON or safetensors, as "
                                                         "fp8ref quantize takes it): re-derive static input scales")
    p.add_argument("--executor", choices=("local", "ray"), default="local",
                   help="run the layers here (default) or as Ray tasks (RAY_ADDRESS, else a local cluster)")
    p.add_argument("--json", metavar="OUT", help="write the report as JSON to OUT ('-': stdout)")
    add_progress_flags(p)
    declare_paths(p, inputs=("calibration",), checkpoints=("checkpoint", "original"), files=("json",))
    p.set_defaults(handler=cmd_verify)


def cmd_verify(args) -> int:
    from ..nn.verify import verify

    ckpt = load_checkpoint(args.checkpoint)
    cal = load_calibration(args.calibration) if args.calibration else None
    res = verify(ckpt, load_checkpoint(args.original), recipe=args.recipe, calibration=cal,
                 progress=progress_enabled(args), executor=args.executor)
    if not (args.json and write_json(res, args.json)):
        print_report(res)
    return 0 if res["ok"] else 1


def count(n: int, noun: str, plural: str | None = None) -> str:
    """``n`` and ``noun``, singular for one (``1 layer``, ``2 layers``)."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"


def _differ(n: int, noun: str, of: int | None = None) -> str:
    total = "" if of is None else f" of {of}"
    return f"{count(n, noun)}{total} {'differs' if n == 1 else 'differ'}"


def print_report(res: dict) -> None:
    """verify's report: a line per mismatched layer, unquantized tensor and missing original module,
    then the summary."""
    for x in res["layers"]:
        if "error" in x:
            print(f"{x['name']}: recipe {x['recipe']!r} cannot produce this layer: {x['error']}")
        elif x["code_mismatches"] or x["scale_mismatches"]:
            notes = [x["scale_note"]] if "scale_note" in x else []
            for key in ("input_scale", "global_scale"):
                if x.get(key, "").startswith("mismatch"):
                    notes.append(f"{key.replace('_', ' ')} {x[key]}")
            codes = _differ(x["code_mismatches"], "code", x["codes"]) + (
                f" (first at {x['first_code_mismatch']})" if x["code_mismatches"] else "")
            scales = _differ(x["scale_mismatches"], "scale") + (  # weight, global and input scales
                f" (first weight scale at {x['first_scale_mismatch']} of {x['scales']})"
                if x["first_scale_mismatch"] is not None else "")
            print(f"{x['name']}: recipe {x['recipe']!r}: {codes}, {scales}{''.join('; ' + n for n in notes)}")
    plain = res["unquantized"]
    for x in plain["why"]:
        print(f"{x['name']}: unquantized tensor differs from the original: {x['why']}")
    for module, leaves in res["missing_layers"].items():
        print(f"{module}: the original's {', '.join(leaves)} {'is' if len(leaves) == 1 else 'are'} not in the "
              f"checkpoint, neither quantized nor unquantized")
    static = sum(x.get("input_scale", "").startswith("not") for x in res["layers"])
    notes = [f"{count(static, 'static input scale')} not re-derived (give --calibration)"] if static else []
    if plain["cast"]:
        casts = sorted(set(plain["cast"].values()))
        notes.append(f"{count(len(plain['cast']), 'unquantized tensor')} compared as the producer's "
                     f"{' / '.join(casts)}")
    problems = [f"in {count(len(res['mismatched_layers']), 'layer')}"] if res["mismatched_layers"] else []
    if plain["mismatched"]:
        problems.append(_differ(len(plain["mismatched"]), "unquantized tensor"))
    if res["missing_layers"]:
        problems.append(f"{count(len(res['missing_layers']), 'original module')} missing from the checkpoint")
    verdict = "OK" if res["ok"] else "MISMATCH " + ", ".join(problems)
    print(f"{res['checkpoint']}: {count(len(res['layers']), 'layer')} re-derived with {describe_recipes(res)}, "
          f"{count(plain['checked'], 'unquantized tensor')} compared: {verdict}{''.join('; ' + n for n in notes)}")


_SOURCES = {"given": "given", "recorded": "recorded in the checkpoint",
            "discovered": "found among the format's known recipes"}


def describe_recipes(res: dict) -> str:
    """Which recipe(s) verify used and where each came from, for the summary line."""
    layers = res["layers"]
    parts = []
    for rec in res["recipes"]:
        mine = [x for x in layers if x["recipe"] == rec]
        for source in sorted({x["recipe_source"] for x in mine}):
            some = [x for x in mine if x["recipe_source"] == source]
            share = "" if len(some) == len(layers) else f" for {count(len(some), 'layer')}"
            if source == "closest":
                bad = sum(x["code_mismatches"] + x["scale_mismatches"] for x in some)
                parts.append(f"recipe {rec!r}{share}: no known recipe reproduces the bytes, {rec!r} comes "
                             f"closest ({count(bad, 'mismatch', 'mismatches')})")
            else:
                parts.append(f"recipe {rec!r}{share} ({_SOURCES[source]})")
    return "; ".join(parts)
