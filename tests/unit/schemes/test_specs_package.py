"""specs/ stays at the repository's top and installs as the package data fp8ref/specs.

setup.py's own build_py and sdist run on a copy of the source tree (they write egg-info beside
setup.py: never into the checkout); no C is compiled. The installed tree is then imported in a fresh
interpreter to see that the registry finds its specs through importlib.resources, not the checkout.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from fp8ref import registry

ROOT = Path(__file__).resolve().parents[3]
SPECS = sorted(p.relative_to(ROOT / "specs") for p in (ROOT / "specs").rglob("*.yaml"))


@pytest.fixture(scope="module")
def source_copy(tmp_path_factory) -> Path:
    """The files setup.py packages, copied (symlinks kept as symlinks) without build outputs."""
    if not (ROOT / "setup.py").is_file():
        pytest.skip("not a source tree")
    src = tmp_path_factory.mktemp("src")
    for name in ("setup.py", "pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.so", "*.egg-info")
    for name in ("fp8ref", "specs"):
        shutil.copytree(ROOT / name, src / name, symlinks=True, ignore=ignore)
    return src


def setup_py(src: Path, *args: str) -> None:
    run = subprocess.run([sys.executable, "setup.py", "-q", *args], cwd=src, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]


def test_the_checkout_reads_its_top_level_specs():
    assert not (ROOT / "fp8ref" / "specs").exists(), "fp8ref/specs must not exist in the repository"
    assert registry.SPECS_DIR == ROOT / "specs"
    assert "fp8ref" in registry.recipe_names() and SPECS


def test_the_installed_package_holds_the_specs_and_reads_them(source_copy, tmp_path):
    lib = tmp_path / "lib"
    setup_py(source_copy, "build_py", "--build-lib", str(lib))
    installed = lib / "fp8ref" / "specs"
    got = sorted(p.relative_to(installed) for p in installed.rglob("*") if p.suffix == ".yaml")
    assert got == SPECS
    for rel in SPECS:
        path = installed / rel
        assert not path.is_symlink() and path.read_bytes() == (ROOT / "specs" / rel).read_bytes()
    probe = ("from fp8ref import registry; print(registry.SPECS_DIR); "
             "print(len(registry.load_recipes()), len(registry.suite_names()))")
    run = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(lib)})
    assert run.returncode == 0, run.stderr[-3000:]
    where, counts = run.stdout.splitlines()
    assert Path(where) == installed
    assert counts == f"{len(registry.load_recipes())} {len(registry.suite_names())}"


def test_the_sdist_holds_specs_at_its_top(source_copy, tmp_path):
    setup_py(source_copy, "sdist", "--formats=gztar", "--dist-dir", str(tmp_path))
    (archive,) = tmp_path.glob("fp8ref-*.tar.gz")
    with tarfile.open(archive) as tar:
        members = tar.getmembers()
    top = members[0].name.split("/")[0]
    assert not [m.name for m in members if m.issym() or m.islnk()]
    names = {m.name for m in members}
    assert {f"{top}/specs/{rel}" for rel in SPECS} <= names
    assert not [n for n in names if n.startswith(f"{top}/fp8ref/specs")]
    assert f"{top}/fp8ref/_csrc/quant.c" in names
