"""Runs pytest in a fresh process with fp8ref's pytest plugin active, as a backend project would."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _plugin_args() -> list[str]:
    """Installed fp8ref registers the plugin through its pytest11 entry point; -p would load it twice."""
    from importlib.metadata import entry_points

    installed = any(ep.value == "fp8ref.conformance.pytest_plugin" for ep in entry_points(group="pytest11"))
    return [] if installed else ["-p", "fp8ref.conformance.pytest_plugin"]


def pytest_in(tmp_path, *args):
    (tmp_path / "test_own.py").write_text("def test_own():\n    assert sum([1, 1]) == 2\n")
    env_path = {"PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *_plugin_args(), *args],
                          cwd=tmp_path, capture_output=True, text=True, env={**os.environ, **env_path})
    return proc.returncode, proc.stdout + proc.stderr
