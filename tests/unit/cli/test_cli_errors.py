"""The one top-level handler of the ``fp8ref`` command: whatever goes wrong ends as one line
``fp8ref: error: ...`` with exit 1 (a traceback only with --debug); a closed stdout ends quietly."""

import subprocess
import sys

import pytest

import fp8ref
from fp8ref.cli import codec_cmds
from tests.support.cli import run_cli

TINY = "tests/golden/data/tiny.yaml"


def _one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("fp8ref: error: "), err
    assert "Traceback" not in err
    return lines[0]


def test_version(capsys):
    with pytest.raises(SystemExit) as exc:
        run_cli("--version")
    assert exc.value.code == 0
    first, loops = capsys.readouterr().out.strip().splitlines()
    assert first == f"fp8ref {fp8ref.__version__}"
    info = fp8ref.build_info()
    if info["loops"] == "C":
        assert loops.startswith(f"loops: C, {info['isa']}") and ", ".join(info["levels"]) in loops
    else:
        assert loops == f"loops: numpy ({info['why']})"


def test_version_names_the_numpy_paths_and_why(monkeypatch, capsys):
    monkeypatch.setenv("FP8REF_NO_KERNELS", "1")
    with pytest.raises(SystemExit):
        run_cli("--version")
    assert capsys.readouterr().out.splitlines()[1] == "loops: numpy (FP8REF_NO_KERNELS is set)"


def test_unexpected_exception_is_one_line_and_debug_shows_the_traceback(monkeypatch, capsys):
    def boom(args):
        raise RuntimeError("kaboom")

    monkeypatch.setattr(codec_cmds, "cmd_formats", boom)
    assert run_cli("formats") == 1
    line = _one_error_line(capsys.readouterr().err)
    assert "RuntimeError: kaboom" in line and "--debug" in line
    for argv in (("--debug", "formats"), ("formats", "--debug")):
        assert run_cli(*argv) == 1
        err = capsys.readouterr().err
        assert "Traceback" in err and err.rstrip().splitlines()[-1].startswith("fp8ref: error: ")


def test_recursion_error_is_one_line(monkeypatch, capsys):
    def deep(args):
        return deep(args)

    monkeypatch.setattr(codec_cmds, "cmd_formats", deep)
    assert run_cli("formats") == 1
    assert "RecursionError" in _one_error_line(capsys.readouterr().err)


def test_json_report_into_a_missing_folder_is_one_line(tmp_path, capsys):
    from fp8ref.golden import generate, load_suite
    from fp8ref.io import safetensors as st

    folder = tmp_path / "g"
    generate(load_suite("tests/golden/data/tiny.yaml"), folder)
    st.save(tmp_path / "o.safetensors", st.load(folder / "encode.expected.safetensors"))
    target = tmp_path / "no" / "such" / "report.json"
    assert run_cli("golden", "check", folder, "--outputs", tmp_path / "o.safetensors", "--allow-missing",
                   "--json", target) == 1
    line = _one_error_line(capsys.readouterr().err)
    assert "No such file or directory" in line and str(tmp_path / "no" / "such") in line


def test_output_name_too_long_is_one_line(tmp_path, capsys):
    assert run_cli("golden", "generate", "tests/golden/data/tiny.yaml", "-o", tmp_path / ("x" * 300)) == 1
    assert "too long" in _one_error_line(capsys.readouterr().err)


def test_broken_pipe_in_a_handler_exits_quietly(monkeypatch, capsys):
    def closed(args):
        raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(codec_cmds, "cmd_formats", closed)
    assert run_cli("formats") == 141
    assert capsys.readouterr().err == ""


def test_broken_pipe_from_the_shell_exits_quietly():
    """``fp8ref decode ... | head -1``: the reader goes away; no traceback, no 'Exception ignored'."""
    codes = [str(c) for c in range(256)] * 40
    proc = subprocess.Popen([sys.executable, "-m", "fp8ref", "decode", *codes], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    proc.stdout.read(10)
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 141
    assert err == ""


@pytest.mark.parametrize("err, text", [(28, "No space left on device"), (30, "Read-only file system")])
def test_a_full_or_read_only_disk_is_one_line_and_leaves_nothing(tmp_path, monkeypatch, capsys, err, text):
    import os

    from fp8ref.golden import folder

    def fail(path, data):
        raise OSError(err, os.strerror(err), str(path))

    monkeypatch.setattr(folder, "write_bytes", fail)
    assert run_cli("golden", "generate", TINY, "-o", tmp_path / "g", "--quiet") == 1
    line = _one_error_line(capsys.readouterr().err)
    assert text in line and str(tmp_path) in line
    assert list(tmp_path.iterdir()) == []
