"""The one way tests run the command line: in process, through ``fp8ref.cli.main`` exactly as
the ``fp8ref`` command does (an Fp8RefError prints one line ``fp8ref: error: ...`` on stderr
and exits 1; argparse errors raise SystemExit 2). Read the output with pytest's capsys."""

from __future__ import annotations

from fp8ref.cli import main


def run_cli(*argv) -> int:
    return main([str(a) for a in argv])
