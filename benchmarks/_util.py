"""Shared helpers for the benchmarks: best-of-N timing and peak-RSS measurement (Linux)."""

from __future__ import annotations

import time

CLOCK = time.perf_counter  # a benchmark may switch it (bench_matmul.py --clock cpu: time.process_time)


def best_time(fn, repeat: int = 5, min_total: float = 0.0) -> float:
    """The best of ``repeat`` calls, and of more until they took ``min_total`` seconds in all."""
    best, total, n = float("inf"), 0.0, 0
    while n < repeat or total < min_total:
        start = CLOCK()
        fn()
        t = CLOCK() - start
        best, total, n = min(best, t), total + t, n + 1
    return best


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def peak_extra_rss(fn) -> int:
    """Bytes by which the process's peak RSS rises above its RSS while ``fn`` runs."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS
    before = _status_kib("VmRSS")
    fn()
    return (_status_kib("VmHWM") - before) * 1024


def cpu_model() -> str:
    """The CPU's model name, family and model numbers (a VM's name alone, "AMD EPYC", does not tell
    Zen 3 from Zen 4) and the x86 features the loops pick paths by (Linux's /proc/cpuinfo;
    platform.processor() elsewhere)."""
    import platform

    info = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break  # the first processor's block
                key, _, value = line.partition(":")
                info[key.strip()] = value.strip()
    except OSError:
        pass
    model = info.get("model name") or platform.processor() or platform.machine()
    if "cpu family" in info and "model" in info:
        model += f", family {info['cpu family']} model {info['model']}"
    flags = set(info.get("flags", "").split())
    shown = [f for f in ("avx2", "avx512f", "avx512bw", "avx512vbmi", "avx512_vnni") if f in flags]
    return f"{model} ({', '.join(shown) or 'no AVX2/AVX-512'})"


def load_average() -> str:
    """The 1, 5 and 15 minute load averages (other work on a shared machine skews every timing)."""
    import os

    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "unknown"


def quantize_tasks(w, qa, out, stream: bool = True, lib=None):
    """The C tasks one ``fp8ref.quantize(w, qa, out=out)`` call runs, captured (that call runs them
    once), as a function that runs them again on the calling thread with nothing else: the loops' own
    cost, without the call's Python, its table look-ups and its allocations. ``stream``: the codes
    written around the cache, as an 8192x8192 weight's are, whatever the size. The tasks of `lib` (a
    build's library, tools/ab_kernels.py), else fp8ref's, bound to the level current at the capture;
    `out` must stay alive while the function is used (the tasks write into it)."""
    import ctypes

    from fp8ref import _native
    from fp8ref.quant import quantize

    captured, real = [], _native.parallel

    def capture(task, job, n, **kw):
        captured.append((getattr(_native.kernels() if lib is None else lib, task), job, n, kw.get("keep")))
        return real(task, job, n, **kw)

    _native.parallel = capture
    try:
        quantize(w, qa, out=out)
    finally:
        _native.parallel = real
    for _fn, job, _n, _keep in captured:
        if hasattr(job, "stream"):
            job.stream = int(stream)

    def again() -> None:
        for fn, job, n, _keep in captured:
            fn(ctypes.byref(job), 0, n)

    return again


# The peer "reading both files": every byte of the given files into one reused 64 MiB buffer, unbuffered;
# run as `python -c READ_FILES FILE...`, it prints its seconds (bench_models.py, bench_verify.py).
READ_FILES = r"""
import sys, time
t0 = time.perf_counter()
buf = bytearray(1 << 26)
for path in sys.argv[1:]:
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buf):
            pass
print(time.perf_counter() - t0)
"""
