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
        for x in res["layers"]:
            if "error" in x:
                print(f"{x['name']}: recipe {x['recipe']!r} cannot produce this layer: {x['error']}")
            elif x["code_mismatches"] or x["scale_mismatches"]:
                notes = [x["scale_note"]] if "scale_note" in x else []
                for key in ("input_scale", "global_scale"):
                    if x.get(key, "").startswith("mismatch"):
                        notes.append(f"{key.replace('_', ' ')} {x[key]}")
                codes = f"{x['code_mismatches']}/{x['codes']} codes differ" + (
                    f" (first at {x['first_code_mismatch']})" if x["code_mismatches"] else "")
                scales = f"{x['scale_mismatches']} scales differ" + (  # weight, global and input scales
                    f" (first weight scale at {x['first_scale_mismatch']} of {x['scales']})"
                    if x["first_scale_mismatch"] is not None else "")
                print(f"{x['name']}: recipe {x['recipe']!r}: {codes}, {scales}{''.join('; ' + n for n in notes)}")
        for name in res["unquantized"]["mismatched"]:
            print(f"{name}: unquantized tensor differs from the original")
        static = sum(x.get("input_scale", "").startswith("not") for x in res["layers"])
        note = f"; {static} static input scales not re-derived (give --calibration)" if static else ""
        verdict = "OK" if res["ok"] else f"MISMATCH in {len(res['mismatched_layers'])} layers"
        print(f"{res['checkpoint']}: {len(res['layers'])} layers re-derived with {describe_recipes(res)}, "
              f"{res['unquantized']['checked']} unquantized tensors compared: {verdict}{note}")
    return 0 if res["ok"] else 1


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
            count = "" if len(some) == len(layers) else f" for {len(some)} layers"
            if source == "closest":
                bad = sum(x["code_mismatches"] + x["scale_mismatches"] for x in some)
                parts.append(f"recipe {rec!r}{count}: no known recipe reproduces the bytes, {rec!r} comes "
                             f"closest ({bad} mismatches)")
            else:
                parts.append(f"recipe {rec!r}{count} ({_SOURCES[source]})")
    return "; ".join(parts)
