"""Hostile corpus, issue #10 item 13 (reading side): /dev/zero, FIFOs and folders given as spec,
calibration, suite, names, index or outputs files hung or exhausted memory. fp8ref.io reads only
regular files (opened non-blocking, checked with fstat) and never past a size limit."""

from __future__ import annotations

import os
import time

import pytest

from fp8ref.cli import main
from fp8ref.errors import CheckpointError, SpecError
from fp8ref.io import files
from fp8ref.io.safetensors import SafetensorsFile
from fp8ref.io.yaml import load_yaml
from tests.support.checkpoint_builders import build_ct, write

pytestmark = pytest.mark.skipif(not hasattr(os, "mkfifo") or not os.path.exists("/dev/zero"),
                                reason="needs FIFOs and /dev/zero")


@pytest.fixture
def specials(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    folder = tmp_path / "folder"
    folder.mkdir()
    return {"/dev/zero": ("/dev/zero", "a device"), "fifo": (str(fifo), "a FIFO"),
            "folder": (str(folder), "a folder")}


KINDS = ["/dev/zero", "fifo", "folder"]


def _quick(fn, *args):
    start = time.perf_counter()
    out = fn(*args)
    assert time.perf_counter() - start < 5
    return out


@pytest.mark.parametrize("kind", KINDS)
def test_io_refuses_what_is_not_a_regular_file(specials, kind):
    path, what = specials[kind]
    for read in (lambda: files.read_text(path, error=SpecError), lambda: files.read_json(path, "config"),
                 lambda: files.read_bytes(path, error=CheckpointError), lambda: load_yaml(path),
                 lambda: SafetensorsFile(path)):
        with pytest.raises((SpecError, CheckpointError), match=f"^{path}: cannot read .*: {what}, expected a "
                                                               f"regular file$"):
            _quick(read)


def test_reads_stop_at_the_limit(tmp_path):
    big = tmp_path / "big.yaml"
    big.write_bytes(b"#" * 2000)
    with pytest.raises(SpecError, match="is more than the 1000 bytes fp8ref reads"):
        files.read_text(big, error=SpecError, limit=1000)
    assert files.read_text(big, error=SpecError, limit=2000) == "#" * 2000
    assert files.read_bytes("/proc/self/status", error=SpecError).startswith(b"Name:")  # stat says 0 bytes


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("command", ["spec validate", "spec show", "spec show --layers", "quantize --spec",
                                     "quantize --calibration", "golden generate", "golden check --outputs"])
def test_commands_refuse_special_files_quickly(specials, kind, command, tmp_path, capsys):
    path, what = specials[kind]
    spec = tmp_path / "spec.yaml"
    spec.write_text("scheme: FP8_DYNAMIC\n")
    src = write(tmp_path / "src", *build_ct("FP8"))
    argv = {"spec validate": ["spec", "validate", path], "spec show": ["spec", "show", path],
            "spec show --layers": ["spec", "show", str(spec), "--layers", path],
            "quantize --spec": ["quantize", str(src), str(tmp_path / "out"), "--spec", path],
            "quantize --calibration": ["quantize", str(src), str(tmp_path / "out"), "--spec", str(spec),
                                       "--calibration", path],
            "golden generate": ["golden", "generate", path, "-o", str(tmp_path / "g")],
            "golden check --outputs": ["golden", "check", str(tmp_path / "g"), "--outputs", path]}[command]
    if command == "golden check --outputs":
        assert main(["golden", "generate", "formats", "-o", str(tmp_path / "g"), "--quiet"]) == 0
        capsys.readouterr()
    assert _quick(main, argv) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and path in err, err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("kind", ["fifo", "folder"])
def test_an_index_or_shard_that_is_not_a_regular_file(tmp_path, kind):
    tensors, cfg = build_ct("FP8")
    folder = write(tmp_path / "ckpt", tensors, cfg, shards=2)
    index = folder / "model.safetensors.index.json"
    index.unlink()
    os.mkfifo(index) if kind == "fifo" else index.mkdir()
    from fp8ref.checkpoint import load_checkpoint

    with pytest.raises(CheckpointError, match=f"{index}: cannot read index: a"):
        _quick(load_checkpoint, folder)
