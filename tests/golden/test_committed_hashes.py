"""Golden folders are byte-identical on every machine: the tiny suite's and the shipped degenerate
and block-scaled suites' folders are generated and their files' sha256 compared with the ones
committed in data/tiny.sha256, data/degenerate.sha256 and data/block-scaled.sha256 (written once;
a change of any byte, on any machine, with or without the C loops, fails here).

To re-derive after an intended change of bytes: ``python tests/golden/test_committed_hashes.py``.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fp8ref import _native
from fp8ref.golden import generate, load_suite

DATA = Path(__file__).parent / "data"
SUITES = {"tiny": str(DATA / "tiny.yaml"), "degenerate": "degenerate",  # name -> path or shipped name
          "block-scaled": "block-scaled"}


def folder_hashes(out: Path, suite: str = "tiny") -> dict[str, str]:
    """sha256 of every file of a freshly generated folder of ``suite``; MANIFEST.json with the
    fp8ref version blanked (the only field that may change without a change of bytes)."""
    generate(load_suite(SUITES[suite]), out)
    manifest = json.loads((out / "MANIFEST.json").read_bytes())
    assert manifest["fp8ref_version"]
    manifest["fp8ref_version"] = "-"
    hashes = {"MANIFEST.json (version blanked)": hashlib.sha256(json.dumps(manifest, sort_keys=True).encode())
              .hexdigest()}
    hashes.update(manifest["files"])
    for name, digest in manifest["files"].items():
        assert hashlib.sha256((out / name).read_bytes()).hexdigest() == digest, name
    return hashes


def committed(suite: str = "tiny") -> dict[str, str]:
    text = (DATA / f"{suite}.sha256").read_text()
    lines = [line.split(None, 1) for line in text.splitlines() if line and not line.startswith("#")]
    return {name: digest for digest, name in lines}


@pytest.mark.parametrize("suite", sorted(SUITES))
def test_suite_bytes_match_the_committed_sha256(tmp_path, suite):
    assert folder_hashes(tmp_path / "g", suite) == committed(suite)


def test_and_so_do_the_numpy_paths(tmp_path):
    """FP8REF_NO_KERNELS=1 in a fresh process: the numpy paths write the same bytes."""
    if not _native.kernels_available():
        pytest.skip("the C loops are not built: the test above already ran the numpy paths")
    code = (f"import json, pathlib, sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
            f"from test_committed_hashes import SUITES, folder_hashes; "
            f"print(json.dumps({{s: folder_hashes(pathlib.Path({str(tmp_path)!r}) / s, s) for s in SUITES}}))")
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True,
                          env={**os.environ, "FP8REF_NO_KERNELS": "1", "PYTHONPATH": str(root)})
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == {s: committed(s) for s in SUITES}


if __name__ == "__main__":
    import tempfile

    for name in sys.argv[1:] or sorted(SUITES):
        with tempfile.TemporaryDirectory() as tmp:
            hashes = folder_hashes(Path(tmp) / "g", name)
        (DATA / f"{name}.sha256").write_text(
            f"# sha256 of the {name} suite's golden folder (tests/golden/test_committed_hashes.py)\n"
            + "".join(f"{d}  {n}\n" for n, d in sorted(hashes.items())))
    sys.exit(0)
