"""``fp8ref spec validate`` and ``fp8ref spec show``: check specs and print resolved schemes."""

from __future__ import annotations

import sys
import warnings

from ..checkpoint.plan import linear_layers
from ..errors import SpecError
from ..io.files import read_text
from ..io.safetensors import open_store
from ..scheme import preset_name
from ..spec import LayerConfig, SpecWarning, load_spec
from .output import add_json, declare_paths, emit_json, warn

_COLUMNS = ("layer", "preset", "weight", "w_gran", "act", "a_gran", "dynamic", "scale", "rounding", "recipe")


def register(sub) -> None:
    p = sub.add_parser("spec", help="validate YAML layer specs and show resolved schemes")
    cmds = p.add_subparsers(dest="spec_command", metavar="SUBCOMMAND", required=True)

    v = cmds.add_parser("validate", help="check spec files; one line per error, exit 1 on any error")
    v.add_argument("files", nargs="+", metavar="FILE")
    v.add_argument("--strict", action="store_true", default=None, help="force strict mode")
    add_json(v, "the results")
    declare_paths(v, inputs=("files",), files=("json",))
    v.set_defaults(handler=cmd_validate)

    s = cmds.add_parser("show", help="print the scheme each layer resolves to")
    s.add_argument("file", metavar="FILE")
    src = s.add_mutually_exclusive_group()
    src.add_argument("--layers", metavar="NAMES_FILE", help="file with one layer name per line (# comments)")
    src.add_argument("--checkpoint", metavar="DIR", help="take the layer names from DIR/*.safetensors")
    s.add_argument("--strict", action="store_true", default=None, help="force strict mode")
    add_json(s, "the resolved schemes")
    declare_paths(s, inputs=("file", "layers", "checkpoint"), files=("json",))
    s.set_defaults(handler=cmd_show)


def cmd_validate(args) -> int:
    results = []
    for file in args.files:
        try:
            load_spec(file, strict=args.strict)
            results.append({"file": file, "ok": True, "errors": []})
        except SpecError as exc:
            results.append({"file": file, "ok": False, "errors": getattr(exc, "errors", [str(exc)])})
    if not emit_json(args.json, {"files": results}):
        for r in results:
            if r["ok"]:
                print(f"{r['file']}: ok")
            for line in r["errors"]:
                print(line, file=sys.stderr)
    return 0 if all(r["ok"] for r in results) else 1


def cmd_show(args) -> int:
    config = load_spec(args.file, strict=args.strict)
    if args.layers is None and args.checkpoint is None:
        rows = _rule_rows(config)
    else:
        names = _read_names(args.layers) if args.layers else checkpoint_layer_names(args.checkpoint)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", SpecWarning)
            resolved = config.resolve_all(names)
        for w in caught:
            warn(w.message)
        rows = list(resolved.items())
    if emit_json(args.json, {layer: None if s is None else s.to_dict() for layer, s in rows}):
        return 0
    table = [_COLUMNS] + [_row(layer, s) for layer, s in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(_COLUMNS))]
    for row in table:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
    return 0


def _rule_rows(config: LayerConfig) -> list[tuple]:
    rows = [("(default)", config.default)]
    rows += [(r.selector.text, r.scheme) for r in config.rules]
    return rows + [(f"ignore: {s.text}", None) for s in config.ignore]


def _row(layer: str, s) -> tuple:
    if s is None:
        return (layer, "BF16", "-", "-", "-", "-", "-", "-", "-", "-")
    w_gran = s.weight_granularity + (f" {s.group_size}" if s.weight_granularity in ("group", "tensor_group") else "")
    w_gran += f" {s.block_shape[0]}x{s.block_shape[1]}" if s.block_shape else ""
    if s.quantizes_activations:
        act = s.act_format
        a_gran = s.act_granularity + (f" {s.act_group_size}" if s.act_group_size and s.act_group_size > 0 else "")
        dynamic = "dynamic" if s.act_dynamic else "static"
    else:
        act, a_gran, dynamic = "-", "-", "-"
    return (layer, preset_name(s) or "custom", s.weight_format, w_gran, act, a_gran, dynamic, s.scale_dtype,
            s.rounding + ("" if s.saturate else " nosat"), s.recipe)


def _read_names(path: str) -> list[str]:
    text = read_text(path, error=SpecError, what="layer names")
    names = [line.split("#", 1)[0].strip() for line in text.splitlines()]
    return [n for n in names if n]


def checkpoint_layer_names(directory: str) -> list[str]:
    """The layers ``fp8ref quantize`` would resolve the spec over: export's own list (2-D float
    ``.weight`` modules, embeddings excluded), read from the checkpoint's headers."""
    return linear_layers(open_store(directory))
