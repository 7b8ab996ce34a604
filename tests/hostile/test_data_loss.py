"""Issue #25 items 1, 2 and 6 from outside: real ``fp8ref`` processes, killed by SIGTERM/SIGHUP in
the middle of their work, racing each other into one output folder, and writing JSON through a
link to their own stdout. Not marked ``hostile``: it runs by default (its subprocesses are the
point, and they are few).

Each killed process is slowed at a known point (a wrapper around one function: it calls the real
one, says it is there by creating READY, then sleeps), so the signal arrives mid-work on every
run, never by luck of timing."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from fp8ref.golden import verify

ROOT = Path(__file__).resolve().parents[2]
CKPTS = ROOT / "tests" / "fixtures" / "interop" / "checkpoints"
MICRO = "suite: micro\nseed: 7\nlevel: 1\noperations:\n  - op: decode\n    formats: [float8_e4m3fn]\n"


def _env(tmp_path: Path) -> dict:
    (tmp_path / "tmp").mkdir(exist_ok=True)
    return {**os.environ, "PYTHONPATH": str(ROOT), "TMPDIR": str(tmp_path / "tmp")}


def _fp8ref(tmp_path: Path, argv: list, *, slow: str | None = None, pause: float = 60.0) -> subprocess.Popen:
    """``fp8ref ARGV`` in a new process (cwd ``tmp_path``); with ``slow="module:Owner.attr"`` that
    function, after its first real call, creates ``tmp_path/READY`` and sleeps ``pause`` s."""
    patch = ""
    if slow:
        module, attr = slow.split(":")
        owner, _, name = attr.rpartition(".")
        patch = textwrap.dedent(f"""
            import importlib, time
            from pathlib import Path
            owner = importlib.import_module({module!r})
            for part in {owner!r}.split(".") if {owner!r} else []:
                owner = getattr(owner, part)
            real = getattr(owner, {name!r})
            def slowed(*a, **k):
                out = real(*a, **k)
                Path({str(tmp_path / "READY")!r}).touch()
                time.sleep({pause!r})
                return out
            setattr(owner, {name!r}, slowed)
        """)
    script = patch + f"import sys\nfrom fp8ref.cli import main\nsys.exit(main({[str(a) for a in argv]!r}))\n"
    return subprocess.Popen([sys.executable, "-c", script], cwd=tmp_path, env=_env(tmp_path),
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=_default_signals)


def _default_signals() -> None:
    """In the child: SIGTERM/SIGHUP at their defaults, whatever the test run inherited (under
    ``nohup`` SIGHUP is ignored, and fp8ref rightly leaves an ignored signal alone)."""
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)


def _wait_ready(proc: subprocess.Popen, ready: Path, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not ready.exists():
        if proc.poll() is not None:
            pytest.fail(f"ended before it was ready: rc {proc.returncode}: {proc.stderr.read()}")
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail("never became ready")
        time.sleep(0.05)


def _sha256s(root: Path) -> dict[str, str]:
    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.rglob("*")) if p.is_file()}


CASES = {  # command -> (argv, the function to pause in, signal)
    "compare": (["compare", "ckpt", "--random", "1x4", "--quiet"], "fp8ref.io.spill:SpillStore.append", "SIGTERM"),
    "convert": (["convert", "ckpt", "out", "--format", "hf-fp8", "--quiet"],
                "fp8ref.io.safetensors:SafetensorsWriter.write", "SIGHUP"),
    "quantize": (["quantize", "orig", "out", "--spec", "spec.yaml", "--quiet"],
                 "fp8ref.io.safetensors:SafetensorsWriter.write", "SIGTERM"),
    "golden generate": (["golden", "generate", "micro.yaml", "-o", "out", "--quiet"],
                        "fp8ref.golden.folder:write_bytes", "SIGTERM"),
}


@pytest.mark.parametrize("command", list(CASES))
def test_a_signal_mid_work_removes_spill_folders_and_partial_outputs(tmp_path, command):
    argv, slow, sig = CASES[command]
    if command == "compare":
        pytest.importorskip("transformers")  # compare builds the model with transformers
    shutil.copytree(CKPTS / "llmc_fp8", tmp_path / "ckpt")
    shutil.copytree(CKPTS / "original_bf16", tmp_path / "orig")
    (tmp_path / "spec.yaml").write_text("scheme: FP8_DYNAMIC\nignore: [lm_head]\n")
    (tmp_path / "micro.yaml").write_text(MICRO)
    inputs = _sha256s(tmp_path)
    (tmp_path / "tmp").mkdir()
    proc = _fp8ref(tmp_path, argv, slow=slow)
    _wait_ready(proc, tmp_path / "READY")
    if command == "compare":
        assert any(p.name.startswith("fp8ref-spill-") for p in (tmp_path / "tmp").iterdir())
    else:
        assert any(p.name.startswith(".out.fp8ref-") for p in tmp_path.iterdir())  # the partial, the lock
    proc.send_signal(getattr(signal, sig))
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + getattr(signal, sig), err
    assert err == f"fp8ref: terminated by {sig}\n"
    assert not [p for p in (tmp_path / "tmp").iterdir() if p.name.startswith("fp8ref-")]  # no spill folder
    (tmp_path / "READY").unlink()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "micro.yaml", "orig", "spec.yaml", "tmp"]
    shutil.rmtree(tmp_path / "tmp")  # torch's own caches
    assert _sha256s(tmp_path) == inputs


def test_concurrent_writers_into_one_folder_exactly_one_succeeds(tmp_path):
    """Five tries of two ``golden generate`` into one OUT (absent, then an empty folder made
    beforehand: the case where both used to succeed). Each writes slowly (0.3 s per file), so the
    two runs overlap."""
    (tmp_path / "micro.yaml").write_text(MICRO)
    for attempt in range(5):
        out = tmp_path / f"out{attempt}"
        if attempt >= 2:
            out.mkdir()
        procs = [_fp8ref(tmp_path, ["golden", "generate", "micro.yaml", "-o", out.name, "--quiet"],
                         slow="fp8ref.golden.folder:write_bytes", pause=0.3) for _ in range(2)]
        results = [(p.wait(timeout=120), p.stderr.read()) for p in procs]
        assert sorted(rc for rc, _ in results) == [0, 1], results
        err = next(e for rc, e in results if rc == 1)
        assert err.count("\n") == 1 and err.startswith(f"fp8ref: error: {out.name}: "), err
        assert "another fp8ref run is writing this output now" in err or "already exists and is not empty" in err
        assert verify(out) == ([], [])  # the winner's folder is whole
        (tmp_path / "READY").unlink(missing_ok=True)
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == ["micro.yaml"] + [f"out{i}" for i in range(5)] + ["tmp"], left


def test_json_through_a_link_to_stdout_writes_into_stdout(tmp_path):
    """``--json /dev/stdout`` style: the link resolves to the process's own stdout (a pipe here,
    then a file the shell redirected it to); the JSON goes there, the text does not, the link stays."""
    link = tmp_path / "stdout"
    link.symlink_to("/proc/self/fd/1")
    proc = _fp8ref(tmp_path, ["formats", "--json", link.name])
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0 and err == "", err
    assert isinstance(json.loads(out), list) and link.is_symlink()
    with open(tmp_path / "report.json", "w") as f:  # fp8ref formats --json report.json > report.json
        rc = subprocess.run([sys.executable, "-m", "fp8ref", "formats", "--json", "report.json"], cwd=tmp_path,
                            env=_env(tmp_path), stdout=f, stderr=subprocess.PIPE, timeout=120).returncode
    assert rc == 0 and isinstance(json.loads((tmp_path / "report.json").read_text()), list)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.json", "stdout", "tmp"]
