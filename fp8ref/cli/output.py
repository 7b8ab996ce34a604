"""What every command does the same way: warning lines, the progress flags and bars."""

from __future__ import annotations

import argparse
import sys


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
    text; a path writes it there (atomically) beside the text."""
    p.add_argument("--json", metavar="OUT", help=f"write {what} as JSON to OUT ('-': stdout, instead of the text)")


def emit_json(target: str | None, obj, *, indent: int = 2, sort_keys: bool = False) -> bool:
    """Write ``obj`` for ``--json``; True when stdout now holds JSON (so no text may follow there)."""
    if not target:
        return False
    import json

    text = json.dumps(obj, indent=indent, sort_keys=sort_keys) + "\n"
    if str(target) == "-":
        sys.stdout.write(text)
        return True
    from ..io.files import write_bytes

    write_bytes(target, text.encode())
    return False


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
    from ..errors import GoldenError
    from ..golden.accumulation import check_name

    try:
        check_name(args.accumulation)
    except GoldenError as exc:
        print(f"{prog}: error: --accumulation: {str(exc).removeprefix('accumulation: ')}", file=sys.stderr)
        return True
    return False
