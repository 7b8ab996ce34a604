"""The hostile-input corpus of issue #10 and the harness that measures how fp8ref handles it.

    python -m tests.hostile.corpus [--quick] [--json OUT] [--family F] [--case GLOB] [--keep DIR] [-v]

Every case is built here, deterministically from ``--seed``, in its own temporary folder: tiny
checkpoints written by the independent safetensors writer below (never fp8ref's: the corpus
judges fp8ref's reader), the committed fixtures of tests/fixtures/interop/checkpoints, YAML
specs, golden folders. Each case runs the ``fp8ref`` CLI either in a forked child of this process
(fp8ref imported once, so thousands of cases stay cheap; the child is killed at the timeout and
a signal exit is seen as a crash) or, where a real process matters (signals, pipes, concurrent
runs), as ``python -m fp8ref`` in a subprocess. Outcomes:

  typed-error     exit 1, stderr exactly one line ``fp8ref: error: ...`` naming the subject
  vague-error     refused without a traceback, but not that one line (or it names nothing)
  traceback       a Python traceback in the output
  hang            still running at the per-case timeout (killed)
  crash           killed by a signal (SIGSEGV, SIGFPE, ...)
  silent          exit 0 where the input must be refused, or a wrong result written quietly
  partial-output  files left next to the output (temporaries, hidden ``.*.partial``, a
                  half-written output) after a refusal, a signal, or a signal and a rerun
  wrong-refusal   a legitimate input refused
  ok              legitimately accepted (or refused as it should be, for cases without a subject)

Prints counts per class and per family; ``--json`` writes every case with its command, class,
and, for tracebacks, the fp8ref frame it came from (the root-cause grouping of the report).
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import random
import re
import shlex
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # judge the fp8ref of this checkout, not whichever one is installed
FIXTURES = ROOT / "tests" / "fixtures" / "interop" / "checkpoints"
CLASSES = ("typed-error", "vague-error", "traceback", "hang", "crash", "silent", "partial-output",
           "wrong-refusal", "ok")
BAD = ("traceback", "hang", "crash", "silent", "partial-output")
ERROR_PREFIX = "fp8ref: error:"


# ---------------------------------------------------------------------------------------------
# An independent safetensors writer and header reader (the corpus must not depend on fp8ref's).

def st_bytes(tensors: dict[str, tuple[str, np.ndarray]], metadata: dict | None = None) -> bytes:
    """safetensors bytes of ``{name: (dtype, array)}``; BF16 arrays are given as float32."""
    header: dict = {"__metadata__": metadata or {"format": "pt"}}
    blobs, offset = [], 0
    for name in sorted(tensors):
        dtype, arr = tensors[name]
        arr = np.ascontiguousarray(arr)
        if dtype == "BF16":
            raw = (arr.astype("<f4").view("<u4") >> 16).astype("<u2").tobytes()
        else:
            raw = arr.tobytes()
        header[name] = {"dtype": dtype, "shape": list(arr.shape), "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    return st_join(json.dumps(header, separators=(",", ":")).encode(), b"".join(blobs))


def st_join(header: bytes, data: bytes) -> bytes:
    header += b" " * (-len(header) % 8)
    return struct.pack("<Q", len(header)) + header + data


def st_split(raw: bytes) -> tuple[bytes, bytes]:
    n = struct.unpack("<Q", raw[:8])[0]
    return raw[8:8 + n], raw[8 + n:]


HUGE = "__5000_DIGITS__"  # json.dumps refuses ints over 4300 digits: put them in as text


def dumps(obj) -> str:
    return json.dumps(obj).replace(f'"{HUGE}"', "9" * 5000)


def st_header(path: Path) -> dict:
    return json.loads(st_split(path.read_bytes())[0])


# ---------------------------------------------------------------------------------------------
# Source material: an original bf16 checkpoint, specs, a golden suite.

HIDDEN, INTER, NLAYERS = 64, 128, 2
PROJ = {"self_attn.q_proj": (HIDDEN, HIDDEN), "self_attn.k_proj": (32, HIDDEN), "self_attn.v_proj": (32, HIDDEN),
        "self_attn.o_proj": (HIDDEN, HIDDEN), "mlp.gate_proj": (INTER, HIDDEN), "mlp.up_proj": (INTER, HIDDEN),
        "mlp.down_proj": (HIDDEN, INTER)}
LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "dtype": "bfloat16", "hidden_size": HIDDEN,
         "intermediate_size": INTER, "num_hidden_layers": NLAYERS, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 32}
SPEC = "name: hostile\nscheme: FP8_DYNAMIC\nignore:\n  - lm_head\n"
SUITE = """suite: hostile
description: a tiny suite for the hostile corpus
seed: 3
level: 1
operations:
  - op: encode
    formats: [float8_e4m3fn]
    rounding: [rne]
    saturate: [true]
    input_dtypes: [float32]
    random: {1: 64, 2: 96}
    exhaustive: {1: [], 2: []}
  - op: decode
    formats: [float8_e4m3fn]
  - op: scaled_mm
    formats: [float8_e4m3fn]
    shapes: {1: [[4, 32, 8]], 2: [[4, 32, 8]]}
    scales: [tensor]
    out_dtypes: [float32]
    accumulate: [exact]
    scale_order: [epilogue]
    bias: [false]
"""


def original_tensors(seed: int = 0, *, scale_rows: int = 1, extra: dict | None = None) -> dict:
    rng = np.random.default_rng(seed)
    t: dict = {"model.embed_tokens.weight": ("BF16", rng.standard_normal((32, HIDDEN)) * 0.02),
               "model.norm.weight": ("BF16", np.ones(HIDDEN)),
               "lm_head.weight": ("BF16", rng.standard_normal((32, HIDDEN)) * 0.02)}
    for i in range(NLAYERS):
        for proj, (o, k) in PROJ.items():
            t[f"model.layers.{i}.{proj}.weight"] = ("BF16", rng.standard_normal((o * scale_rows, k)) * 0.02)
    t.update(extra or {})
    return t


def write_original(folder: Path, *, seed: int = 0, scale_rows: int = 1, extra: dict | None = None,
                   config: dict | None = None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config or LLAMA, indent=1))
    (folder / "model.safetensors").write_bytes(st_bytes(original_tensors(seed, scale_rows=scale_rows, extra=extra)))
    return folder


def copy_fixture(name: str, dest: Path) -> Path:
    shutil.copytree(FIXTURES / name, dest, ignore=shutil.ignore_patterns("reference_outputs.safetensors",
                                                                           "fixture.json"))
    return dest


# ---------------------------------------------------------------------------------------------
# Running one command.

@dataclass
class Outcome:
    rc: int | None = None
    signal: int | None = None
    timed_out: bool = False
    stdout: str = ""
    stderr: str = ""
    seconds: float = 0.0


def _pythonpath() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.pop("FP8REF_DEBUG", None)
    return env


def cli_command(argv: list[str]) -> list[str]:
    return [sys.executable, "-m", "fp8ref", *argv]


def _outcome(returncode: int, out: bytes, err: bytes, timed_out: bool, t0: float) -> Outcome:
    o = Outcome(stdout=_clip(out), stderr=_clip(err), timed_out=timed_out,
                seconds=time.monotonic() - t0)
    if returncode is not None and returncode < 0:
        o.signal = -returncode
    else:
        o.rc = returncode
    return o


def _clip(raw: bytes, head: int = 4000, tail: int = 16000) -> str:
    """The start (where 'Traceback' is) and the end (the exception and its innermost frames)."""
    text = raw.decode(errors="replace")
    return text if len(text) <= head + tail else text[:head] + "\n[...]\n" + text[-tail:]


class ForkRunner:
    """Runs ``fp8ref.cli.main(argv)`` in forked children of a process that imported fp8ref once."""

    def __init__(self, scratch: Path):
        import fp8ref.cli  # noqa: F401 - imported before forking, so each child starts warm
        self.scratch = scratch
        self.n = 0

    def start(self, argv: list[str], cwd: Path) -> tuple[int, Path, Path, float]:
        self.n += 1
        out, err = self.scratch / f"{self.n}.out", self.scratch / f"{self.n}.err"
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # child: never returns
            code = 1
            try:
                fd_out = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                fd_err = os.open(err, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                fd_in = os.open(os.devnull, os.O_RDONLY)
                os.dup2(fd_in, 0)
                os.dup2(fd_out, 1)
                os.dup2(fd_err, 2)
                # streams of their own on fds 1 and 2: the parent's may be another program's (pytest's capture)
                sys.stdout = sys.__stdout__ = open(1, "w", closefd=False)
                sys.stderr = sys.__stderr__ = open(2, "w", closefd=False)
                os.chdir(cwd)
                sys.path.insert(0, str(cwd))  # as `python -m fp8ref` run in cwd (module:object backends)
                _limit_memory()
                from fp8ref.cli import main
                try:
                    code = main(argv)
                except SystemExit as exc:  # as the interpreter turns SystemExit into a status
                    code = exc.code
                    if not isinstance(code, int) and code is not None:
                        print(code, file=sys.stderr)
                        code = 1
                code = 0 if code is None else code
            except BaseException:  # what the interpreter would print
                import traceback
                traceback.print_exc()
                code = 1
            finally:
                try:
                    sys.stdout.flush()
                    sys.stderr.flush()
                finally:
                    os._exit(code if isinstance(code, int) else 1)
        return pid, out, err, time.monotonic()

    @staticmethod
    def finish(pid: int, out: Path, err: Path, t0: float, status: int | None, timed_out: bool) -> Outcome:
        if timed_out:
            os.kill(pid, signal.SIGKILL)
            _, status = os.waitpid(pid, 0)
            o = Outcome(timed_out=True)
        else:
            o = Outcome()
        if os.WIFSIGNALED(status) and not timed_out:
            o.signal = os.WTERMSIG(status)
        elif os.WIFEXITED(status):
            o.rc = os.WEXITSTATUS(status)
        o.stdout, o.stderr = _clip(out.read_bytes()), _clip(err.read_bytes())
        o.seconds = time.monotonic() - t0
        out.unlink()
        err.unlink()
        return o

    def run(self, argv: list[str], cwd: Path, timeout: float) -> Outcome:
        pid, out, err, t0 = self.start(argv, cwd)
        status, timed_out = _wait(pid, t0, timeout)
        return self.finish(pid, out, err, t0, status, timed_out)


def _limit_memory(extra: int = 3 << 30) -> None:
    """Cap the child's address space (a case reading /dev/zero must not take the machine)."""
    import resource
    with open("/proc/self/statm") as f:
        vm = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    resource.setrlimit(resource.RLIMIT_AS, (vm + extra, vm + extra))


