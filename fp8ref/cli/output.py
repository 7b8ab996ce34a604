"""What every command does the same way: warning lines, the progress flags and bars."""

from __future__ import annotations

import argparse
import json
import os
import sys

from ..checkpoint.loader import files_read
from ..errors import GoldenError
from ..golden.accumulation import check_name
from ..io.atomic import check_output_folder
from ..io.files import json_safe, write_bytes
from ..io.outputs import refuse_overlaps


def warn(text: object) -> None:
    """One ``fp8ref: warning: ...`` line on stderr."""
    print(f"fp8ref: warning: {text}", file=sys.stderr)


def show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """``warnings.showwarning`` for the CLI: a Python warning (fp8ref's or a library's) prints as
    one warning line, without the source line Python would add."""
    warn(message)


def add_progress_flags(p) -> None:
    """``--quiet`` (no bar) and ``--progress`` (bars even when stderr is not a terminal: a log
    file, a CI job); by default a bar only on a terminal."""
    g = p.add_mutually_exclusive_group()
    g.add_argument("--quiet", action="store_true", help="no progress bar")
    g.add_argument("--no-progress", dest="quiet", action="store_true", help=argparse.SUPPRESS)  # old name
    g.add_argument("--progress", action="store_true", help="progress bars even when stderr is not a terminal")


def progress_enabled(args) -> bool:
    return not args.quiet and (args.progress or sys.stderr.isatty())


def progress_bar(enabled: bool, desc: str):
    """A (done, total, name) callback drawing a tqdm bar on stderr, or None."""
    if not enabled:
        return None
    from tqdm import tqdm

    state = {}

    def update(done: int, total: int, name: str) -> None:
        bar = state.get("bar")
        if bar is None:
            bar = state["bar"] = tqdm(total=total, desc=desc, unit="case", file=sys.stderr, leave=False)
        bar.update(done - bar.n)
        if done == total:
            bar.close()

    return update


def add_json(p, what: str = "the result") -> None:
    """``--json OUT``, the same on every command: ``-`` writes the JSON to stdout instead of the
    text; a path writes it there by the output rule (``write_out``) beside the text."""
    p.add_argument("--json", metavar="OUT", help=f"write {what} as JSON to OUT ('-': stdout, instead of the text)")
    p.set_defaults(files_written=("json",))


def declare_paths(p, *, inputs=(), checkpoints=(), files=(), folders=(), into=()) -> None:
    """Name, by argument, what a command reads and writes; ``check_paths`` refuses, before the
    command runs, an output that is or lies inside an input (``io.outputs.refuse_overlaps``).
    ``checkpoints``: inputs read as checkpoints (a file's config.json beside it is read too);
    ``files``: output files (``--json``, ``--html``); ``folders``: output folders, written whole
    (with ``--force``: only one fp8ref wrote); ``into``: folders whose files are written one by one."""
    p.set_defaults(paths_read=tuple(inputs), checkpoints_read=tuple(checkpoints), files_written=tuple(files),
                   folders_written=tuple(folders), folders_written_into=tuple(into))


def _given(args, names) -> list[tuple[str, str]]:
    """(option, path) for each named argument given (a repeated option: each of its values)."""
    out = []
    for name in names:
        value = getattr(args, name, None)
        for v in value if isinstance(value, list) else [value]:
            if v is not None and str(v) != "-":
                out.append((_option(name), str(v)))
    return out


def _option(name: str) -> str:
    return {"source": "SRC", "checkpoint": "CKPT", "output": "OUT", "files": "FILE", "file": "FILE",
            "folder": "FOLDER"}.get(name, "--" + name.replace("_", "-"))


def check_paths(args) -> None:
    """Before a command runs: its outputs checked against its inputs and each other (the output
    rule, ``io.outputs``), and an output folder against ``--force`` (``check_output_folder``)."""
    inputs = _given(args, getattr(args, "paths_read", ()))
    for what, path in _given(args, getattr(args, "checkpoints_read", ())):
        inputs += [(what, p) for p in files_read(path)]
    folders = _given(args, getattr(args, "folders_written", ()))
    refuse_overlaps(inputs=inputs, files=_given(args, getattr(args, "files_written", ())), folders=folders,
                    into=_given(args, getattr(args, "folders_written_into", ())))
    for _, path in folders:
        check_output_folder(path, force=getattr(args, "force", False), protect=[p for _, p in inputs])


def _std_stream(target: str):
    """``sys.stdout``/``sys.stderr`` when ``target`` is the file or pipe it writes to
    (``/dev/stdout``, or the file stdout is redirected to), else None."""
    for stream in (sys.stdout, sys.stderr):
        try:
            if os.path.samestat(os.stat(target), os.fstat(stream.fileno())):
                return stream
        except (OSError, ValueError, AttributeError):  # no such file; a captured stream has no fileno
            continue
    return None


def json_on_stdout(target: str | None) -> bool:
    """Whether ``--json`` goes to stdout (``-``, ``/dev/stdout``): the text report then goes to stderr."""
    return bool(target) and (str(target) == "-" or _std_stream(str(target)) is sys.stdout)


def write_out(target: str, text: str) -> bool:
    """Write an output file by the output rule: ``-`` or the file stdout goes to: stdout (True:
    no text may follow there); else ``io.files.write_bytes`` (atomically into a regular file,
    into a FIFO or a character device; a write error names the file)."""
    stream = sys.stdout if str(target) == "-" else _std_stream(str(target))
    if stream is not None:
        stream.write(text)
        stream.flush()
        return stream is sys.stdout

    write_bytes(target, text.encode("utf-8"))
    return False


def write_json(report: dict, out: str) -> bool:
    """The report to ``out`` by the output rule; True when stdout now holds it."""
    return write_out(out, json.dumps(json_safe(report), indent=1, sort_keys=True) + "\n")


def backends_for(modes) -> dict:
    """The conformance backend of each ``backend:NAME`` mode, loaded."""
    from ..conformance.backend import load_backend  # not at import: `fp8ref --help` stays light

    return {m.arg: load_backend(m.arg) for m in modes if m.kind == "backend"}


def emit_json(target: str | None, obj, *, indent: int = 2, sort_keys: bool = False) -> bool:
    """Write ``obj`` for ``--json``; True when stdout now holds JSON (so no text may follow there)."""
    if not target:
        return False

    return write_out(target, json.dumps(obj, indent=indent, sort_keys=sort_keys) + "\n")


def add_accumulation(p) -> None:
    """``--accumulation MODEL|best`` (golden check, conform): GEMM outputs judged against a named model."""
    p.add_argument("--accumulation", metavar="MODEL", help="judge scaled_mm/linear outputs bit for bit against "
                   "this registered accumulation model (exact, fp32, fp32-limited, hopper-fast-accum, "
                   "hopper-promoted, deepgemm-1x128-128x128, ada-fast-accum, blackwell-fp8, cdna3, ...: "
                   "docs/accumulation.md), re-derived from each case's inputs, and rank every model by the "
                   "elements it explains; 'best': judge against the top-ranked model")


def bad_accumulation(args, prog: str) -> bool:
    """True after printing the one-line usage error of an unknown ``--accumulation`` model (the
    caller exits 2); False when the option is absent or names a registered model or 'best'."""
    if args.accumulation is None:
        return False

    try:
        check_name(args.accumulation)
    except GoldenError as exc:
        print(f"{prog}: error: --accumulation: {str(exc).removeprefix('accumulation: ')}", file=sys.stderr)
        return True
    return False
