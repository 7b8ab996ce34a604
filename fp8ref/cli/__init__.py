"""The ``fp8ref`` command. Each command lives in its own module exposing ``register(subparsers)``;
handlers return an exit code. Errors fp8ref raises on purpose print as one line, never a traceback."""

from __future__ import annotations

import argparse
import sys

from ..errors import Fp8RefError
from . import checkpoint as checkpoint_cmds
from . import codec_cmds, compare, conform, golden, main_job, probe, verify
from . import eval as eval_cmds
from . import spec as spec_cmds

COMMAND_MODULES = (codec_cmds, spec_cmds, checkpoint_cmds, golden, conform, probe, compare, eval_cmds, verify)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fp8ref", description="Bit-exact FP8 reference. With no command: run the default job.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in COMMAND_MODULES:
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command is None:
            return main_job.run_default()
        return args.handler(args)
    except Fp8RefError as exc:
        print(f"fp8ref: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("fp8ref: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
