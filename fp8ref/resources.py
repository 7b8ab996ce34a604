"""Where fp8ref's declarative files live. ``specs/`` sits at the repository root; the package reaches
it through the ``fp8ref/specs`` symlink, which wheels turn into real files."""

from pathlib import Path

SPECS_DIR = Path(__file__).resolve().parent / "specs"
