"""The output rule (fp8ref/io/outputs.py, issue #25 items 1 and 2), through the real CLI on small
checkpoints copied into the test's folder: outputs into a FIFO or a character device are written
into and the node stays; a symlink's target is written and the link stays; an output that is an
input, or lies inside one, is refused before any work; ``--force`` replaces only a folder fp8ref
wrote; every refusal is one line naming the path, and every input's sha256 and every
pre-existing file is unchanged. Special files are private nodes made here (``os.mkfifo``,
``os.mknod``), never the machine's own /dev entries."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import stat
import threading
from pathlib import Path

import pytest

from fp8ref.io import outputs
from fp8ref.io.outputs import MARKER
from tests.support.cli import run_cli

CKPTS = Path(__file__).resolve().parents[2] / "fixtures" / "interop" / "checkpoints"
TINY = Path(__file__).resolve().parents[2] / "golden" / "data" / "tiny.yaml"
MICRO = "suite: micro\nseed: 7\nlevel: 1\noperations:\n  - op: decode\n    formats: [float8_e4m3fn]\n"
NULL_DEV, FULL_DEV = os.makedev(1, 3), os.makedev(1, 7)  # the null and full drivers' numbers (Linux)
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="os.mknod of a character device needs root")


def tree_sha256(*roots: Path) -> dict[str, str]:
    """sha256 of every file under ``roots`` (or of a file root), by path."""
    out = {}
    for root in roots:
        for p in sorted([root] if root.is_file() else root.rglob("*")):
            if p.is_file() and not p.is_symlink():
                out[str(p)] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def one_line_error(capsys, *needles: str) -> str:
    err = capsys.readouterr().err
    assert err.startswith("fp8ref: error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err and "unexpected" not in err, err
    for needle in needles:
        assert needle in err, (needle, err)
    return err


@pytest.fixture
def world(tmp_path):
    """A quantized checkpoint, its original weights, a spec and a micro golden suite, all copies."""
    shutil.copytree(CKPTS / "llmc_fp8", tmp_path / "ckpt")
    shutil.copytree(CKPTS / "original_bf16", tmp_path / "orig")
    (tmp_path / "spec.yaml").write_text("scheme: FP8_DYNAMIC\nignore: [lm_head]\n")
    (tmp_path / "micro.yaml").write_text(MICRO)
    return tmp_path


def _reader(path: Path, into: list) -> threading.Thread:
    def read():
        with open(path, "rb") as f:
            into.append(f.read())

    t = threading.Thread(target=read, daemon=True)
    t.start()
    return t


# --- write into a FIFO or a character device; a link's target ---------------------------------
def test_json_into_a_fifo_is_written_into_and_the_fifo_stays(world, capsys):
    fifo = world / "pipe"
    os.mkfifo(fifo)
    got: list[bytes] = []
    reader = _reader(fifo, got)
    before = tree_sha256(world / "ckpt")
    assert run_cli("inspect", world / "ckpt", "--json", fifo) == 0
    reader.join(30)
    assert json.loads(got[0])["format"] == "compressed-tensors"
    assert stat.S_ISFIFO(os.stat(fifo).st_mode) and tree_sha256(world / "ckpt") == before
    assert sorted(p.name for p in world.iterdir()) == ["ckpt", "micro.yaml", "orig", "pipe", "spec.yaml"]


def test_a_fifo_nobody_reads_fails_in_bounded_time_naming_it(world, capsys, monkeypatch):
    monkeypatch.setattr(outputs, "FIFO_WAIT_S", 0.3)
    fifo = world / "pipe"
    os.mkfifo(fifo)
    assert run_cli("formats", "--json", fifo) == 1
    one_line_error(capsys, f"{fifo}: a FIFO that no process opened for reading within 0.3 s")
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)


@needs_root
def test_json_into_a_character_device_is_written_into_and_the_device_stays(world, capsys):
    null = world / "null"
    os.mknod(null, stat.S_IFCHR | 0o666, NULL_DEV)
    assert run_cli("inspect", world / "ckpt", "--json", null) == 0
    assert "compressed-tensors" in capsys.readouterr().out  # the text still goes to stdout
    st = os.stat(null)
    assert stat.S_ISCHR(st.st_mode) and st.st_rdev == NULL_DEV


@needs_root
def test_a_full_device_is_a_one_line_error_naming_it(world, capsys):
    full = world / "full"
    os.mknod(full, stat.S_IFCHR | 0o666, FULL_DEV)
    assert run_cli("formats", "--json", full) == 1
    one_line_error(capsys, f"{full}: cannot write: No space left on device")
    assert stat.S_ISCHR(os.stat(full).st_mode) and os.stat(full).st_rdev == FULL_DEV


def test_json_through_a_symlink_writes_its_target_and_the_link_stays(world, capsys):
    target = world / "reports" / "r.json"
    target.parent.mkdir()
    target.write_text("old")
    link = world / "r.json"
    link.symlink_to(target)
    assert run_cli("formats", "--json", link) == 0
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert isinstance(json.loads(target.read_text()), list)
    assert sorted(p.name for p in target.parent.iterdir()) == ["r.json"]  # no temporary left beside it


def test_a_folder_as_json_output_is_refused(world, capsys):
    assert run_cli("formats", "--json", world / "orig") == 1
    one_line_error(capsys, f"{world / 'orig'}: a folder; an output file must be")


# --- outputs that are inputs ---------------------------------------------------------------------
def _refused_before_work(world, capsys, argv, needle):
    before = tree_sha256(world)
    listing = sorted(str(p) for p in world.rglob("*"))
    assert run_cli(*argv) == 1
    one_line_error(capsys, needle)
    assert tree_sha256(world) == before and sorted(str(p) for p in world.rglob("*")) == listing


def test_convert_json_onto_its_source_weights_is_refused(world, capsys):
    target = world / "ckpt" / "model.safetensors"
    argv = ["convert", world / "ckpt", world / "out", "--format", "hf-fp8", "--json", target]
    _refused_before_work(world, capsys, argv, f"{target}: --json lies inside the input {world / 'ckpt'} (SRC)")


def test_verify_json_inside_the_original_is_refused(world, capsys):
    target = world / "orig" / "x.json"
    _refused_before_work(world, capsys, ["verify", world / "ckpt", "--original", world / "orig", "--json", target],
                         f"{target}: --json lies inside the input {world / 'orig'} (--original)")


def test_inspect_json_onto_the_config_beside_a_file_checkpoint_is_refused(world, capsys):
    target = world / "ckpt" / "config.json"
    _refused_before_work(world, capsys, ["inspect", world / "ckpt" / "model.safetensors", "--json", target],
                         f"{target}: --json is the input")


def test_json_through_a_symlink_onto_an_input_is_refused(world, capsys):
    (world / "sneaky.json").symlink_to(world / "ckpt" / "model.safetensors")
    _refused_before_work(world, capsys, ["inspect", world / "ckpt", "--json", world / "sneaky.json"],
                         f"{world / 'sneaky.json'}: --json lies inside the input")


def test_golden_check_json_onto_the_outputs_under_test_is_refused(world, capsys):
    assert run_cli("golden", "generate", world / "micro.yaml", "-o", world / "g", "--quiet") == 0
    outputs_file = world / "o.safetensors"
    shutil.copy(world / "g" / "decode.expected.safetensors", outputs_file)
    capsys.readouterr()
    _refused_before_work(world, capsys, ["golden", "check", world / "g", "--outputs", outputs_file,
                                         "--json", outputs_file], f"{outputs_file}: --json is the input")


def test_compare_and_eval_outputs_follow_the_rule(world, capsys):
    _refused_before_work(world, capsys, ["compare", world / "ckpt", "--json", world / "ckpt" / "r.json"],
                         "lies inside the input")
    (world / "t.txt").write_text("hello world")
    _refused_before_work(world, capsys, ["eval", world / "ckpt", "--text", world / "t.txt", "--json", world / "t.txt"],
                         f"{world / 't.txt'}: --json is the input {world / 't.txt'} (--text)")
    _refused_before_work(world, capsys, ["compare", world / "ckpt", "--json", world / "r", "--html", world / "r"],
                         "--json and --html name the same file")


def test_quantize_refuses_an_output_holding_its_own_spec_even_with_force(world, capsys):
    (world / "w").mkdir()
    shutil.move(world / "spec.yaml", world / "w" / "s.yaml")
    _refused_before_work(world, capsys, ["quantize", world / "orig", world / "w", "--spec", world / "w" / "s.yaml",
                                         "--force"], f"{world / 'w'}: OUT holds the input {world / 'w' / 's.yaml'}")


def test_golden_generate_refuses_an_output_holding_its_suite(world, capsys):
    (world / "g").mkdir()
    shutil.move(world / "micro.yaml", world / "g" / "s.yaml")
    _refused_before_work(world, capsys, ["golden", "generate", world / "g" / "s.yaml", "-o", world / "g", "--force"],
                         "OUT holds the input")


def test_an_output_folder_inside_the_source_is_refused(world, capsys):
    _refused_before_work(world, capsys, ["convert", world / "ckpt", world / "ckpt" / "out", "--format", "hf-fp8"],
                         "OUT lies inside the input")


# --- --force replaces only what fp8ref wrote -------------------------------------------------------
@pytest.mark.parametrize("force", [False, True])
def test_a_folder_of_user_files_is_never_replaced(world, capsys, force):
    proj = world / "proj"
    (proj / "sub").mkdir(parents=True)
    (proj / "thesis.tex").write_text("\\documentclass{article}")
    (proj / "sub" / "data.csv").write_text("1,2,3\n")
    flag = ["--force"] if force else []
    for argv in (["convert", world / "ckpt", proj, "--format", "hf-fp8", "--quiet"],
                 ["quantize", world / "orig", proj, "--spec", world / "spec.yaml", "--quiet"],
                 ["golden", "generate", world / "micro.yaml", "-o", proj, "--quiet"]):
        _refused_before_work(world, capsys, [*argv, *flag],
                             "fp8ref did not write it" if force else "already exists and is not empty")


def test_force_replaces_an_output_fp8ref_wrote_but_not_a_file_added_to_it(world, capsys):
    out = world / "out"
    argv = ["convert", world / "ckpt", out, "--format", "hf-fp8", "--quiet"]
    assert run_cli(*argv) == 0
    listed = json.loads((out / MARKER).read_text())["files"]
    assert sorted(listed) == sorted(p.name for p in out.iterdir() if p.name != MARKER)
    capsys.readouterr()
    assert run_cli(*argv, "--force") == 0
    (out / "notes.txt").write_text("mine")
    _refused_before_work(world, capsys, [*argv, "--force"], "holds files fp8ref did not write there: notes.txt")
    (out / "notes.txt").unlink()
    (out / MARKER).write_text('{"format": "something else"}')
    _refused_before_work(world, capsys, [*argv, "--force"], f"its {MARKER} is not one fp8ref wrote")


@pytest.mark.parametrize("force", [False, True])
def test_the_current_folder_as_output_is_refused_and_leaves_no_partial(world, capsys, monkeypatch, force):
    out = world / "out"
    assert run_cli("golden", "generate", world / "micro.yaml", "-o", out, "--quiet") == 0  # fp8ref wrote it
    capsys.readouterr()
    monkeypatch.chdir(out)
    flag = ["--force"] if force else []
    _refused_before_work(world, capsys, ["golden", "generate", world / "micro.yaml", "-o", ".", "--quiet", *flag],
                         ".: OUT is the current folder")
    monkeypatch.chdir(world / "orig")
    _refused_before_work(world, capsys, ["convert", world / "ckpt", "..", "--format", "hf-fp8", *flag],
                         "..: OUT is a folder holding the current folder")
    # world's parent holds other tests' folders too: only what this test could have left counts
    left = [*world.rglob("*"), *(p for p in world.parent.iterdir() if world.name in p.name and p != world)]
    assert not any(".partial" in p.name or "fp8ref-lock" in p.name for p in left)


# --- write errors name the output ------------------------------------------------------------------
def test_a_full_disk_while_writing_a_folder_names_the_output_and_leaves_nothing(world, capsys, monkeypatch):
    from fp8ref.io.safetensors import SafetensorsWriter

    class FullDisk:  # the shard file: its header fits, its first tensor does not
        def __init__(self, f):
            self.f = f

        def write(self, data):
            raise OSError(errno.ENOSPC, "No space left on device")  # as a buffered write raises it: no file name

        def __getattr__(self, name):
            return getattr(self.f, name)

    real_init = SafetensorsWriter.__init__

    def init(self, *a, **k):
        real_init(self, *a, **k)
        self._file = FullDisk(self._file)

    monkeypatch.setattr(SafetensorsWriter, "__init__", init)
    before = sorted(p.name for p in world.iterdir())
    assert run_cli("convert", world / "ckpt", world / "out", "--format", "hf-fp8", "--quiet") == 1
    one_line_error(capsys, f"{world / 'out' / 'model.safetensors'}: cannot write: No space left on device")
    assert sorted(p.name for p in world.iterdir()) == before


def test_a_full_disk_while_writing_a_json_file_names_it(world, capsys, monkeypatch):
    real = os.fsync

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    try:
        assert run_cli("formats", "--json", world / "r.json") == 1
    finally:
        monkeypatch.setattr(os, "fsync", real)
    one_line_error(capsys, f"{world / 'r.json'}: cannot write: No space left on device")
    assert sorted(p.name for p in world.iterdir()) == ["ckpt", "micro.yaml", "orig", "spec.yaml"]


# --- the lock -------------------------------------------------------------------------------------
def test_the_folder_lock_refuses_a_second_writer_and_is_removed(tmp_path):
    from fp8ref.errors import OutputError

    dest = tmp_path / "out"
    with outputs.folder_lock(dest):
        assert outputs.lock_path(dest).exists()
        with pytest.raises(OutputError, match="another fp8ref run is writing this output now"):
            with outputs.folder_lock(dest):
                pass
    assert list(tmp_path.iterdir()) == []
    with outputs.folder_lock(dest):  # free again
        pass


@needs_root
def test_a_full_disk_under_compares_spill_folder_names_the_file(tmp_path):
    """numpy says only "N requested and M written"; the error names the spill file and the fix."""
    import numpy as np

    from fp8ref.errors import OutputError
    from fp8ref.io.spill import SpillStore

    with SpillStore(str(tmp_path)) as store:
        first = Path(store._dir.name) / "1.bin"
        os.mknod(first, stat.S_IFCHR | 0o666, FULL_DEV)  # the next spill file is a full disk
        with pytest.raises(OutputError, match=rf"^{first}: cannot write a spilled activation .*point TMPDIR at"):
            store.append("x", np.ones(4096, np.float32))
    assert list(tmp_path.iterdir()) == []