class Watch:
    """Decides when a child hangs on a loaded machine: ``limit`` s of CPU (a spinning regex), or
    ``limit`` s asleep without using CPU (a blocking open of a FIFO), or 4 * ``limit`` s of wall
    time. Wall time alone would call a case that waits for a busy core a hang."""

    def __init__(self, pid: int, limit: float):
        self.pid, self.limit, self.t0 = pid, limit, time.monotonic()
        self.cpu, self.since = 0.0, self.t0
        self.tick = os.sysconf("SC_CLK_TCK")

    def expired(self) -> bool:
        now = time.monotonic()
        try:
            with open(f"/proc/{self.pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            return False
        state, cpu = fields[0], (int(fields[11]) + int(fields[12])) / self.tick
        if cpu > self.cpu:
            self.cpu, self.since = cpu, now
        blocked = state in "SD" and now - self.since > self.limit
        return cpu > self.limit or blocked or now - self.t0 > 4 * self.limit


def _wait(pid: int, t0: float, timeout: float) -> tuple[int | None, bool]:
    watch = Watch(pid, timeout)
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return status, False
        if watch.expired():
            return None, True
        time.sleep(0.01)


# ---------------------------------------------------------------------------------------------
# Cases and classification.

@dataclass
class Case:
    """One hostile input. ``setup(dir)`` builds it in its own folder and ``argv`` runs in that folder.

    expect: 'refuse' (must be a typed error), 'accept' (must succeed), 'any' (a byte flip may still
    be a valid file: success is ok, a refusal must be typed). ``names``: one of these must appear
    in the error line (the file, key or tensor). ``check(dir, outcome)`` returns why an accepted
    run is still wrong (a silent wrong result) or None. ``watch``: the output's parent folder,
    relative to the case folder, checked for leftovers; ``keep``: names allowed to be there.
    ``script(dir, ctx)`` replaces argv for multi-step cases (signals, pipes, concurrency)
    and returns (Outcome, leftovers, note).
    """

    family: str
    name: str
    argv: list[str] = field(default_factory=list)
    setup: Callable[[Path], None] | None = None
    expect: str = "refuse"
    names: tuple[str, ...] = ()
    check: Callable[[Path, Outcome], str | None] | None = None
    watch: str | None = None
    keep: tuple[str, ...] = ()
    output: str | None = None
    script: Callable[[Path, Ctx], tuple[Outcome, list[str], str]] | None = None
    item: int | None = None
    timeout: float | None = None
    prefix: str = ERROR_PREFIX  # `spec validate` reports FILE:LINE: ... lines by design
    verdict: str | None = None  # stdout text that is a refusal too (`golden check`'s "result: FAIL")

    @property
    def id(self) -> str:
        return f"{self.family}/{self.name}"

    def command(self) -> str:
        if not self.argv:
            return "(scripted: see tests/hostile/corpus.py)"
        return "fp8ref " + " ".join(shlex.quote(a) for a in self.argv)


@dataclass
class Ctx:
    timeout: float
    rng: random.Random
    forker: ForkRunner


def leftovers(case: Case, d: Path, outcome: Outcome) -> list[str]:
    if case.watch is None:
        return []
    parent = d / case.watch
    if not parent.exists():
        return []
    allowed = set(case.keep)
    if case.output and outcome.rc == 0 and not outcome.timed_out:
        allowed.add(case.output)
    return sorted(p.name for p in parent.iterdir() if p.name not in allowed)


def one_error_line(outcome: Outcome, prefix: str = ERROR_PREFIX) -> str | None:
    """The refusal's line; a validator's report (another prefix, e.g. the file's name) may give one
    line per problem, each with the prefix."""
    lines = [ln for ln in outcome.stderr.splitlines() if ln.strip()]
    one = len(lines) == 1 if prefix == ERROR_PREFIX else bool(lines)
    if outcome.rc == 1 and one and all(ln.startswith(prefix) for ln in lines):
        return lines[0]
    return None


def classify(case: Case, d: Path, o: Outcome, left: list[str]) -> tuple[str, str]:
    """(class, note)."""
    if o.timed_out:
        return "hang", f"killed after {o.seconds:.1f} s (wall)"
    if o.signal:
        return "crash", f"signal {signal.Signals(o.signal).name}"
    if "Traceback (most recent call last)" in o.stdout + o.stderr or "Exception ignored in" in o.stderr:
        return "traceback", last_exception(o.stdout + o.stderr)
    if left:
        return "partial-output", "left: " + ", ".join(left[:5])
    if o.rc == 0:
        if case.expect == "refuse":
            return "silent", "exit 0"
        why = case.check(d, o) if case.check else None
        return ("silent", why) if why else ("ok", "")
    line = one_error_line(o, case.prefix)
    if line is None and case.verdict and o.rc == 1 and case.verdict in o.stdout:
        line = next(ln for ln in o.stdout.splitlines() if case.verdict in ln)
        if case.expect != "accept":
            return "typed-error", line[:200]
    if case.expect == "accept":
        return "wrong-refusal", (line or o.stderr.strip()[-200:])
    if line is None:
        return "vague-error", f"rc={o.rc}: " + " | ".join(o.stderr.strip().splitlines()[-2:])[-200:]
    if line.startswith(ERROR_PREFIX + " unexpected "):  # the CLI's last resort: an exception fp8ref did not expect
        return "vague-error", f"an unexpected exception: {line[:200]}"
    if case.names and not any(n in line for n in case.names):
        return "vague-error", f"names none of {list(case.names)[:3]}: {line[:200]}"
    return "typed-error", line[:200]


_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')


def last_exception(text: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    exc = lines[-1].strip()[:160] if lines else ""
    return f"{exc} @ {origin(text)}"


def origin(text: str) -> str:
    """The innermost traceback frame inside fp8ref/ (the place a fix belongs), as path:line."""
    where = "?"
    for path, line, _func in _FRAME.findall(text):
        p = Path(path)
        if "fp8ref" in p.parts and "tools" not in p.parts:
            rel = p.parts[p.parts.index("fp8ref"):]
            where = f"{'/'.join(rel)}:{line}"
    return where


def run_cases(cases: list[Case], base: Path, *, timeout: float, jobs: int, seed: int, verbose: bool,
              keep: Path | None) -> list[dict]:
    scratch = base / "_io"
    scratch.mkdir()
    forker = ForkRunner(scratch)
    ctx = Ctx(timeout=timeout, rng=random.Random(seed), forker=forker)
    results: list[dict] = []

    def record(case: Case, d: Path, o: Outcome, left: list[str], note: str = "") -> None:
        cls, why = classify(case, d, o, left)
        r = {"id": case.id, "family": case.family, "item": case.item, "class": cls, "note": note or why,
             "why": why, "rc": o.rc, "signal": o.signal, "seconds": round(o.seconds, 2), "command": case.command(),
             "stderr_tail": o.stderr.strip()[-600:]}
        if cls == "traceback":
            r["origin"] = origin(o.stdout + o.stderr)
            r["exception"] = why.split(" @ ")[0]
        results.append(r)
        if verbose:
            print(f"{cls:15s} {case.id:60s} {why[:150]}", flush=True)
        elif len(results) % 500 == 0:
            print(f"hostile: {len(results)} of {len(cases)} cases run", file=sys.stderr, flush=True)
        if keep is None:
            _rmtree(d)

    def prepare(case: Case, i: int) -> Path:
        d = (keep or base) / f"{i:05d}"
        d.mkdir(parents=True)
        if case.setup:
            case.setup(d)
        return d

    simple = [(i, c) for i, c in enumerate(cases) if c.script is None]
    scripted = [(i, c) for i, c in enumerate(cases) if c.script is not None]
    running: list = []
    while simple or running:
        while simple and len(running) < jobs:
            i, case = simple.pop(0)
            d = prepare(case, i)
            started = forker.start(case.argv, d)
            running.append((case, d, started, Watch(started[0], case.timeout or timeout)))
        time.sleep(0.005)
        for entry in list(running):
            case, d, (pid, out, err, t0), watch = entry
            done, status = os.waitpid(pid, os.WNOHANG)
            late = not done and watch.expired()
            if done or late:
                running.remove(entry)
                o = forker.finish(pid, out, err, t0, status if done else None, late)
                record(case, d, o, leftovers(case, d, o))
    for i, case in scripted:
        d = prepare(case, i)
        o, left, note = case.script(d, ctx)
        record(case, d, o, left, note)
    return results


def _rmtree(d: Path) -> None:
    for p in [d, *d.rglob("*")]:  # read-only folders made by a case
        try:
            if p.is_dir() and not p.is_symlink():
                p.chmod(0o755)
        except OSError:
            pass
    shutil.rmtree(d, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# The corpus. Each family returns its cases; ``quick`` keeps a few of each.

FIXTURE_NAMES = ("llmc_fp8", "llmc_fp8_block", "llmc_fp8_dynamic", "autoround_fp8_static",
                 "autoround_fp8_static_llmc")
NASTY_REGEX = r"re:([\w.]+)+!"
BIG = 18446744073709551616  # 2**64
INSPECT = ["inspect", "ck"]


def fixture_setup(fixture: str, mutate: Callable[[Path], None] | None = None) -> Callable[[Path], None]:
    def setup(d: Path) -> None:
        copy_fixture(fixture, d / "ck")
        if mutate:
            mutate(d / "ck")
    return setup


def calibration_file(amax: dict[str, float]) -> Callable[[Path], None]:
    """Setup writing a valid cal.json with fp8ref.write_calibration (cases whose fault is elsewhere)."""
    def setup(d: Path) -> None:
        from fp8ref import write_calibration
        write_calibration(d / "cal.json", amax)
    return setup


def files(content: dict[str, str | bytes]) -> Callable[[Path], None]:
    """Setup writing ``{relative path: text or bytes}``."""
    def setup(d: Path) -> None:
        for rel, text in content.items():
            p = d / rel
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_bytes(text if isinstance(text, bytes) else text.encode())
    return setup


def chain(*setups) -> Callable[[Path], None]:
    def setup(d: Path) -> None:
        for s in setups:
            s(d)
    return setup


def quantize_case(family: str, name: str, spec_text: str = SPEC, *, extra_argv=(), expect="refuse", names=(),
                  orig: Callable[[Path], None] | None = None, check=None, item=None, more=None) -> Case:
    """``fp8ref quantize orig out --spec spec.yaml`` with leftovers checked in the case folder."""
    def setup(d: Path) -> None:
        (orig or (lambda p: write_original(p)))(d / "orig")
        (d / "spec.yaml").write_text(spec_text)
        if more:
            more(d)
    return Case(family, name, ["quantize", "orig", "out", "--spec", "spec.yaml", "--no-progress", *extra_argv],
                setup, expect=expect, names=names, check=check, watch=".", output="out", item=item,
                keep=("orig", "spec.yaml", "cal.json", "fifo", "dir", "loop", "passwd"))


# -- mutated safetensors headers -----------------------------------------------------------------

def _json_mutations(h: dict, rng: random.Random) -> list[tuple[str, Callable[[dict], object], bool]]:
    """(name, mutate(header) -> new header or raw bytes, must_refuse)."""
    names = [k for k in h if k != "__metadata__"]
    t = rng.choice(names)
    other = rng.choice([n for n in names if n != t])

    def entry(key, value):
        def f(hd):
            hd[t][key] = value
            return hd
        return f

    def deep(hd):
        return ("[" * 5000 + "]" * 5000).encode()

    def nested_shape(hd):
        hd[t]["shape"] = json.loads("[" * 900 + "1" + "]" * 900)
        return hd

    muts = [
        ("dtype-list", entry("dtype", ["F8_E4M3"])), ("dtype-int", entry("dtype", 8)),
        ("dtype-unknown", entry("dtype", "F7_E3M3")), ("dtype-empty", entry("dtype", "")),
        ("dtype-F64", entry("dtype", "F64")), ("dtype-null", entry("dtype", None)),
        ("shape-huge", entry("shape", [10 ** 400, 1])), ("shape-zero-huge", entry("shape", [0, 10 ** 30])),
        ("shape-negative", entry("shape", [-1, 64])), ("shape-string", entry("shape", "64")),
        ("shape-float", entry("shape", [1.5, 2])), ("shape-bool", entry("shape", [True, 2])),
        ("shape-2^63", entry("shape", [2 ** 63, 1])), ("shape-17-dims", entry("shape", [1] * 17)),
        ("shape-nested", nested_shape),
        ("offsets-reversed", lambda hd: (hd[t].__setitem__("data_offsets", hd[t]["data_offsets"][::-1]), hd)[1]),
        ("offsets-negative", lambda hd: (hd[t].__setitem__("data_offsets", [-8, hd[t]["data_offsets"][1]]), hd)[1]),
        ("offsets-beyond", lambda hd: (hd[t].__setitem__("data_offsets", [0, 10 ** 12]), hd)[1]),
        ("offsets-overlap", lambda hd: (hd[t].__setitem__("data_offsets", list(hd[other]["data_offsets"])), hd)[1]),
        ("offsets-one", entry("data_offsets", [0])), ("offsets-strings", entry("data_offsets", ["0", "8"])),
        ("offsets-huge", entry("data_offsets", [10 ** 400, 10 ** 400 + 1])),
        ("entry-missing-dtype", lambda hd: (hd[t].pop("dtype"), hd)[1]),
        ("entry-missing-shape", lambda hd: (hd[t].pop("shape"), hd)[1]),
        ("entry-unknown-key", entry("pickle", "cos\nsystem\n")),
        ("entry-list", lambda hd: (hd.__setitem__(t, [1, 2]), hd)[1]),
        ("entry-string", lambda hd: (hd.__setitem__(t, "F8_E4M3"), hd)[1]),
        ("name-300-chars", lambda hd: (hd.__setitem__("w" * 300, hd.pop(t)), hd)[1]),
        ("name-empty", lambda hd: (hd.__setitem__("", hd.pop(t)), hd)[1]),
        ("name-nul", lambda hd: (hd.__setitem__(t + "\x00", hd.pop(t)), hd)[1]),
        ("metadata-list", lambda hd: (hd.__setitem__("__metadata__", ["pt"]), hd)[1]),
        ("metadata-nested", lambda hd: (hd.__setitem__("__metadata__", {"format": {"a": [1]}}), hd)[1]),
        ("metadata-int-value", lambda hd: (hd.__setitem__("__metadata__", {"format": 1}), hd)[1]),
        ("header-list", lambda hd: [hd]), ("header-int", lambda hd: HUGE), ("header-deep", deep),
        ("header-empty-object", lambda hd: {}),
        ("duplicate-name", lambda hd: json.dumps(hd)[:-1].encode() + b"," + json.dumps({t: hd[t]})[1:].encode()),
        ("not-utf8", lambda hd: json.dumps(hd).encode().replace(b'"', b'\xff', 1)),
        ("trailing-garbage", lambda hd: json.dumps(hd).encode() + b"}}"),
    ]
    refuse_all = {m[0]: True for m in muts}
    refuse_all["header-empty-object"] = True  # every tensor byte is then unaccounted for
    return [(n, f, refuse_all[n]) for n, f in muts]


def header_cases(quick: bool, rng: random.Random, count: int) -> list[Case]:
    """Each fixture's model.safetensors with its header mutated: every structural JSON mutation
    (half of them in quick mode), header lengths, then seeded byte flips, truncations, hostile JSON
    tokens and extra data up to ``count`` cases in all. A mutation is ``f(raw, header, data) -> bytes``."""
    cases: list[Case] = []
    per = max(1, count // len(FIXTURE_NAMES))
    for fixture in FIXTURE_NAMES:
        raw = (FIXTURES / fixture / "model.safetensors").read_bytes()
        header, data = st_split(raw)
        plan: list[tuple[str, Callable[[bytes, bytes, bytes], bytes], str]] = []
        muts = _json_mutations(json.loads(header), rng)
        for name, mut, _refuse in muts[:len(muts) // 2] if quick else muts:
            def build(_raw, header, data, mut=mut):
                new = mut(json.loads(header))
                return st_join(new if isinstance(new, bytes) else dumps(new).encode(), data)
            plan.append((f"json-{name}", build, "refuse"))
        lengths = (0, 1, 7, 9, len(header) - 1, len(header) + 1, 2 ** 40, 2 ** 64 - 1)
        for n in lengths[::2] if quick else lengths:
            plan.append((f"length-{n}", lambda raw, _h, _d, n=n: struct.pack("<Q", n) + raw[8:], "refuse"))
        for k in range(6 if quick else max(0, per - len(plan))):
            kind = rng.random()
            if kind < 0.55:  # byte flips in the header
                pos = [8 + rng.randrange(len(header)) for _ in range(rng.choice((1, 1, 2, 4)))]
                vals = [rng.randrange(256) for _ in pos]

                def flip(raw, _h, _d, pos=tuple(pos), vals=tuple(vals)):
                    b = bytearray(raw)
                    for p, v in zip(pos, vals):
                        b[p] = v
                    return bytes(b)
                plan.append((f"flip-{k}-at-{pos[0]}", flip, "any"))
            elif kind < 0.75:  # truncations anywhere
                cut = rng.choice((rng.randrange(8), 8 + rng.randrange(len(header)),
                                  8 + len(header) + rng.randrange(max(1, len(data)))))
                plan.append((f"truncate-{k}-at-{cut}", lambda raw, _h, _d, cut=cut: raw[:cut], "refuse"))
            elif kind < 0.9:  # a JSON token replaced by a hostile value
                span = rng.choice(list(re.finditer(rb'-?\d+|"[^"]*"|\[|\{', header))).span()
                val = rng.choice((b'[]', b'{}', b'null', b'-1', b'1e999', b'"x"', b'[[[[[[1]]]]]]', b'true',
                                  b'99999999999999999999999', b'"\\u0000"', b'NaN'))

                def token(_raw, header, data, span=span, val=val):
                    return st_join(header[:span[0]] + val + header[span[1]:], data)
                plan.append((f"token-{k}-at-{span[0]}", token, "any"))
            else:  # data appended: the offsets no longer tile the data
                extra = rng.choice((1, 7, 8, 4096))
                plan.append((f"data-plus-{k}-{extra}", lambda raw, _h, _d, extra=extra: raw + b"\0" * extra, "refuse"))
        for name, build, expect in plan:
            def mutate(ck, build=build, raw=raw, header=header, data=data):
                (ck / "model.safetensors").write_bytes(build(raw, header, data))
            cases.append(Case("headers", f"{fixture}/{name}", INSPECT, fixture_setup(fixture, mutate), expect=expect,
                              names=("model.safetensors",), item=4))
    return cases


# -- mutated configs and indexes ------------------------------------------------------------------

HOSTILE_VALUES = {"list": [1], "dict": {"a": 1}, "str": "8", "neg": -1, "null": None, "huge": HUGE,
                  "float": 1e308, "bool": True, "deep": json.loads("[" * 200 + "]" * 200)}


def _leaves(obj, path=()):
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _leaves(v, (*path, k))
    elif isinstance(obj, list) and obj and not all(isinstance(v, (int, float, str)) for v in obj):
        for i, v in enumerate(obj):
            yield from _leaves(v, (*path, i))
    else:
        yield path


def _set(obj, path, value):
    for k in path[:-1]:
        obj = obj[k]
    obj[path[-1]] = value


def _qc_file(fixture: str) -> str:
    return "quantization_config.json" if (FIXTURES / fixture / "quantization_config.json").exists() else "config.json"


def config_cases(quick: bool, rng: random.Random) -> list[Case]:
    cases: list[Case] = []
    for fixture in FIXTURE_NAMES:
        qfile = _qc_file(fixture)
        cfg = json.loads((FIXTURES / fixture / qfile).read_text())
        root = ("quantization_config",) if qfile == "config.json" else ()
        base = cfg
        for k in root:
            base = base[k]
        paths = [(*root, *p) for p in _leaves(base)]
        combos = [(p, v) for p in paths for v in HOSTILE_VALUES]
        rng.shuffle(combos)
        for path, vname in combos[:6 if quick else 60]:
            def mutate(ck, path=path, vname=vname, qfile=qfile):
                c = json.loads((ck / qfile).read_text())
                _set(c, path, HOSTILE_VALUES[vname])
                (ck / qfile).write_text(dumps(c))
            key = ".".join(map(str, path))
            cases.append(Case("configs", f"{fixture}/{key}={vname}", INSPECT, fixture_setup(fixture, mutate),
                              expect="any", names=(qfile, path[-1] if isinstance(path[-1], str) else qfile)))
        for name, text in (("not-json", "{"), ("deep-nesting", "[" * 100000 + "]" * 100000), ("list", "[1]"),
                           ("nul", '{"a\x00": 1}'), ("empty", ""), ("huge-int", "1" * 5000)):
            cases.append(Case("configs", f"{fixture}/{qfile}-{name}", INSPECT,
                              fixture_setup(fixture, lambda ck, text=text, qfile=qfile: (ck / qfile).write_text(text)),
                              names=(qfile,), item=4))
    # the named cases of item 4
    ct = "llmc_fp8"
    for name, path, value in (("quant_method-list", ("quantization_config", "quant_method"), ["compressed-tensors"]),
                              ("format-list", ("quantization_config", "format"), ["float-quantized"]),
                              ("ignore-ints", ("quantization_config", "ignore"), [1, 2])):
        def m(ck, path=path, value=value):
            c = json.loads((ck / "config.json").read_text())
            _set(c, path, value)
            (ck / "config.json").write_text(json.dumps(c))
        cases.append(Case("configs", f"item4/{name}", INSPECT, fixture_setup(ct, m), names=("config.json",), item=4))
    for name, key, value in (("bits-string", "bits", "8"), ("bits-huge", "bits", 10 ** 30),
                             ("group_size-2^64", "group_size", BIG), ("quant_method-list", "quant_method", ["a"]),
                             ("modules_to_not_convert-ints", "modules_to_not_convert", [1])):
        def m(ck, key=key, value=value):
            c = json.loads((ck / "quantization_config.json").read_text())
            c[key] = value
            (ck / "quantization_config.json").write_text(json.dumps(c))
        cases.append(Case("configs", f"item4/autoround-{name}", INSPECT, fixture_setup("autoround_fp8_static", m),
                          names=("quantization_config.json",), item=4))
    cases += index_cases(quick)
    return cases


def shard(ck: Path, n: int = 2, names: list[str] | None = None) -> dict:
    """Split ck/model.safetensors into ``n`` shards plus an index (bytes copied, not re-encoded)."""
    header, data = st_split((ck / "model.safetensors").read_bytes())
    hd = json.loads(header)
    meta = hd.pop("__metadata__", None)
    tensors = sorted(hd)
    names = names or [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    weight_map = {}
    for i, fname in enumerate(names):
        part, off, blobs = {"__metadata__": meta or {"format": "pt"}}, 0, []
        for t in tensors[i::n]:
            b, e = hd[t]["data_offsets"]
            blobs.append(data[b:e])
            part[t] = {**hd[t], "data_offsets": [off, off + e - b]}
            off += e - b
            weight_map[t] = fname
        (ck / fname).write_bytes(st_join(json.dumps(part).encode(), b"".join(blobs)))
    (ck / "model.safetensors").unlink()
    index = {"metadata": {"total_size": len(data)}, "weight_map": weight_map}
    (ck / "model.safetensors.index.json").write_text(json.dumps(index))
    return index


def index_cases(quick: bool) -> list[Case]:
    idx = "model.safetensors.index.json"

    def edit(f):
        def mutate(ck):
            index = shard(ck)
            out = f(index, ck)
            (ck / idx).write_text(out if isinstance(out, str) else json.dumps(out))
        return mutate

    def first(index):
        return sorted(index["weight_map"])[0]

    def drop_shard(index, ck):  # item 8: a whole shard omitted
        gone = sorted(set(index["weight_map"].values()))[-1]
        index["weight_map"] = {k: v for k, v in index["weight_map"].items() if v != gone}
        return index

    def long_name(index, ck):
        t = first(index)
        name = "m" * 300 + ".safetensors"
        index["weight_map"][t] = name
        return index

    muts = {
        "omits-a-shard": (drop_shard, 8), "weight_map-empty": (lambda i, ck: {"weight_map": {}}, 8),
        "shard-name-list": (lambda i, ck: (i["weight_map"].__setitem__(first(i), ["a"]), i)[1], 4),
        "shard-name-int": (lambda i, ck: (i["weight_map"].__setitem__(first(i), 1), i)[1], 4),
        "shard-name-300-chars": (long_name, 4),
        "shard-missing-file": (lambda i, ck: (i["weight_map"].__setitem__(first(i), "nope.safetensors"), i)[1], 8),
        "shard-escapes": (lambda i, ck: (i["weight_map"].__setitem__(first(i), "../../x.safetensors"), i)[1], 7),
        "shard-absolute": (lambda i, ck: (i["weight_map"].__setitem__(first(i), "/etc/passwd"), i)[1], 7),
        "weight_map-list": (lambda i, ck: {"weight_map": [1]}, 4), "not-json": (lambda i, ck: "{", 4),
        "deep": (lambda i, ck: '{"weight_map": ' + "[" * 100000 + "]" * 100000 + "}", 4),
        "tensor-twice": (lambda i, ck: json.dumps(i)[:-2] + ', "' + first(i) + '": "x.safetensors"}}', 4),
        "names-absent-tensor": (lambda i, ck: (i["weight_map"].__setitem__("ghost.weight", sorted(
            set(i["weight_map"].values()))[0]), i)[1], 8),
    }
    cases = []
    for name, (f, item) in muts.items():
        cases.append(Case("indexes", name, INSPECT, fixture_setup("llmc_fp8", edit(f)), names=(idx,), item=item))
    return cases


# -- YAML specs ----------------------------------------------------------------------------------

YAML_BODIES = {
    "nested-1000": "name: x\nscheme: FP8_DYNAMIC\nignore: " + "[" * 1000 + "]" * 1000 + "\n",
    "nested-100000": "name: x\nscheme: " + "[" * 100000 + "]" * 100000 + "\n",
    "recursive-alias": "name: x\nscheme: &a [*a]\n",
    "recursive-alias-map": "name: &a {b: *a}\nscheme: FP8_DYNAMIC\n",
    "alias-bomb": "a: &a [x,x,x,x,x,x,x,x,x]\nb: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a]\nc: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b]\n"
                  "d: &d [*c,*c,*c,*c,*c,*c,*c,*c,*c]\ne: &e [*d,*d,*d,*d,*d,*d,*d,*d,*d]\n"
                  "f: &f [*e,*e,*e,*e,*e,*e,*e,*e,*e]\ng: [*f,*f,*f,*f,*f,*f,*f,*f,*f]\n",
    "int-5000-digits": "name: x\nscheme: FP8_DYNAMIC\nlayer_config:\n  lm_head: {scheme: FP8_DYNAMIC, group_size: "
                       + "9" * 5000 + "}\n",
    "nul-byte": "name: x\x00\nscheme: FP8_DYNAMIC\n",
    "tag-python": "name: !!python/object/apply:os.system [echo pwned]\nscheme: FP8_DYNAMIC\n",
    "tag-custom": "name: !custom x\nscheme: FP8_DYNAMIC\n",
    "tag-binary": "name: !!binary aGVsbG8=\nscheme: FP8_DYNAMIC\n",
    "duplicate-key": "name: x\nscheme: FP8_DYNAMIC\nscheme: FP8_BLOCK\n",
    "not-utf8": b"name: \xff\xfe\nscheme: FP8_DYNAMIC\n",
    "empty": "",
    "top-level-list": "- 1\n",
    "int-keys": "name: x\nscheme: FP8_DYNAMIC\nlayer_config:\n  1: FP8\n",
    "merge-key": "name: x\nscheme: FP8_DYNAMIC\nlayer_config:\n  <<: {a: 1}\n",
    "scheme-list": "name: x\nscheme: [FP8_DYNAMIC]\n",
    "ignore-ints": "name: x\nscheme: FP8_DYNAMIC\nignore: [1, 2]\n",
    "float-inf": "name: x\nscheme: FP8_DYNAMIC\nlayer_config:\n  lm_head: {scheme: FP8_DYNAMIC, group_size: .inf}\n",
    "bom-and-tabs": "\ufeffname:\tx\n",
}


def yaml_cases(quick: bool) -> list[Case]:
    cases = []
    for name, body in YAML_BODIES.items():
        for cmd in (["spec", "validate", "s.yaml"], ["spec", "show", "s.yaml"]):
            cases.append(Case("yaml", f"{cmd[1]}/{name}", cmd, files({"s.yaml": body}), names=("s.yaml",), item=4,
                              prefix="s.yaml" if cmd[1] == "validate" else ERROR_PREFIX))
        cases.append(Case("yaml", f"suite/{name}", ["golden", "list", "s.yaml"], files({"s.yaml": body}),
                          names=("s.yaml",), item=4))
    return cases


# -- item 1: integers that reach the C loops -------------------------------------------------------

def int_spec(field_text: str) -> str:
    return SPEC + f"layer_config:\n  model.layers.0.self_attn.q_proj: {{{field_text}}}\n"


INT_FIELDS = {
    "block_shape-2^64": "scheme: FP8_BLOCK, block_shape: [128, 18446744073709551616]",
    "block_shape-2^63": "scheme: FP8_BLOCK, block_shape: [128, 9223372036854775808]",
    "block_shape-2^32": "scheme: FP8_BLOCK, block_shape: [4294967296, 128]",
    "block_shape-0": "scheme: FP8_BLOCK, block_shape: [0, 128]",
    "block_shape-negative": "scheme: FP8_BLOCK, block_shape: [-128, 128]",
    "group_size-2^64": "scheme: FP8_DYNAMIC, group_size: 18446744073709551616",
    "group_size-2^31": "scheme: FP8_DYNAMIC, group_size: 2147483648",
    "act_group_size-2^64": "scheme: FP8_DYNAMIC, act_group_size: 18446744073709551616",
    "bits-2^64": "scheme: FP8_DYNAMIC, bits: 18446744073709551616",
}


def int_cases(quick: bool) -> list[Case]:
    cases = []
    for name, text in INT_FIELDS.items():
        spec = int_spec(text)
        cases.append(Case("item01-integers", f"validate/{name}", ["spec", "validate", "s.yaml"],
                          files({"s.yaml": spec}), names=("s.yaml",), item=1, prefix="s.yaml"))
        cases.append(quantize_case("item01-integers", f"quantize/{name}", spec, names=("spec.yaml",), item=1))
    return cases


# -- item 2: golden folders -----------------------------------------------------------------------

def golden_cases(quick: bool, golden: Path) -> list[Case]:
    def setup(edit):
        def s(d: Path) -> None:
            shutil.copytree(golden / "g", d / "g")
            shutil.copy(golden / "outputs.safetensors", d / "outputs.safetensors")
            shutil.copy(golden / "outputs.safetensors", d / "ro.safetensors")
            m = json.loads((d / "g" / "MANIFEST.json").read_text())
            out = edit(m, d / "g")
            if out is not None:
                (d / "g" / "MANIFEST.json").write_text(out if isinstance(out, str) else json.dumps(m, indent=1))
            if isinstance(out, dict) and isinstance(out.get("cases"), list):  # a backend that ran what is listed
                listed = {c.get("name") for c in out["cases"] if isinstance(c, dict)}
                _filter_tensors(d / "outputs.safetensors", lambda name: name.split("/")[0] in listed)
        return s

    def drop(op):
        def e(m, g):
            m["cases"] = [c for c in m["cases"] if c["op"] != op]
            return m
        return e

    def drop_one(m, g):
        m["cases"] = m["cases"][1:]
        return m

    def orphan(m, g):  # a tensor no case names, added to a file whose sha is updated to match
        import hashlib
        p = g / "decode.inputs.safetensors"
        header, data = st_split(p.read_bytes())
        hd = json.loads(header)
        hd["orphan/x"] = {"dtype": "U8", "shape": [1], "data_offsets": [len(data), len(data) + 1]}
        p.write_bytes(st_join(json.dumps(hd).encode(), data + b"\x01"))
        key = next(k for k in m["files"] if k.startswith("decode.inputs"))
        m["files"][key] = hashlib.sha256(p.read_bytes()).hexdigest()
        return m

    edits = {
        "drop-scaled_mm": (drop("scaled_mm"), 2), "drop-encode": (drop("encode"), 2), "drop-first-case": (drop_one, 2),
        "cases-empty": (lambda m, g: (m.__setitem__("cases", []), m)[1], 2),
        "level-changed": (lambda m, g: (m.__setitem__("level", 2), m)[1], 2),
        "suite_file-escapes": (lambda m, g: (m.__setitem__("suite_file", "../../../../etc/passwd"), m)[1], 2),
        "suite_file-absolute": (lambda m, g: (m.__setitem__("suite_file", "/etc/passwd"), m)[1], 2),
        "orphan-tensor": (orphan, 2),
        "sha-changed": (lambda m, g: (m["files"].__setitem__(sorted(m["files"])[0], "0" * 64), m)[1], 2),
        "file-deleted": (lambda m, g: (g / sorted(m["files"])[0]).unlink(), 2),
        "manifest-not-json": (lambda m, g: "{", 4), "manifest-deep": (lambda m, g: "[" * 100000 + "]" * 100000, 4),
        "cases-dict": (lambda m, g: (m.__setitem__("cases", {"a": 1}), m)[1], 4),
        "case-op-list": (lambda m, g: (m["cases"][0].__setitem__("op", ["encode"]), m)[1], 4),
        "seed-huge": (lambda m, g: dumps({**m, "seed": HUGE}), 4),
        "files-list": (lambda m, g: (m.__setitem__("files", ["a"]), m)[1], 4),
    }
    cases = []
    for name, (edit, item) in edits.items():
        # reading a suite_file outside the folder is the fault itself: the refusal must name the key
        names = ("suite_file",) if name.startswith("suite_file") else ("g", "MANIFEST.json")
        cases.append(Case("golden", f"verify/{name}", ["golden", "verify", "g", "--quiet"], setup(edit),
                          names=names, item=item, verdict="result: FAIL"))
        if name == "level-changed":  # check judges outputs against the tensors as written; re-deriving is verify's
            continue
        cases.append(Case("golden", f"check/{name}", ["golden", "check", "g", "--outputs", "outputs.safetensors"],
                          setup(edit), names=names, item=item, verdict="result: FAIL"))
    cases.append(Case("golden", "verify/intact", ["golden", "verify", "g", "--quiet"], setup(lambda m, g: None),
                      expect="accept"))
    cases.append(Case("golden", "check/intact", ["golden", "check", "g", "--outputs", "outputs.safetensors"],
                      setup(lambda m, g: None), expect="accept"))
    return cases


def _filter_tensors(path: Path, keep: Callable[[str], bool]) -> None:
    header, data = st_split(path.read_bytes())
    hd, off, blobs = {}, 0, []
    for k, v in json.loads(header).items():
        if k != "__metadata__" and keep(k):
            b, e = v["data_offsets"]
            hd[k] = {**v, "data_offsets": [off, off + e - b]}
            blobs.append(data[b:e])
            off += e - b
    path.write_bytes(st_join(json.dumps(hd).encode(), b"".join(blobs)))


def make_golden(base: Path, forker: ForkRunner, timeout: float) -> Path:
    g = base / "_golden"
    g.mkdir()
    (g / "suite.yaml").write_text(SUITE)
    o = forker.run(["golden", "generate", "suite.yaml", "-o", "g", "--quiet"], g, max(timeout, 60))
    if o.rc != 0:
        raise SystemExit(f"hostile: cannot build the golden folder: {o.stderr.strip()[-500:]}")
    merged: dict = {}
    for p in sorted((g / "g").glob("*.expected.safetensors")):
        header, data = st_split(p.read_bytes())
        for k, v in json.loads(header).items():
            if k != "__metadata__":
                b, e = v["data_offsets"]
                merged[k] = (v, data[b:e])
    hd, off, blobs = {}, 0, []
    for k, (v, raw) in sorted(merged.items()):
        hd[k] = {"dtype": v["dtype"], "shape": v["shape"], "data_offsets": [off, off + len(raw)]}
        blobs.append(raw)
        off += len(raw)
    (g / "outputs.safetensors").write_bytes(st_join(json.dumps(hd).encode(), b"".join(blobs)))
    return g


# -- item 3: catastrophic regexes ------------------------------------------------------------------

def regex_cases(quick: bool) -> list[Case]:
    def ct(key):
        def m(ck):
            c = json.loads((ck / "config.json").read_text())
            qc = c["quantization_config"]
            if key == "ignore":
                qc["ignore"] = [*qc["ignore"], NASTY_REGEX]
            else:
                qc["config_groups"]["group_0"]["targets"] = [NASTY_REGEX]
            (ck / "config.json").write_text(json.dumps(c))
        return m

    def ar(ck):
        c = json.loads((ck / "quantization_config.json").read_text())
        c["extra_config"] = {NASTY_REGEX[3:]: {"bits": 16, "data_type": "float"}}
        (ck / "quantization_config.json").write_text(json.dumps(c))

    spec = SPEC + f"layer_config:\n  '{NASTY_REGEX}': FP8\n"  # single quotes: no YAML escapes
    names = (NASTY_REGEX[3:],)
    cases = [Case("item03-regex", "ct-ignore/inspect", INSPECT, fixture_setup("llmc_fp8", ct("ignore")),
                  expect="any", names=names, item=3),
             Case("item03-regex", "ct-targets/inspect", INSPECT, fixture_setup("llmc_fp8", ct("targets")),
                  expect="any", names=names, item=3),
             Case("item03-regex", "autoround-extra_config/inspect", INSPECT, fixture_setup("autoround_fp8_static", ar),
                  expect="any", names=names, item=3),
             Case("item03-regex", "spec-selector/spec-show", ["spec", "show", "s.yaml", "--checkpoint", "ck"],
                  chain(files({"s.yaml": spec}), fixture_setup("llmc_fp8")), expect="any", names=names, item=3),
             quantize_case("item03-regex", "spec-selector/quantize", spec, expect="any", names=names, item=3)]
    return cases[:3] if quick else cases


# -- items 5-13: checkpoints, export ----------------------------------------------------------------

def _add_tensor(ck: Path, name: str, dtype: str, arr: np.ndarray) -> None:
    header, data = st_split((ck / "model.safetensors").read_bytes())
    hd = json.loads(header)
    raw = arr.tobytes()
    hd[name] = {"dtype": dtype, "shape": list(arr.shape), "data_offsets": [len(data), len(data) + len(raw)]}
    (ck / "model.safetensors").write_bytes(st_join(json.dumps(hd).encode(), data + raw))


def _set_tensor(ck: Path, name: str, values: np.ndarray) -> None:
    raw = bytearray((ck / "model.safetensors").read_bytes())
    header, _ = st_split(bytes(raw))
    e = json.loads(header)[name]
    b = 8 + len(header) + e["data_offsets"][0]
    blob = values.tobytes()
    raw[b:b + len(blob)] = blob
    (ck / "model.safetensors").write_bytes(bytes(raw))


def _scale_dtypes(d: Path, layer: str) -> dict:
    return {k: v["dtype"] for k, v in st_header(d / "out" / "model.safetensors").items()
            if k.startswith(layer) and "scale" in k}


def _want_scale(layer: str, dtype: str):
    def check(d: Path, o: Outcome) -> str | None:
        got = _scale_dtypes(d, layer)
        wrong = {k: v for k, v in got.items() if v != dtype}
        return f"scale_dtype ignored: {wrong}" if wrong else None
    return check


def _perms(d: Path, o: Outcome) -> str | None:
    out = d / "out"
    modes = {p.name: oct(p.stat().st_mode & 0o777) for p in [out, *out.iterdir()]}
    bad = {k: v for k, v in modes.items() if v not in ("0o755", "0o644")}
    return f"modes ignore the umask 022: {bad}" if bad else None


def _no_passwd(d: Path, o: Outcome) -> str | None:
    passwd = Path("/etc/passwd").read_bytes()
    leaked = [p.name for p in (d / "out").rglob("*") if p.is_file() and p.read_bytes() == passwd]
    return f"/etc/passwd copied into the output as {leaked}" if leaked else None


def checkpoint_cases(quick: bool) -> list[Case]:
    cases: list[Case] = []
    f64 = np.arange(8, dtype="<f8")
    # item 5: F64 buffers are not FP6
    cases.append(Case("item05-f64", "inspect-fp8-with-f64-buffer", INSPECT, fixture_setup(
        "llmc_fp8", lambda ck: _add_tensor(ck, "model.layers.0.self_attn.rotary_emb.inv_freq", "F64", f64)),
        expect="accept", item=5))
    cases.append(quantize_case("item05-f64", "quantize-source-with-f64-buffer", expect="accept", item=5,
                               orig=lambda p: write_original(p, extra={
                                   "model.layers.0.self_attn.rotary_emb.inv_freq": ("F64", f64)})))
    # item 6: a source shard named like a file the export writes
    def ar_collision(p: Path) -> None:
        write_original(p)
        shard(p, 2, ["quantization_config.json", "model-2.safetensors"])
    amax = calibration_file({f"model.layers.{i}.{p}": 1.0 for i in range(NLAYERS) for p in PROJ})
    cases.append(quantize_case("item06-collision", "autoround-shard-named-quantization_config.json",
                               "name: s\nscheme: FP8_STATIC\nignore:\n  - lm_head\n", orig=ar_collision,
                               extra_argv=("--format", "auto-round", "--calibration", "cal.json"),
                               more=amax, names=("quantization_config.json",), item=6))
    # item 7: the source copy and special files in the source folder
    def with_link(target_or_kind: str, name: str):
        def orig(p: Path) -> None:
            write_original(p)
            if target_or_kind == "fifo":
                os.mkfifo(p / name)
            elif target_or_kind == "loop":
                os.symlink(name, p / name)
            else:
                os.symlink(target_or_kind, p / name)
        return orig
    for kind, name, expect, check in (("/etc/passwd", "tokenizer.json", "any", _no_passwd),
                                      ("fifo", "tokenizer.json", "any", None),
                                      ("loop", "tokenizer.json", "any", None),
                                      ("/etc/passwd", "generation_config.json", "any", _no_passwd)):
        cases.append(quantize_case("item07-source-links", f"{name}-is-{kind.strip('/').replace('/', '-')}",
                                   orig=with_link(kind, name), expect=expect, check=check, names=(name,), item=7))
    def config_out(p: Path) -> None:
        write_original(p)
        (p.parent / "elsewhere").mkdir()
        (p / "config.json").rename(p.parent / "elsewhere" / "config.json")
        os.symlink(p.parent / "elsewhere" / "config.json", p / "config.json")
    cases.append(quantize_case("item07-source-links", "config.json-symlink-out-without-flag", orig=config_out,
                               names=("config.json",), item=7))
    cases[-1].keep += ("elsewhere",)
    # item 8 (indexes are in the 'indexes' family); a config declaring layers no shard holds
    def no_layers(ck: Path) -> None:
        header, data = st_split((ck / "model.safetensors").read_bytes())
        hd = {k: v for k, v in json.loads(header).items() if "layers.1." not in k}
        tensors = {k: v for k, v in hd.items() if k != "__metadata__"}
        off, blobs = 0, []
        for k in sorted(tensors):
            b, e = tensors[k]["data_offsets"]
            blobs.append(data[b:e])
            tensors[k]["data_offsets"] = [off, off + e - b]
            off += e - b
        (ck / "model.safetensors").write_bytes(st_join(json.dumps(tensors).encode(), b"".join(blobs)))
    cases.append(Case("item08-incomplete", "config-says-2-layers-file-holds-1", INSPECT,
                      fixture_setup("llmc_fp8", no_layers), names=("ck", "num_hidden_layers", "layers"), item=8))
    # item 9: scale_dtype
    for scheme, sdt, want in (("FP8_DYNAMIC", "float32", "F32"), ("FP8_BLOCK", "float32", "F32"),
                              ("FP8", "float32", "F32"), ("FP8_DYNAMIC", "float16", "F16")):
        layer = "model.layers.0.mlp.down_proj"
        spec = SPEC + f"layer_config:\n  {layer}: {{scheme: {scheme}, scale_dtype: {sdt}}}\n"
        if scheme == "FP8":
            spec += "  # static inputs need --calibration\n"
        cases.append(quantize_case("item09-scale-dtype", f"{scheme}-{sdt}", spec, expect="any", names=(layer,),
                                   check=_want_scale(layer, want), item=9,
                                   extra_argv=("--calibration", "cal.json") if scheme == "FP8" else (),
                                   more=calibration_file({f"model.layers.{i}.{p}": 1.0 for i in range(2)
                                                          for p in PROJ})))
    # item 10: absurd but finite scale
    def huge_scale(ck: Path) -> None:
        _set_tensor(ck, "model.layers.0.self_attn.k_proj.weight_scale",
                    (np.array([3.39e38], dtype="<f4").view("<u4") >> 16).astype("<u2"))
    cases.append(Case("item10-absurd-scale", "k_proj-scale-3.39e38", INSPECT, fixture_setup("llmc_fp8", huge_scale),
                      names=("k_proj",), item=10))
    # item 12: a file of scales given as --calibration
    cal = {f"model.layers.{i}.{p}": 0.0123 / 448 for i in range(2) for p in PROJ}
    static = "name: s\nscheme: FP8\nignore:\n  - lm_head\n"
    cases.append(quantize_case("item12-calibration", "scales-given-as-amax", static,
                               extra_argv=("--calibration", "cal.json"), more=files({"cal.json": json.dumps(cal)}),
                               names=("cal.json",), item=12))
    # item 13: empty weights, permissions, --original, --recipe ''
    for name, shape in (("weight-0xK", (0, HIDDEN)), ("weight-Nx0", (HIDDEN, 0))):
        cases.append(quantize_case("item13-smaller", f"quantize-{name}", expect="any", item=13,
                                   names=("model.layers.0.self_attn.q_proj",),
                                   orig=lambda p, shape=shape: write_original(p, extra={
                                       "model.layers.0.self_attn.q_proj.weight": ("BF16", np.zeros(shape))})))
    cases.append(quantize_case("item13-smaller", "output-modes-follow-umask", expect="accept", check=_perms, item=13))
    cases.append(Case("item13-smaller", "inspect-original-is-fp8", ["inspect", "ck", "--original", "ck"],
                      fixture_setup("llmc_fp8"), names=("ck",), item=13))
    cases.append(quantize_case("item13-smaller", "recipe-empty-string", extra_argv=("--recipe", ""),
                               names=("--recipe", "recipe"), item=13))
    return cases


# -- special files as inputs and outputs ------------------------------------------------------------

def special(kind: str, path: str) -> Callable[[Path], None]:
    def setup(d: Path) -> None:
        p = d / path
        p.parent.mkdir(parents=True, exist_ok=True)
        if kind == "fifo":
            os.mkfifo(p)
        elif kind == "dir":
            p.mkdir()
        elif kind == "loop":
            os.symlink(p.name, p)
        elif kind == "dev-zero":
            os.symlink("/dev/zero", p)
        elif kind == "passwd":
            os.symlink("/etc/passwd", p)
    return setup


SPECIAL_KINDS = ("dev-zero", "fifo", "dir", "loop", "passwd")


def special_cases(quick: bool, golden: Path) -> list[Case]:
    def gold(d: Path) -> None:
        shutil.copytree(golden / "g", d / "g")
    cases = []
    kinds = ("dev-zero", "fifo", "dir") if quick else SPECIAL_KINDS
    for kind in kinds:
        item = 13 if kind in ("dev-zero", "fifo", "dir") else 7
        cases.append(Case("special-files", f"spec-validate/{kind}", ["spec", "validate", "x.yaml"],
                          special(kind, "x.yaml"), names=("x.yaml",), item=item, prefix="x.yaml"))
        if quick:
            continue
        cases.append(quantize_case("special-files", f"quantize-spec/{kind}", names=("x.yaml",), item=item,
                                   extra_argv=("--spec", "x.yaml"), more=special(kind, "x.yaml")))
        cases[-1].keep += ("x.yaml",)
        cases.append(quantize_case("special-files", f"calibration/{kind}", "name: s\nscheme: FP8\n", item=item,
                                   extra_argv=("--calibration", "x.json"), more=special(kind, "x.json"),
                                   names=("x.json",)))
        cases[-1].keep += ("x.json",)
        cases.append(Case("special-files", f"suite/{kind}", ["golden", "list", "x.yaml"], special(kind, "x.yaml"),
                          names=("x.yaml",), item=item))
        cases.append(Case("special-files", f"golden-outputs/{kind}", ["golden", "check", "g", "--outputs", "x.st"],
                          chain(gold, special(kind, "x.st")), names=("x.st",), item=item))
        cases.append(Case("special-files", f"inspect-ckpt/{kind}", ["inspect", "x.safetensors"],
                          special(kind, "x.safetensors"), names=("x.safetensors",), item=item))
        if kind in ("loop", "fifo", "dev-zero"):  # an output path that is not a folder to create
            cases.append(quantize_case("special-files", f"quantize-output/{kind}", names=("out",), item=item,
                                       more=special(kind, "out")))
            cases[-1].keep += ("out",)
            cases.append(Case("special-files", f"golden-generate-output/{kind}",
                              ["golden", "generate", "s.yaml", "-o", "out", "--quiet"],
                              chain(files({"s.yaml": SUITE}), special(kind, "out")), names=("out",), item=item,
                              watch=".", keep=("s.yaml", "out")))
    return cases


# -- CLI edges: encode, pipes, --json, read-only output, backends -----------------------------------

BACKENDS = {
    "import": "raise RuntimeError('boom at import')\n",
    "import-exit": "import sys\nsys.exit(3)\n",
    "construct": "class B:\n    name = 'b'\n    def __init__(self):\n        raise RuntimeError('boom')\n",
    "implements": "class B:\n    name = 'b'\n    def implements(self, op, params):\n"
                  "        raise RuntimeError('boom')\n",
    "implements-exit": "import sys\nclass B:\n    name = 'b'\n    def implements(self, op, params):\n"
                       "        sys.exit(0)\n",
    "encode-raises": "class B:\n    name = 'b'\n    def implements(self, op, params):\n        return None\n"
                     "    def encode(self, *a, **k):\n        raise RuntimeError('boom')\n"
                     "    def decode(self, *a, **k):\n        raise RuntimeError('boom')\n"
                     "    def scaled_mm(self, *a, **k):\n        raise RuntimeError('boom')\n",
    "not-a-backend": "B = 42\n",
}


def cli_cases(quick: bool) -> list[Case]:
    cases = []
    for vals in (["0x1p99999"], ["-0x1p99999"], ["1" + "0" * 400], ["0x1p-99999"], ["nan(0x1)"], [""], ["1e999"]):
        expect = "accept" if vals[0] in ("1" + "0" * 400, "0x1p-99999", "1e999") else "refuse"
        cases.append(Case("cli", f"encode/{vals[0][:12]}", ["encode", "--", *vals], expect=expect, names=(vals[0][:8],),
                          item=4))
    for vals in (["0x1ff"], ["-1"], ["0x"], ["9" * 5000]):
        cases.append(Case("cli", f"decode/{vals[0][:12]}", ["decode", *vals], names=(vals[0][:8],), item=4))
    cases.append(Case("cli", "encode/format-unknown", ["encode", "1", "--format", "float8_e9m9"], names=("e9m9",)))
    cases.append(Case("cli", "json-into-missing-folder",
                      ["golden", "check", "g", "--outputs", "outputs.safetensors", "--json", "missing/r.json"],
                      None, names=("missing",), item=4))
    cases.append(quantize_case("cli", "output-in-read-only-place", names=("out", "/proc"), item=4))
    cases[-1].argv[2] = "/proc/fp8ref-hostile-out"
    cases.append(quantize_case("cli", "output-name-too-long", names=("o" * 20,), item=4))
    cases[-1].argv[2] = "o" * 300
    cases.append(quantize_case("cli", "output-parent-is-a-file", names=("spec.yaml",), item=4))
    cases[-1].argv[2] = "spec.yaml/out"
    for name, body in BACKENDS.items():
        mod = "bk_" + name.replace("-", "_")
        argv = ["conform", "--backend", f"{mod}" + ("" if name.startswith("import") else ":B"), "--suite", "s.yaml",
                "--quiet"]
        if name.startswith("import"):
            argv[2] += ":B"
        # a backend that loads but raises in a case: the run's report says so (ERROR lines, result: FAIL)
        cases.append(Case("cli", f"backend-raises/{name}", argv,
                          files({f"{mod}.py": body, "s.yaml": SUITE}), names=(mod,), item=4, verdict="result: FAIL"))
    return cases


def golden_json_setup(golden: Path) -> Callable[[Path], None]:
    def s(d: Path) -> None:
        shutil.copytree(golden / "g", d / "g")
        shutil.copy(golden / "outputs.safetensors", d / "outputs.safetensors")
    return s


# -- scripted cases: signals, concurrent exports, broken pipes ------------------------------------

def _complete_checkpoint(out: Path) -> bool:
    """A renamed-into-place output must be whole: config plus every shard with all its data."""
    try:
        shards = sorted(out.glob("*.safetensors"))
        if not (out / "config.json").is_file() or not shards:
            return False
        for p in shards:
            header, data = st_split(p.read_bytes())
            hd = json.loads(header)
            if max(v["data_offsets"][1] for k, v in hd.items() if k != "__metadata__") != len(data):
                return False
        return True
    except (OSError, ValueError, KeyError, struct.error):
        return False


def _spawn(argv: list[str], d: Path, **kw) -> subprocess.Popen:
    return subprocess.Popen(cli_command(argv), cwd=d, env=_pythonpath(), stdin=subprocess.DEVNULL,
                            stdout=kw.pop("stdout", subprocess.PIPE), stderr=subprocess.PIPE, start_new_session=True)


def _collect(p: subprocess.Popen, timeout: float, t0: float) -> Outcome:
    try:
        out, err = p.communicate(timeout=timeout)
        timed_out = False
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        timed_out = True
    return _outcome(p.returncode, out or b"", err or b"", timed_out, t0)


def signal_case(kind: str, sig: signal.Signals, delay: float) -> Case:
    """Send ``sig`` after ``delay`` s, then rerun: nothing may be left next to the output after
    either (after SIGKILL: after the rerun)."""
    def script(d: Path, ctx: Ctx) -> tuple[Outcome, list[str], str]:
        if kind == "quantize":
            write_original(d / "orig", scale_rows=24)
            (d / "spec.yaml").write_text(SPEC)
            argv = ["quantize", "orig", "out", "--spec", "spec.yaml", "--no-progress"]
            rerun = [*argv, "--force"]
            inputs = {"orig", "spec.yaml"}
        else:
            argv = ["golden", "generate", "fp8-static-w8a8", "-o", "out", "--quiet"]
            rerun = argv
            inputs = set()
        t0 = time.monotonic()
        p = _spawn(argv, d)
        time.sleep(delay)
        if p.poll() is None:
            os.killpg(p.pid, sig)
        first = _collect(p, ctx.timeout * 4, t0)
        left = []
        if sig != signal.SIGKILL:
            left = [n for n in sorted(os.listdir(d)) if n not in inputs | {"out"}]
            if (d / "out").exists() and kind == "quantize" and not _complete_checkpoint(d / "out"):
                left.append("out (incomplete)")
        if first.timed_out or "Traceback (most recent call last)" in first.stderr:
            return first, left, f"{sig.name} after {delay:.2f} s: " + last_exception(first.stderr)
        if kind == "golden" and (d / "out").exists() and first.rc != 0:
            # the folder appears by one rename: a signal after it (the exit, the interpreter's teardown)
            # leaves it whole, and `golden verify` must pass on it; nothing else may be left beside it
            check = _collect(_spawn(["golden", "verify", "out"], d), ctx.timeout * 4, time.monotonic())
            if check.rc != 0:
                left.append("out (an incomplete golden folder from a killed run)")
            else:
                left = [n for n in sorted(os.listdir(d)) if n not in inputs | {"out"}]
                return check, left, f"{sig.name} after {delay:.2f} s came after the folder was whole " \
                                    f"(rc={first.rc} sig={first.signal}); golden verify passed on it"
        if first.rc == 0 and kind == "golden":  # finished before the signal; golden generate has no --force
            return first, left, f"{sig.name} after {delay:.2f} s came after the end (rc=0)"
        second = _collect(_spawn(rerun, d), ctx.timeout * 4, time.monotonic())
        left += [f"{n} (after rerun)" for n in sorted(os.listdir(d)) if n not in inputs | {"out"}]
        note = f"{sig.name} after {delay:.2f} s (first run rc={first.rc} sig={first.signal}); rerun rc={second.rc}"
        return second, left, note
    return Case("signals", f"{kind}/{sig.name}-at-{delay:.2f}s", expect="accept", script=script, item=6)


def concurrent_case(n: int) -> Case:
    def script(d: Path, ctx: Ctx) -> tuple[Outcome, list[str], str]:
        write_original(d / "orig", scale_rows=8)
        (d / "spec.yaml").write_text(SPEC)
        t0 = time.monotonic()
        procs = [_spawn(["quantize", "orig", "out", "--spec", "spec.yaml", "--no-progress"], d) for _ in range(n)]
        outs = [_collect(p, ctx.timeout * 4, t0) for p in procs]
        left = [x for x in sorted(os.listdir(d)) if x not in ("orig", "spec.yaml", "out")]
        rcs = [o.rc for o in outs]
        bad = [o for o in outs if o.rc != 0] or outs
        return bad[0], left, f"{n} concurrent exports: exit codes {rcs}"
    return Case("concurrent", f"{n}-exports-one-output", expect="refuse", script=script, names=("out",), item=11)


def broken_pipe_case(argv: list[str], setup: Callable[[Path], None], name: str) -> Case:
    def script(d: Path, ctx: Ctx) -> tuple[Outcome, list[str], str]:
        setup(d)
        r, w = os.pipe()
        t0 = time.monotonic()
        p = _spawn(argv, d, stdout=w)
        os.close(w)
        os.close(r)  # the reader is gone before the first write: `| head -0`
        o = _collect(p, ctx.timeout, t0)
        if o.rc == 141 and not o.stderr.strip():  # 128 + SIGPIPE, quietly: what `cmd | head -0` should see
            o.rc = 0
        return o, [], f"stdout closed: rc={o.rc}"
    return Case("cli", f"broken-pipe/{name}", argv, expect="any", script=script, item=4)


# ---------------------------------------------------------------------------------------------
# Assembly, summary, command line.

def corpus(quick: bool, seed: int, golden: Path) -> list[Case]:
    rng = random.Random(seed)
    cases = header_cases(quick, rng, 0 if quick else 3000)
    cases += config_cases(quick, rng)
    cases += yaml_cases(quick)
    cases += int_cases(quick)
    cases += golden_cases(quick, golden)
    cases += regex_cases(quick)
    cases += checkpoint_cases(quick)
    cases += special_cases(quick, golden)
    cli = cli_cases(quick)
    for c in cli:
        if c.name == "json-into-missing-folder":
            c.setup = golden_json_setup(golden)
    cases += cli
    cases.append(broken_pipe_case(INSPECT, fixture_setup("llmc_fp8"), "inspect"))
    cases.append(broken_pipe_case(["formats"], lambda d: None, "formats"))
    cases.append(broken_pipe_case(["golden", "list", "fp8-static-w8a8"], lambda d: None, "golden-list"))
    cases.append(concurrent_case(2))
    sigs = (signal.SIGTERM, signal.SIGHUP, signal.SIGKILL)
    n_sig = 2 if quick else 8
    for kind in ("quantize", "golden"):
        for k in range(n_sig):
            cases.append(signal_case(kind, sigs[k % 3], round(rng.uniform(1.0, 3.5), 2)))
    if quick:
        cases = [c for c in cases if not (c.family == "yaml" and c.name.startswith("show/"))]
    return cases


def summarize(results: list[dict]) -> str:
    if not results:
        return "no case matched"
    by_family: dict[str, Counter] = defaultdict(Counter)
    for r in results:
        by_family[r["family"]][r["class"]] += 1
    total = Counter(r["class"] for r in results)
    cols = [c for c in CLASSES if total[c]]
    width = max(len(f) for f in by_family) + 2
    lines = [f"{'family':{width}s}" + "".join(f"{c:>15s}" for c in cols) + f"{'cases':>8s}"]
    for fam in sorted(by_family):
        lines.append(f"{fam:{width}s}" + "".join(f"{by_family[fam][c]:15d}" for c in cols)
                     + f"{sum(by_family[fam].values()):8d}")
    lines.append(f"{'total':{width}s}" + "".join(f"{total[c]:15d}" for c in cols) + f"{len(results):8d}")
    causes = Counter((r.get("exception", "").split(":")[0], r.get("origin", "")) for r in results
                     if r["class"] == "traceback")
    if causes:
        lines.append("\ntracebacks by origin (innermost fp8ref frame):")
        lines += [f"  {n:5d}  {exc}  {where}" for (exc, where), n in causes.most_common(25)]
    others = Counter((r["class"], r["family"]) for r in results if r["class"] in ("hang", "crash", "silent",
                                                                                "partial-output", "wrong-refusal"))
    if others:
        lines.append("\nother failures:")
        lines += [f"  {n:5d}  {cls:15s} {fam}" for (cls, fam), n in sorted(others.items())]
    return "\n".join(lines)


FAMILIES = ("headers", "configs", "indexes", "yaml", "item01-integers", "golden", "item03-regex", "item05-f64",
            "item06-collision", "item07-source-links", "item08-incomplete", "item09-scale-dtype",
            "item10-absurd-scale", "item12-calibration", "item13-smaller", "special-files", "cli", "concurrent",
            "signals")


def run(*, quick: bool = False, seed: int = 10, timeout: float | None = None, jobs: int = 2,
        families: list[str] | None = None, pattern: str | None = None, keep: Path | None = None,
        verbose: bool = False, list_only: bool = False) -> tuple[list[dict], list[Case]]:
    """Build the corpus in a temporary folder, run it, return (results, cases)."""
    timeout = timeout or (5.0 if quick else 10.0)
    os.umask(0o022)
    with tempfile.TemporaryDirectory(prefix="fp8ref-hostile-") as tmp:
        base = Path(tmp)
        scratch = base / "_fork"
        scratch.mkdir()
        golden = make_golden(base, ForkRunner(scratch), timeout)
        cases = corpus(quick, seed, golden)
        if families:
            cases = [c for c in cases if c.family in families]
        if pattern:
            cases = [c for c in cases if fnmatch.fnmatch(c.id, pattern)]
        if list_only:
            return [], cases
        if keep:
            keep.mkdir(parents=True, exist_ok=True)
        return run_cases(cases, base, timeout=timeout, jobs=jobs, seed=seed, verbose=verbose, keep=keep), cases


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a few hundred cases (< 60 s)")
    ap.add_argument("--seed", type=int, default=10)
    ap.add_argument("--timeout", type=float, default=None, help="seconds per case (default 10; --quick 5)")
    ap.add_argument("--jobs", type=int, default=2, help="cases run at once")
    ap.add_argument("--family", action="append", help="only these families (repeatable)")
    ap.add_argument("--case", help="only cases whose id matches this glob")
    ap.add_argument("--keep", type=Path, help="build the cases under this folder and keep them (to reproduce)")
    ap.add_argument("--json", type=Path, help="write every result to this file")
    ap.add_argument("--list", action="store_true", help="list the case ids and commands, run nothing")
    ap.add_argument("-v", "--verbose", action="store_true", help="one line per case")
    args = ap.parse_args(argv)
    if args.list:
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # `--list | head` (this process forks nothing then)
    t0 = time.monotonic()
    results, cases = run(quick=args.quick, seed=args.seed, timeout=args.timeout, jobs=args.jobs,
                         families=args.family, pattern=args.case, keep=args.keep, verbose=args.verbose,
                         list_only=args.list)
    if args.list:
        for c in cases:
            print(f"{c.id}\t{c.command()}")
        return 0
    timeout = args.timeout or (5.0 if args.quick else 10.0)
    if args.keep:
        for i, c in enumerate(cases):
            print(f"{args.keep}/{i:05d}: {c.id}: (cd {args.keep}/{i:05d} && {c.command()})")
    print(summarize(results))
    elapsed = time.monotonic() - t0
    print(f"\n{len(results)} cases in {elapsed:.0f} s; failures (traceback, hang, crash, silent, partial-output): "
          f"{sum(r['class'] in BAD for r in results)}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"seed": args.seed, "quick": args.quick, "timeout": timeout,
                                         "seconds": round(elapsed, 1), "results": results}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
