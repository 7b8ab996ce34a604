"""io.atomic: complete or absent under signals, kills, full disks and concurrent writers; the
output's permissions follow the umask."""

import errno
import os
import signal
import stat
import subprocess
import sys
import textwrap

import pytest

from fp8ref.errors import CheckpointError, Fp8RefWarning, GoldenError
from fp8ref.io import atomic
from fp8ref.io.atomic import atomic_file, atomic_folder, remove_stale
from fp8ref.io.outputs import MARKER
from tests.support.cli import run_cli

TINY = "tests/golden/data/tiny.yaml"


def _leftovers(folder):
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGHUP"])
@pytest.mark.parametrize("kind", ["folder", "file"])
def test_sigterm_and_sighup_during_a_write_leave_nothing(tmp_path, sig, kind):
    """The signal arrives while the temporary holds 1 MB: the process exits 128+signal and
    nothing is left beside the destination. The signal starts at its default action (a runner
    started under ``nohup`` passes SIGHUP ignored, which fp8ref keeps: the next test)."""
    script = textwrap.dedent(f"""
        import os, signal
        from pathlib import Path
        from fp8ref.io.atomic import atomic_file, atomic_folder
        signal.signal(signal.{sig}, signal.SIG_DFL)
        dest = Path({str(tmp_path / 'out')!r})
        ctx = atomic_folder(dest) if {kind!r} == "folder" else atomic_file(dest)
        with ctx as tmp:
            (tmp / "shard" if {kind!r} == "folder" else tmp).write_bytes(b"x" * 2**20)
            os.kill(os.getpid(), signal.{sig})
            raise AssertionError("not reached")
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 128 + getattr(signal, sig), proc.stderr
    assert list(tmp_path.iterdir()) == []


def test_an_ignored_sighup_stays_ignored(tmp_path):
    """``nohup``: fp8ref does not turn an ignored SIGHUP into an exit."""
    old = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        with atomic_folder(tmp_path / "out") as tmp:
            assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
            assert signal.getsignal(signal.SIGTERM) is atomic._raise_exit
            (tmp / "f").write_text("x")
    finally:
        signal.signal(signal.SIGHUP, old)
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    assert (tmp_path / "out" / "f").read_text() == "x"


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_killed_runs_partial_is_removed_by_the_next_run_with_a_warning(tmp_path):
    """SIGKILL cannot be handled: the next write beside the same output removes what the dead
    process left (named for this host and its pid), and says so; a live process's is kept."""
    dead = tmp_path / f".out.fp8ref-{atomic._HOST}-{_dead_pid()}.abc123.partial"
    dead.mkdir()
    (dead / "model.safetensors").write_bytes(b"x" * 1000)
    dead_file = tmp_path / f".out.fp8ref-{atomic._HOST}-{_dead_pid()}.q1w2.tmp"
    dead_file.write_bytes(b"half")
    live = tmp_path / f".out.fp8ref-{atomic._HOST}-{os.getpid()}.zzz.partial"
    live.mkdir()
    other_host = tmp_path / f".out.fp8ref-00000000-{_dead_pid()}.yyy.partial"
    other_host.mkdir()
    foreign = tmp_path / ".out.something.partial"
    foreign.mkdir()
    with pytest.warns(Fp8RefWarning, match=r"removed the partial output of an earlier run") as caught:
        with atomic_folder(tmp_path / "out") as tmp:
            (tmp / "f").write_text("x")
    assert len(caught) == 2
    assert not dead.exists() and not dead_file.exists()
    assert live.exists() and other_host.exists() and foreign.exists()
    assert remove_stale(tmp_path / "out") == []


def test_the_cli_prints_the_stale_partial_warning_as_one_line(tmp_path, capsys):
    (tmp_path / f".g.fp8ref-{atomic._HOST}-{_dead_pid()}.abc.partial").mkdir()
    assert run_cli("golden", "generate", TINY, "-o", tmp_path / "g", "--quiet") == 0
    err = capsys.readouterr().err
    assert err.startswith("fp8ref: warning: ") and err.count("\n") == 1 and "removed the partial output" in err
    assert _leftovers(tmp_path) == []


@pytest.mark.parametrize("atomic_rename", [True, False], ids=["renameat2", "check-then-rename"])
@pytest.mark.parametrize("appears", ["folder", "empty-folder", "file"])
def test_an_output_that_appears_meanwhile_is_not_replaced(tmp_path, monkeypatch, atomic_rename, appears):
    """Two runs write one output without force: the one finishing second fails, the first's
    output stays (``os.rename`` alone would silently replace an empty folder)."""
    if not atomic_rename:
        monkeypatch.setattr(atomic, "_RENAMEAT2", None)
    dest = tmp_path / "out"
    with pytest.raises(CheckpointError, match="appeared while this output was being written"):
        with atomic_folder(dest) as tmp:
            (tmp / "mine").write_text("second")
            if appears == "file":
                dest.write_text("first")
            else:
                dest.mkdir()
                if appears == "folder":
                    (dest / "theirs").write_text("first")
    if appears == "file":
        assert dest.read_text() == "first"
    else:
        assert sorted(p.name for p in dest.iterdir()) == ([] if appears == "empty-folder" else ["theirs"])
    assert _leftovers(tmp_path) == []


def test_two_concurrent_cli_exports_of_one_output(tmp_path, monkeypatch, capsys):
    """Both start before either finishes (simulated: the second runs inside the first, before its
    rename): the second finds the first's lock and fails at once with a clear error; the first's
    output is complete. (Separate processes: tests/hostile/test_data_loss.py.)"""
    real = atomic._install
    state = {"nested": None}

    def install(tmp, dest, replace, error):
        if state["nested"] is None:
            state["nested"] = run_cli("golden", "generate", TINY, "-o", dest, "--quiet")
        real(tmp, dest, replace, error)

    monkeypatch.setattr(atomic, "_install", install)
    assert run_cli("golden", "generate", TINY, "-o", tmp_path / "g", "--quiet") == 0
    assert state["nested"] == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "another fp8ref run is writing this output now" in err
    assert run_cli("golden", "verify", tmp_path / "g", "--quiet") == 0
    assert _leftovers(tmp_path) == []


def test_force_replaces_and_restores_on_failure(tmp_path, monkeypatch):
    dest = tmp_path / "out"
    with atomic_folder(dest) as tmp:
        (tmp / "old").write_text("old")
    with atomic_folder(dest, force=True) as tmp:
        (tmp / "new").write_text("new")
    assert sorted(p.name for p in dest.iterdir()) == [MARKER, "new"]

    def fail(src, dst):
        raise OSError(errno.EIO, "I/O error", str(src))

    monkeypatch.setattr(atomic, "rename_noreplace", fail)
    with pytest.raises(OSError):
        with atomic_folder(dest, force=True) as tmp:
            (tmp / "newer").write_text("x")
    assert sorted(p.name for p in dest.iterdir()) == [MARKER, "new"]
    assert _leftovers(tmp_path) == []


def test_golden_generate_on_a_full_disk_leaves_no_folder(tmp_path, monkeypatch):
    from fp8ref.golden import folder, generate, load_suite

    calls = {"n": 0}
    real = folder.write_bytes

    def full_disk(path, data):
        calls["n"] += 1
        if calls["n"] == 3:
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        real(path, data)

    monkeypatch.setattr(folder, "write_bytes", full_disk)
    with pytest.raises(OSError, match="No space left"):
        generate(load_suite(TINY), tmp_path / "g")
    assert list(tmp_path.iterdir()) == []


def test_golden_generate_refuses_a_non_empty_folder_and_force_replaces_only_its_own(tmp_path, capsys):
    out = tmp_path / "g"
    out.mkdir()
    (out / "x").write_text("x")
    assert run_cli("golden", "generate", TINY, "-o", out, "--quiet") == 1
    assert "--force" in capsys.readouterr().err
    assert run_cli("golden", "generate", TINY, "-o", out, "--quiet", "--force") == 1
    assert "fp8ref did not write it" in capsys.readouterr().err and (out / "x").read_text() == "x"
    (out / "x").unlink()
    assert run_cli("golden", "generate", TINY, "-o", out, "--quiet") == 0  # an empty folder is replaced
    assert run_cli("golden", "generate", TINY, "-o", out, "--quiet", "--force") == 0
    assert run_cli("golden", "verify", out, "--quiet") == 0
    with pytest.raises(GoldenError):
        from fp8ref.golden import generate, load_suite

        generate(load_suite(TINY), out)


def test_outputs_follow_the_umask(tmp_path):
    old = os.umask(0o022)
    try:
        with atomic_folder(tmp_path / "out") as tmp:
            with atomic_file(tmp / "config.json") as f:
                f.write_text("{}")
        with atomic_file(tmp_path / "plain.json") as f:
            f.write_text("{}")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "out").stat().st_mode) == 0o755
    assert stat.S_IMODE((tmp_path / "out" / "config.json").stat().st_mode) == 0o644
    assert stat.S_IMODE((tmp_path / "plain.json").stat().st_mode) == 0o644
