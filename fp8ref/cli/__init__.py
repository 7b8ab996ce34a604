"""The ``fp8ref`` command. Each command lives in its own module exposing ``register(subparsers)``;
handlers return an exit code.

``main`` is the one top-level handler: an ``Fp8RefError`` or an ``OSError`` prints as one line
``fp8ref: error: ...`` (exit 1), anything else as one line naming the exception (the traceback
only with ``--debug``), a closed stdout (``fp8ref inspect CKPT | head -1``) ends quietly;
SIGTERM and SIGHUP unwind like Ctrl-C (exit 128 + signal), so temporaries are removed. Before a
command runs, its outputs are checked against its inputs (``output.declare_paths``).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import traceback
import warnings

from .. import __version__
from .._native import describe
from ..errors import Fp8RefError
from ..io.atomic import Terminated, terminating_signals_raise
from . import checkpoint as checkpoint_cmds
from . import codec_cmds, compare, conform, golden, main_job, probe, verify
from . import eval as eval_cmds
from . import spec as spec_cmds
from .output import check_paths, show_warning

COMMAND_MODULES = (codec_cmds, spec_cmds, checkpoint_cmds, golden, conform, probe, compare, eval_cmds, verify)
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE: what a shell tool killed by a closed pipe exits with


def _add_debug(parser: argparse.ArgumentParser) -> None:
    """``--debug`` on every (sub)command, so it works before or after the command name."""
    parser.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                        help="print the traceback of an unexpected error")
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in set(action.choices.values()):
                _add_debug(child)


class _Version(argparse.Action):
    """--version: fp8ref's version, then which loops run (C at which ISA level, or numpy and why)."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest, nargs=0, default=default, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        import torch  # noqa: F401 - the loops' threads are torch's OpenMP team once torch is loaded

        print(f"fp8ref {__version__}\n{describe()}")
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fp8ref", description="Bit-exact FP8 reference. With no command: run the default job.")
    parser.add_argument("--version", action=_Version,
                        help="print the version and which loops run (C at which ISA level, or numpy, and why)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in COMMAND_MODULES:
        module.register(sub)
    _add_debug(parser)
    return parser


def os_error_line(exc: OSError) -> str:
    """``PATH: reason`` for an OSError (``PATH -> PATH2: reason`` for a rename)."""
    reason = exc.strerror or str(exc)
    names = [str(n) for n in (exc.filename, exc.filename2) if n is not None]
    return f"{' -> '.join(names)}: {reason}" if names else reason


def _silence_stdout() -> None:
    """After EPIPE, point stdout at /dev/null so the interpreter's final flush does not complain."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):  # not a real file (captured in tests)
        pass


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    debug = getattr(args, "debug", False)
    with warnings.catch_warnings(), terminating_signals_raise():
        warnings.showwarning = show_warning
        return _run(args, debug)


def _run(args, debug: bool) -> int:
    try:
        if args.command is None:
            code = main_job.run_default()
        else:
            check_paths(args)  # before any work: no output over an input (io.outputs)
            code = args.handler(args)
        sys.stdout.flush()  # a closed pipe shows here, inside the handler, not at interpreter exit
        return code
    except BrokenPipeError:
        _silence_stdout()
        return EXIT_BROKEN_PIPE
    except KeyboardInterrupt:
        print("fp8ref: interrupted", file=sys.stderr)
        return 130
    except Terminated as exc:  # SIGTERM/SIGHUP: unwound like Ctrl-C, temporaries and spill folders removed
        print(f"fp8ref: terminated by {signal.Signals(exc.signum).name}", file=sys.stderr)
        return 128 + exc.signum
    except Exception as exc:  # noqa: BLE001 - the one place anything left becomes one line
        if debug:
            traceback.print_exc()
        if isinstance(exc, Fp8RefError):
            line = str(exc)
        elif isinstance(exc, OSError):
            line = os_error_line(exc)
        else:
            hint = "" if debug else " (rerun with --debug for the traceback)"
            line = f"unexpected {type(exc).__name__}: {exc}{hint}"
        print(f"fp8ref: error: {line}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
